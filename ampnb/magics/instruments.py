"""`--trace`, `--hunt`, `--memory`: attach ampnb's instruments around a %%amp cell."""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
from typing import Any

from IPython.core.error import UsageError

# flag -> (module of ampnb.instruments, the class the cell runs inside)
_PROBES = {"trace": ("ampnb.instruments.trace", "OpTrace"),
           "hunt": ("ampnb.instruments.hunt", "Hunter"),
           "memory": ("ampnb.instruments.memory", "MemoryMeter")}


def _present(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


def _wanted(args: Any) -> list[str]:
    return [f for f in _PROBES if getattr(args, f, False)]


def check(args: Any) -> None:
    """UsageError for a flag whose instrument is not in this version of ampnb."""
    missing = [f"--{f}" for f in _wanted(args) if not _present(_PROBES[f][0])]
    if missing:
        raise UsageError(f"{', '.join(missing)}: not available yet in this version of ampnb "
                         f"(its instrument has not landed); run the cell without it")


def _make(flag: str, settings: Any) -> Any:
    module, name = _PROBES[flag]
    cls = getattr(importlib.import_module(module), name)
    return cls(settings.device) if flag == "memory" else cls()


def enter(stack: contextlib.ExitStack, args: Any, settings: Any) -> list[Any]:
    """Enter the instruments the flags ask for; returns them for `reports`."""
    check(args)
    probes = [stack.enter_context(_make(f, settings)) for f in _wanted(args)]
    hunters = [p for p in probes if hasattr(p, "report")]
    if hunters:
        # Pushed last, so it runs first on the way out: an error in the cell is told
        # where the first inf/NaN came from.
        stack.push(lambda kind, exc, tb: _note(exc, hunters[0]))
    return probes


def _note(exc: BaseException | None, hunter: Any) -> None:
    if exc is not None and hunter.report():
        exc.add_note(f"%%amp --hunt: {hunter.report().message}")


def reports(probes: list[Any]) -> tuple[Any, ...]:
    """The instruments' reports, for display under the run."""
    return tuple(p.report() if hasattr(p, "report") else p for p in probes)
