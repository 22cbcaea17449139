"""What `ampnb.watch` records per optimizer step, and its JSON-lines log (the one log format).

A record is data only (frozen, JSON round-trip exact); the watch fills it, the table, plot, panel,
TensorBoard writer and the integrations read it. Headroom is derived from amax and the formats'
bits on demand, never stored.
"""

from __future__ import annotations

import json
import math
import types
import typing
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any

from ampnb.formats import get_format
from ampnb.formats import headroom as _headroom

LOG_NAME = "records.jsonl"
HEADROOM_FORMATS = ("fp16", "bf16", "fp8_e4m3")  # the formats each layer's headroom is told against
KINDS = ("act", "act_grad", "grad")               # activations, activation gradients, parameter grads


@dataclass(frozen=True)
class LayerStats:
    """One module's ranges at one step, all unscaled (divided by the loss scale where scaled)."""

    module: str                 # name as the user wrote the model (no DDP 'module.' / compile prefix)
    act_amax: float = math.nan       # largest finite |output| in the forward
    act_grad_amax: float = math.nan  # largest finite |gradient of the output|
    grad_amax: float = math.nan      # largest finite |gradient| of the module's own parameters
    fp16_flush: float = math.nan     # share of nonzero parameter-gradient values fp16 rounds to 0
                                     # without a loss scale

    def amax(self, kind: str) -> float:
        """The amax of 'act', 'act_grad' or 'grad'."""
        if kind not in KINDS:
            raise ValueError(f"kind={kind!r} is not allowed; allowed: {', '.join(KINDS)}")
        return getattr(self, f"{kind}_amax")

    def headroom(self, kind: str, fmt: str = "fp16") -> float:
        """Binades between the amax of `kind` and the format's max (negative: it overflows)."""
        return _headroom(self.amax(kind), get_format(fmt).max)


@dataclass(frozen=True)
class StepRecord:
    """One optimizer step of the user's loop (its micro-batches of accumulation included)."""

    step: int                        # optimizer steps seen by the watch, from 0
    rank: int = 0                    # torch.distributed rank (0 when not distributed)
    micro_batches: int = 0           # backward calls that fed this step
    loss: float = math.nan           # sum of the unscaled losses its backwards started from
                                     # (= the undivided mean when the loop divides; nan: none)
    scale: float | None = None       # the GradScaler's scale its backward ran at (None: no scaler)
    skipped: bool = False            # the GradScaler skipped optimizer.step()
    nonfinite: bool = False          # the loss or a gradient was inf/NaN
    first_module: str = ""           # first module whose output or gradient became non-finite
    first_phase: str = ""            # 'forward' or 'backward' ('' when finite)
    lost_updates: float | None = None  # true modes: share of nonzero updates lost to rounding
    seconds: float = math.nan        # wall time from the step's first forward to its end
    time: float = math.nan           # wall-clock time.time() at the step's end (orders ranks)
    layers: tuple[LayerStats, ...] = field(default_factory=tuple)  # every `every` steps, else ()
    incomplete: bool = False         # a hook of the watch failed: some figures are missing

    @property
    def has_scaler(self) -> bool:
        """A GradScaler was there to skip the step."""
        return self.scale is not None

    def to_json(self) -> str:
        """One line of the log (inf/NaN spelled as JSON numbers Python reads back)."""
        return json.dumps(asdict(self), allow_nan=True, separators=(",", ":"))

    @classmethod
    def from_json(cls, line: str) -> StepRecord:
        """The record one log line holds: every field present and of its type (unknown keys from
        newer versions ignored); anything else is a ValueError saying what is wrong."""
        try:
            data = json.loads(line)
        except RecursionError:
            raise ValueError("nested too deep to be a record") from None
        except json.JSONDecodeError as e:
            raise ValueError(f"not JSON ({e.msg} at column {e.colno})") from None
        return _typed("", data, cls)


def _wrong(where: str, value: Any, allowed: str) -> ValueError:
    what = f"field {where!r}" if where else "the line"
    return ValueError(f"{what} is {'null' if value is None else type(value).__name__}, "
                      f"not {allowed}")


def _typed(where: str, value: Any, hint: Any) -> Any:
    """`value` as the type `hint` (a field's annotation) says, checked; else a ValueError."""
    args = typing.get_args(hint)
    if typing.get_origin(hint) in (typing.Union, types.UnionType):  # X | None
        if value is None and type(None) in args:
            return None
        (hint,) = [a for a in args if a is not type(None)]
    if typing.get_origin(hint) is tuple:  # tuple[X, ...]: a JSON list of X
        if not isinstance(value, list):
            raise _wrong(where, value, "a list")
        return tuple(_typed(f"{where}[{k}]", v, args[0]) for k, v in enumerate(value))
    if is_dataclass(hint):
        return _record(where, value, hint)
    if hint is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        try:
            return float(value)
        except OverflowError:  # an integer past float's range
            raise ValueError(f"field {where!r} is an integer too large for a float") from None
    if (hint is int or hint is str) and type(value) is hint or hint is bool and isinstance(value, bool):
        return value
    allowed = {float: "a number", int: "an integer", bool: "true or false", str: "a string"}
    raise _wrong(where, value, allowed.get(hint, str(hint)))


def _record(where: str, value: Any, cls: type) -> Any:
    """A dataclass from a JSON object holding every one of its fields."""
    if not isinstance(value, dict):
        raise _wrong(where, value, "a JSON object")
    hints = typing.get_type_hints(cls)
    found = {}
    for f in fields(cls):
        name = f"{where}.{f.name}" if where else f.name
        if f.name not in value:
            raise ValueError(f"field {name!r} is missing")
        found[f.name] = _typed(name, value[f.name], hints[f.name])
    return cls(**found)


def log_path(log_dir: str | Path, rank: int | None) -> Path:
    """Where a process writes: log_dir/records.jsonl, or log_dir/rank{r}/records.jsonl."""
    root = Path(log_dir)
    return root / LOG_NAME if rank is None else root / f"rank{rank}" / LOG_NAME


def write(path: Path, records: Iterable[StepRecord]) -> None:
    """Append records to a log, one line each, flushed (a panel may be following the file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a", encoding="utf-8") as f:
        for r in records:
            f.write(r.to_json() + "\n")
        f.flush()


def _records(path: Path) -> Iterator[StepRecord]:
    """The records of one log file; a complete line that is not a record is a ValueError
    "<file>:<line>: what is wrong" (a log is written only by the watch: a bad line means damage)."""
    with path.open(encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.endswith("\n"):  # a line still being written is read next time
                continue
            try:
                yield StepRecord.from_json(line)
            except ValueError as e:
                raise ValueError(f"{path}:{n}: {e}; allowed: the lines ampnb.watch writes (a "
                                 "JSON object with every StepRecord field)") from None


def read_log(log_dir: str | Path) -> list[StepRecord]:
    """Every record under a log_dir (its own file and every rank's), ordered by step then rank;
    a damaged line is a ValueError naming its file and line (a line still being written is not)."""
    root = Path(log_dir)
    if not root.is_dir():
        raise ValueError(f"log_dir={str(log_dir)!r} is not a directory; allowed: a log_dir "
                         "that ampnb.watch(..., log_dir=...) wrote")
    paths = [root / LOG_NAME, *sorted(root.glob(f"rank*/{LOG_NAME}"))]
    found = [r for p in paths if p.is_file() for r in _records(p)]
    return sorted(found, key=lambda r: (r.step, r.rank))


def as_dict(record: StepRecord) -> dict[str, Any]:
    """The record's scalars by name (what loggers get); layers are left out."""
    return {k: v for k, v in asdict(record).items() if k != "layers"}
