"""`--trace`, `--hunt`, `--memory`: attach ampnb's instruments around a %%amp cell."""

from __future__ import annotations

import contextlib
import importlib.util
from typing import Any

from IPython.core.error import UsageError

# flag -> the module of ampnb.instruments that provides it
_MODULES = {"trace": "ampnb.instruments.trace", "hunt": "ampnb.instruments.hunt",
            "memory": "ampnb.instruments.memory"}


def _present(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


def check(args: Any) -> None:
    """UsageError for a flag whose instrument is not in this version of ampnb."""
    missing = [f"--{f}" for f, m in _MODULES.items() if getattr(args, f, False) and not _present(m)]
    if missing:
        raise UsageError(f"{', '.join(missing)}: not available yet in this version of ampnb "
                         f"(its instrument has not landed); run the cell without it")


def enter(stack: contextlib.ExitStack, args: Any, settings: Any) -> list[Any]:
    """Enter the instruments the flags ask for; returns them for `reports`."""
    check(args)
    return []


def reports(probes: list[Any]) -> tuple[Any, ...]:
    """The instruments' reports, for display under the run."""
    return tuple(probes)
