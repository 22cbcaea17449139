"""`run_distributed`: a function or a piece of source on N local ranks, from Python."""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable
from typing import Any

from ampnb.device.placement import for_ranks
from ampnb.distributed._ship import pack, split_cell
from ampnb.distributed.launcher import DistributedRun, RankFailed, launch

_GIVEN = ("rank", "world_size", "device", "mode")


def _call_source(fn: Callable[..., Any], kwargs: dict[str, Any]) -> str:
    """`__fn__(rank=rank, ...)` with only the injected names fn accepts, then the kwargs."""
    params = inspect.signature(fn).parameters
    takes_all = any(p.kind is p.VAR_KEYWORD for p in params.values())
    given = [f"{n}={n}" for n in _GIVEN if takes_all or n in params]
    return f"__fn__({', '.join(given + [f'{k}=__kw__[{k!r}]' for k in kwargs])})"


def run_distributed(work: Callable[..., Any] | str, nproc: int = 2, *, device: str | None = None,
                    mode: Any = None, timeout: float = 600.0, show_output: bool = True,
                    namespace: dict[str, Any] | None = None, check: bool = True,
                    **kwargs: Any) -> DistributedRun:
    """Run `work(rank=, world_size=, device=, mode=, **kwargs)` (or source code) on nproc ranks.

    A function gets the names among rank, world_size, device (a torch.device) and mode (the
    PrecisionMode, with its autocast around the call) that it accepts. Each rank's output is
    printed labelled by rank (show_output); a failed rank raises RankFailed (check=True),
    whose `.run` has every rank's traceback. Every process has ended when this returns.
    """
    from ampnb.modes import get_mode

    data = [(f"the namespace's {name}", v) for name, v in (namespace or {}).items()]
    device = for_ranks(data, device, fallback="the namespace holds no model or tensor").device
    mode_name = None if mode is None else get_mode(mode).name
    if isinstance(work, str):
        body, last = split_cell(work)
        payload = pack(body, last, "<run_distributed>", dict(namespace or {}), mode_name,
                       source=work)
    elif callable(work):
        ns = {**(namespace or {}), "__fn__": work, "__kw__": kwargs}
        payload = pack("", _call_source(work, kwargs), "<run_distributed>", ns, mode_name,
                       extra={"__fn__": work, "__kw__": kwargs})
    else:
        raise ValueError(f"run_distributed needs a function or source code, got {type(work).__name__}")
    run = launch(payload, nproc, device, timeout)
    if show_output:
        sys.stdout.write(run.output())
    if check and not run.ok:
        raise RankFailed(run)
    return run
