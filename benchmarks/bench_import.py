"""`import ampnb` beyond `import torch`, in fresh interpreters (medians of several)."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys

from benchmarks._common import Result, ms

RUNS = 5
GOAL_S = 0.3

# Each probe imports torch first (untimed), then times the ampnb work in the same process.
PROBES = {
    "import ampnb": "import ampnb",
    "import ampnb + Workbench, get_mode, quantize": (
        "import ampnb; ampnb.Workbench; ampnb.get_mode; ampnb.quantize"),
}
_TEMPLATE = """
import json, time
import torch
t0 = time.perf_counter()
{code}
print(json.dumps(time.perf_counter() - t0))
"""


def _once(code: str) -> float:
    out = subprocess.run([sys.executable, "-c", _TEMPLATE.format(code=code)], capture_output=True,
                         text=True, timeout=120, check=True)
    return float(json.loads(out.stdout.strip().splitlines()[-1]))


def _medians() -> dict[str, float]:
    """Round-robin over the probes, so that machine load hits all alike."""
    times: dict[str, list[float]] = {name: [] for name in PROBES}
    for _ in range(RUNS):
        for name, code in PROBES.items():
            times[name].append(_once(code))
    return {name: statistics.median(t) for name, t in times.items()}


def run() -> list[Result]:
    found = _medians()
    bare, used = found["import ampnb"], found["import ampnb + Workbench, get_mode, quantize"]
    return [
        Result("import ampnb beyond import torch (fresh interpreter)",
               f"{ms(bare)} median of {RUNS}", bare, f"<= {GOAL_S} s", bare <= GOAL_S),
        Result("import ampnb + first core names (Workbench, get_mode, quantize)",
               f"{ms(used)} median of {RUNS}", used, "reported", None),
    ]
