"""`--trace`, `--hunt`, `--memory`: the instruments ampnb attaches around one %%amp cell."""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch.nn.modules import module as nn_module

from ampnb._interrupt import Guard
from ampnb.display import Table, TableView, dtype_name, format_bytes
from ampnb.instruments.hunt import Hunter
from ampnb.instruments.memory import MemoryMeter
from ampnb.instruments.trace import OpTrace


class CellMemory(TableView):
    """`--memory`: bytes saved for backward (peak), and the parameters/gradients the cell used."""

    def __init__(self, device: str) -> None:
        self.meter = MemoryMeter(device)
        self._modules: dict[int, torch.nn.Module] = {}
        self.param_bytes = self.grad_bytes = self.params = 0
        self.param_dtypes: tuple[str, ...] = ()
        self._guard = Guard(self._attach, self._detach)

    def _seen(self, module: torch.nn.Module, args: Any) -> None:
        self._modules.setdefault(id(module), module)

    def _attach(self) -> Any:
        self.meter.__enter__()
        try:
            return nn_module.register_module_forward_pre_hook(self._seen)
        except BaseException:
            self.meter.__exit__(None, None, None)
            raise

    def _detach(self, handle: Any) -> None:
        handle.remove()
        self.meter.__exit__(None, None, None)

    def __enter__(self) -> CellMemory:
        self._guard.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._guard.__exit__(*exc)
        params = {id(p): p for m in self._modules.values() for p in m.parameters(recurse=False)}
        self._modules.clear()  # keep no reference to the user's modules
        self.params = len(params)
        self.param_bytes = sum(p.numel() * p.element_size() for p in params.values())
        self.grad_bytes = sum(p.grad.numel() * p.grad.element_size() for p in params.values()
                              if p.grad is not None)
        self.param_dtypes = tuple(sorted({dtype_name(p.dtype) for p in params.values()}))

    @property
    def peak_bytes(self) -> int:
        return self.meter.peak_bytes

    def table(self) -> Table:
        """What the cell held: saved activations, and the parameters and gradients it used."""
        m = self.meter
        rows = [("saved for backward (peak)", format_bytes(m.peak_bytes)),
                ("tensors saved for backward", m.tensors)]
        if m.cuda_peak_bytes is not None:
            rows.append(("CUDA peak allocated (above start)", format_bytes(m.cuda_peak_bytes)))
        dtypes = ", ".join(self.param_dtypes) or "-"
        rows += [(f"parameters of the modules the cell ran ({self.params} tensors, {dtypes})",
                  format_bytes(self.param_bytes)),
                 ("their gradients after the cell", format_bytes(self.grad_bytes))]
        return Table(("memory", "measured"), rows, caption=f"%%amp --memory on {m.device}",
                     notes=("saved for backward: peak bytes autograd held for backward while the "
                            "cell ran (parameters excluded: they exist anyway); optimizer state is "
                            "not counted (memory_report(model, batch) measures a whole step)",))


# flag -> what the cell runs inside, from the flag's value and the run's settings
_PROBES = {"trace": lambda v, s: OpTrace(detail=v), "hunt": lambda v, s: Hunter(),
           "memory": lambda v, s: CellMemory(s.device)}


def probes(args: Any, settings: Any) -> list[contextlib.AbstractContextManager]:
    """The instruments the flags ask for, not yet entered."""
    return [make(getattr(args, flag), settings) for flag, make in _PROBES.items()
            if getattr(args, flag, False)]


def note_finding(exc: BaseException, found: list[Any]) -> None:
    """Tell an error in the cell where the first inf/NaN came from (--hunt)."""
    for p in found:
        if isinstance(p, Hunter) and p.report():
            exc.add_note(f"%%amp --hunt: {p.report().message}")


def reports(found: list[Any]) -> tuple[Any, ...]:
    """The instruments' reports, for display under the run."""
    return tuple(p.report() if hasattr(p, "report") else p for p in found)
