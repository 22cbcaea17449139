"""Which devices exist and what each can do: the support table, checked against what torch runs."""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass

import torch

from ampnb.cpu import cpu_features, cpu_model, cpu_native, detected_features
from ampnb.device.spec import LABEL as SPEC_LABEL
from ampnb.device.spec import SOURCES, SpecColumn, spec_columns
from ampnb.display import Table
from ampnb.formats import FORMATS, FloatFormat, get_format
from ampnb.fp16_kernels import emulates_fp16, fp16_kernels_note
from ampnb.modes import MODES, PrecisionMode, get_mode

# ---------------------------------------------------------------- devices


@dataclass(frozen=True)
class DeviceInfo:
    """A device present on this machine."""

    name: str                           # what torch.device accepts: "cpu", "cuda:0", "mps"
    type: str                           # "cpu", "cuda" or "mps"
    label: str                          # human description, e.g. "NVIDIA A100-SXM4-40GB"
    capability: tuple[int, int] | None  # CUDA compute capability; None elsewhere


@functools.cache
def _devices() -> tuple[DeviceInfo, ...]:
    cpu_isa = torch.backends.cpu.get_cpu_capability()
    found = [DeviceInfo("cpu", "cpu", f"{cpu_model()} ({cpu_isa}, {torch.get_num_threads()} threads)",
                        None)]
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            found.append(DeviceInfo(f"cuda:{i}", "cuda", torch.cuda.get_device_name(i),
                                    tuple(torch.cuda.get_device_capability(i))))
    if torch.backends.mps.is_available():
        found.append(DeviceInfo("mps", "mps", "Apple Metal (MPS)", None))
    return tuple(found)


def devices() -> list[DeviceInfo]:
    """Every device present: cpu, then cuda:N, then mps."""
    return list(_devices())


def get_device(device: str | torch.device | DeviceInfo) -> DeviceInfo:
    """A present device by name ("cpu", "cuda", "cuda:0", "mps") or torch.device."""
    present = _devices()
    names = ", ".join(d.name for d in present)
    try:
        dev = torch.device(device.name if isinstance(device, DeviceInfo) else device)
    except (RuntimeError, TypeError, ValueError):
        raise ValueError(f"unknown device {device!r}; available: {names}") from None
    if dev.type == "cuda" and dev.index is None and torch.cuda.is_available():
        dev = torch.device("cuda", torch.cuda.current_device())
    # "cpu" and "cpu:0" are the one CPU device; any other index names a device that is absent.
    single = dev.type in ("cpu", "mps") and dev.index in (None, 0)
    wanted = dev.type if single else str(dev)
    for d in present:
        if d.name == wanted:
            return d
    raise ValueError(f"device {str(device)!r} is not available on this machine; available: {names}")


def sync(device: str | torch.device) -> None:
    """Wait for the device's queued work, so that a timer around it measures it."""
    kind = torch.device(device).type
    if kind == "cuda":
        torch.cuda.synchronize(device)
    elif kind == "mps":
        torch.mps.synchronize()


# ---------------------------------------------------------------- support


@dataclass(frozen=True)
class Support:
    """Whether a mode or format runs on a device, at native speed, and why (not)."""

    ok: bool
    native: bool
    reason: str = ""

    def __bool__(self) -> bool:
        return self.ok

    @property
    def text(self) -> str:
        """Cell text: 'yes (native)', 'yes (slow: ...)', 'no: ...'."""
        if not self.ok:
            return f"no: {self.reason}"
        return f"yes ({self.reason})" if self.reason else "yes (native)"


_FP8_MATMUL_CC = (8, 9)  # Ada/Hopper: first GPUs with FP8 tensor cores
AMPERE_CC = (8, 0)      # bf16 and TF32 tensor cores


def _format_support(f: FloatFormat, dev: DeviceInfo) -> Support:
    cc = dev.capability
    cc_text = f"this GPU: {cc[0]}.{cc[1]}" if cc else ""
    if f.name == "tf32":
        if dev.type != "cuda":
            return Support(False, False, "needs CUDA (Ampere+, compute capability >= 8.0)")
        if cc < AMPERE_CC:
            return Support(False, False, f"needs compute capability >= 8.0 ({cc_text})")
        return Support(True, True)
    if f.torch_dtype is None:
        return Support(False, False, f"no torch dtype for {f.name}: emulate it with ampnb.quantize")
    if dev.type == "mps" and (f.bits == 8 or f.name == "fp64"):
        return Support(False, False, f"MPS has no {f.name}")
    if f.bits == 8:
        if "fnuz" in f.name:
            native = bool(torch.version.hip) and dev.type == "cuda" and "gfx94" in str(
                getattr(torch.cuda.get_device_properties(dev.name), "gcnArchName", ""))
            return Support(True, native, "" if native else "emulated: FNUZ FP8 units are on AMD MI300")
        if dev.type == "cuda" and cc >= _FP8_MATMUL_CC:
            return Support(True, True)
        need = f"compute capability >= 8.9, {cc_text}" if cc else "a GPU with compute capability >= 8.9"
        return Support(True, False, f"emulated: FP8 matmul needs {need}")
    if f.name == "bf16" and dev.type == "cuda" and cc < AMPERE_CC:
        # torch.cuda.is_bf16_supported() (with emulation, its default) says yes here too
        return Support(True, False, f"emulated: no bf16 tensor cores below compute capability 8.0 "
                                    f"({cc_text})")
    if f.name in ("fp16", "bf16") and dev.type == "cpu" and not cpu_native(f.name):
        return Support(True, False, f"slow: no native {f.name} units on this CPU")
    return Support(True, True)


def support(mode_or_format: object, device: str | torch.device | DeviceInfo = "cpu") -> Support:
    """Whether a precision mode or float format runs on a device, natively, and why (not).

    A string that names a format ("bf16", "fp16") means the format; modes go by their full
    name ("bf16-mixed") or a legacy number (16, 32, 64).
    """
    target = _mode_or_format(mode_or_format)
    if _absent_device_type(device):
        kind = torch.device(device).type.upper()
        return Support(False, False, f"needs {kind}, which this machine does not have")
    return _support_on(target, get_device(device))


def _support_on(target: object, dev: DeviceInfo) -> Support:
    """`support` on one device, deciding CUDA by its compute capability (tests pass a GPU's)."""
    if isinstance(target, FloatFormat):
        return _format_support(target, dev)
    found = target.availability(dev.name)
    if not found.ok:
        return Support(False, False, found.reason)
    if found.reason:  # the mode runs, but says how: FP8 emulated, or real with Transformer Engine
        return Support(True, found.reason.startswith("real"), found.reason)
    if target.compute_dtype == torch.float16 and emulates_fp16(dev.name):
        why = "fp16_kernels='emulated'" if cpu_native("fp16") else "no native fp16 units on this CPU"
        return Support(True, False, f"emulated: {fp16_kernels_note(dev.name)} ({why})")
    return _format_support(get_format(target.compute_dtype), dev)


def _mode_or_format(x: object) -> object:
    if isinstance(x, PrecisionMode) or (isinstance(x, str) and x.strip().lower() in MODES):
        return get_mode(x)
    with contextlib.suppress(ValueError, TypeError):
        return get_format(x)
    with contextlib.suppress(ValueError, TypeError, AttributeError):
        return get_mode(x)
    raise ValueError(f"unknown mode or format {x!r}; modes: {', '.join(MODES)}; "
                     f"formats: {', '.join(FORMATS)}")


def _absent_device_type(device: object) -> bool:
    """A valid torch device type whose hardware is missing here (e.g. 'cuda' on a laptop)."""
    try:
        kind = torch.device(device.name if isinstance(device, DeviceInfo) else device).type
    except (RuntimeError, TypeError, ValueError):
        return False
    return kind in ("cuda", "mps") and all(d.type != kind for d in _devices())


def support_table(spec: bool = True) -> Table:
    """Modes then formats against every device present (measured: supported, native, or why
    not) and, with `spec`, against accelerators as their documents describe them (labelled so)."""
    present = _devices()
    names = (*MODES, *FORMATS)
    rows = [[name, *(support(name, d).text for d in present)] for name in names]
    notes = [f"{d.name}: {d.label}" + (f", compute capability {d.capability[0]}.{d.capability[1]}"
                                        if d.capability else "") for d in present]
    if cpu_features() != detected_features():  # a "what if" table, from cpu_features_as
        notes.append("cpu answers as if it had the CPU flags: "
                     f"{', '.join(sorted(cpu_features())) or 'none'} (injected, not this CPU's)")
    notes.append("Native fp16/bf16 on a CPU means AVX512-FP16/AMX-FP16 and AVX512-BF16/AMX-BF16 "
                 "(x86) or the ARM fp16/bf16 extensions; without them torch runs slower fallback kernels.")
    headers = ["mode / format", *(d.name for d in present)]
    if spec:
        columns = spec_columns()
        headers += [c.header for c in columns]
        notes += _spec_cells(rows, columns)
    caption = "Precision support on this machine" + (
        f" (measured) and elsewhere (spec: {SPEC_LABEL})" if spec else "")
    return Table(tuple(headers), [tuple(r) for r in rows], caption=caption, notes=notes)


def _spec_cells(rows: list[list[str]], columns: tuple[SpecColumn, ...]) -> list[str]:
    """Append each spec column's cells to `rows` as 'status [n]'; the notes [n] and sources."""
    numbered: dict[tuple[str, tuple[str, ...]], int] = {}
    for row in rows:
        for column in columns:
            cell = column.cells.get(row[0])
            if cell is None:
                row.append("-")
                continue
            n = numbered.setdefault((cell.reason, cell.sources), len(numbered) + 1)
            row.append(f"{cell.status} [{n}]")
    used = dict.fromkeys(key for _, keys in numbered for key in keys)
    return [f"Columns marked (spec) are {SPEC_LABEL}: [n] is why, each source is named below.",
            *(f"[{n}] {reason} (source: {', '.join(keys)})" for (reason, keys), n in numbered.items()),
            *(f"{key}: {SOURCES[key].url} — {SOURCES[key].says}" for key in used)]
