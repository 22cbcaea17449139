"""The CPU's arithmetic features (native fp16 / bf16 units), detected once or injected for tests."""

from __future__ import annotations

import functools
import os
import platform
from collections.abc import Iterable

import torch

from ampnb._interrupt import Guard

# Flags that name real fp16 / bf16 arithmetic units (x86 AVX512/AMX, ARM "asimdhp" / "bf16").
# mkldnn's bf16 check also accepts plain AVX512 (emulated bf16), so it is only used where the
# OS exposes no flags; its fp16 check is exact and counts as a flag of its own.
FP16_FLAGS = frozenset({"avx512_fp16", "amx_fp16", "asimdhp", "mkldnn_fp16"})
BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16", "bf16", "mkldnn_bf16"})

_override: list[frozenset[str]] = []  # innermost injected feature set last


def _cpuinfo(*keys: str) -> str | None:
    """The first /proc/cpuinfo line's value whose key is one of keys (None where absent)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.split(":")[0].strip() in keys:
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


# Flags of the x86 extensions that torch's and oneDNN's kernels leave unused when capped to
# AVX2 or below (ATEN_CPU_CAPABILITY=avx2, ONEDNN_MAX_CPU_ISA=AVX2: a newer CPU acting as an
# older one), with mkldnn's probes of them.
_WIDE = ("avx512", "amx", "mkldnn_")


def _capped() -> bool:
    """Whether torch's or oneDNN's CPU kernels are capped below AVX512 on an x86 CPU."""
    isa = os.environ.get("ONEDNN_MAX_CPU_ISA", "").strip().upper()
    if isa and not isa.startswith(("AVX512", "AVX10", "AMX", "ALL", "DEFAULT")):
        return True
    cap = torch.backends.cpu.get_cpu_capability()
    return cap == "AVX2" or (cap == "DEFAULT" and platform.machine().lower() in ("x86_64", "amd64"))


@functools.cache
def detected_features() -> frozenset[str]:
    """This CPU's ISA flags (from /proc/cpuinfo), plus mkldnn's probes as 'mkldnn_fp16/bf16';
    without the AVX512/AMX ones where torch's or oneDNN's kernels are capped below them."""
    flags = set((_cpuinfo("flags", "Features") or "").split())
    mkldnn = torch.ops.mkldnn
    probe = getattr(mkldnn, "_is_mkldnn_fp16_supported", None)
    if probe is not None and probe():
        flags.add("mkldnn_fp16")
    probe = getattr(mkldnn, "_is_mkldnn_bf16_supported", None)
    if not flags and probe is not None and probe():
        flags.add("mkldnn_bf16")
    if _capped():
        flags = {f for f in flags if not f.startswith(_WIDE)}
    return frozenset(flags)


def cpu_features() -> frozenset[str]:
    """The CPU features ampnb decides by: the injected set inside `cpu_features_as`, else detected."""
    return _override[-1] if _override else detected_features()


def _inject(flags: frozenset[str]) -> frozenset[str]:
    _override.append(flags)
    return flags


def cpu_features_as(flags: Iterable[str]) -> Guard:
    """Decide support as if the CPU had exactly these ISA flags (tests; 'what if' tables)."""
    if isinstance(flags, str):
        raise ValueError(f"cpu_features_as takes an iterable of flag names, got the string {flags!r}")
    injected = frozenset(flags)
    return Guard(lambda: _inject(injected), lambda _: _override.pop())


def cpu_native(fmt_name: str) -> bool:
    """Whether this CPU has hardware units for fp16 / bf16 arithmetic (not emulation)."""
    wanted = {"fp16": FP16_FLAGS, "bf16": BF16_FLAGS}.get(fmt_name)
    return wanted is not None and bool(cpu_features() & wanted)


def cpu_model() -> str:
    """The CPU's model name (platform's answer where /proc/cpuinfo is absent)."""
    return _cpuinfo("model name") or platform.processor() or platform.machine()
