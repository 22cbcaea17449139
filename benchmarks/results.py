"""The results file `make bench` writes: every row, per benchmark module, with the machine it ran on.

The README and the docs pages cite figures from this file instead of typing them
(tests/test_readme_figures.py checks that every number in their prose is found here or in a
checked output). Running a subset (`python -m benchmarks fp16`) replaces only that module's
section.
"""

from __future__ import annotations

import datetime
import os
import platform
import re
from collections.abc import Iterable
from pathlib import Path

import torch

from benchmarks._common import Result

PATH = Path(__file__).with_name("RESULTS.md")
# The CPU flags that decide what runs natively here (ampnb.cpu reads the same ones).
FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_fp16", "asimdhp", "bf16")
_SECTION = re.compile(r"^## (bench_\w+)$", re.M)


def machine() -> str:
    """One line: CPU model, cores, the flags that matter, torch build, GPU if any."""
    from ampnb.cpu import _cpuinfo, detected_features

    model = _cpuinfo("model name", "Model", "Hardware") or platform.processor() or "unknown CPU"
    flags = sorted(f for f in FLAGS if f in detected_features()) or ["none of " + "/".join(FLAGS)]
    gpu = f"; GPU {torch.cuda.get_device_name(0)}" if torch.cuda.is_available() else "; no GPU"
    return (f"{model}, {os.cpu_count()} cores, flags {' '.join(flags)}; torch {torch.__version__}, "
            f"Python {platform.python_version()}{gpu}")


def section(module: str, rows: Iterable[Result], when: datetime.datetime | None = None) -> str:
    """A module's rows as a Markdown section headed by the date and machine."""
    when = when or datetime.datetime.now(datetime.UTC)
    lines = [f"## {module}", "", f"{when:%Y-%m-%d %H:%M} UTC, {machine()}", "",
             "| benchmark | measured | ratio | goal | met |", "|---|---|---|---|---|"]
    for r in rows:
        ratio = "-" if r.ratio is None else f"{r.ratio:.2f}"
        met = {True: "yes", False: "NO", None: "n/a"}[r.ok]
        cells = (r.name.strip(), r.figure, ratio, r.goal, met)
        lines.append("| " + " | ".join(str(c).replace("|", "\\|") for c in cells) + " |")
    return "\n".join(lines) + "\n"


def sections(text: str) -> dict[str, str]:
    """The file's sections by module name, in file order."""
    starts = [(m.group(1), m.start()) for m in _SECTION.finditer(text)]
    ends = [s for _, s in starts[1:]] + [len(text)]
    return {name: text[start:end].rstrip() + "\n" for (name, start), end in zip(starts, ends)}


HEADER = ("# Benchmark results\n\nWritten by `make bench` (`python -m benchmarks [names]`); each "
          "section is the last run of one benchmark module, on the machine its first line names. "
          "Ratios come from one run with interleaved repeats; machines are noisy.\n\n")


def write(results: dict[str, list[Result]], path: Path = PATH) -> Path:
    """Replace the sections of the modules that ran; keep the others as they were."""
    kept = sections(path.read_text()) if path.exists() else {}
    for module, rows in results.items():
        kept[module] = section(module, rows)
    path.write_text(HEADER + "\n".join(kept[k] for k in sorted(kept)))
    return path
