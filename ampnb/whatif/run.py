"""`what_if`: one fp32 training step of the user's model, every Linear/Conv layer's weight,
input and output gradient rounded into each format as it passes, statistics streamed."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from ampnb._interrupt import Guard
from ampnb._tree import tensors
from ampnb.batch import as_batch, model_loss
from ampnb.fp8.layers import CONVERTIBLE
from ampnb.fp8.scaling import tensor_to_amax
from ampnb.modes import get_mode
from ampnb.putback import untouched
from ampnb.step import StepSettings, forward_loss, step_context
from ampnb.whatif.casts import DEFAULT_FORMATS, Cast, get_cast
from ampnb.whatif.result import WhatIf, WhatIfRow, sqnr_db

_CONVS = (nn.Conv1d, nn.Conv2d, nn.Conv3d)


def is_layer(m: nn.Module) -> bool:
    """A Linear, a convolution or transformers' Conv1D: a layer whose GEMM a format would feed."""
    return isinstance(m, (nn.Linear, *_CONVS)) or CONVERTIBLE["Conv1D"].base(m) is not None


def as_rows(m: nn.Module, x: torch.Tensor, tensor: str) -> torch.Tensor:
    """x in fp32 with the GEMM's reduction axis last: the axis block-scaled formats block along."""
    x = x.detach().float()
    if isinstance(m, _CONVS):
        return x.flatten(1) if tensor == "weight" else x.movedim(1, -1)  # (out, in*k) / channels
    if tensor == "weight" and not isinstance(m, nn.Linear):
        return x.t()  # Conv1D stores (in, out)
    return x


class Tally:
    """Running sums per (module, tensor): per format |x - q(x)|^2, flushed, past max; |x|^2, count."""

    def __init__(self, casts: tuple[Cast, ...]) -> None:
        self.casts = casts
        self.sums: dict[tuple[str, str], tuple[torch.Tensor, torch.Tensor, int]] = {}

    def add(self, module: str, tensor: str, x: torch.Tensor) -> None:
        """Round x into every format and add its statistics; nothing of x is kept."""
        amax = tensor_to_amax(x)
        nonzero = torch.count_nonzero(x)
        figures = []
        for c in self.casts:
            y, over = c.fn(x, amax)
            # Every cast keeps a zero a zero (a NaN block aside): flushed = nonzeros lost.
            flushed = nonzero - torch.count_nonzero(y)
            figures += [torch.linalg.vector_norm(y.sub_(x)), flushed, over]
        table = torch.stack([f.double() for f in figures]).reshape(len(self.casts), 3)
        table[:, 0].square_()
        signal = torch.linalg.vector_norm(x).double().square()
        old = self.sums.get((module, tensor))
        if old is not None:
            table, signal = table + old[0], signal + old[1]
        self.sums[(module, tensor)] = (table, signal, x.numel() + (old[2] if old else 0))

    def rows(self) -> tuple[WhatIfRow, ...]:
        out = []
        for (module, tensor), (figures, signal, n) in self.sums.items():
            total = signal.item()
            for c, (noise, under, over) in zip(self.casts, figures.tolist()):
                out.append(WhatIfRow(module, tensor, c.name, sqnr_db(total, noise),
                                     under / max(n, 1), over / max(n, 1), n))
        return tuple(out)


def _hooks(model: nn.Module, tally: Tally) -> Guard:
    """Forward hooks on every layer: weight and input at once, the output's gradient later."""
    handles: list[Any] = []

    def hook(name: str) -> Callable[..., None]:
        def on_forward(m: nn.Module, args: tuple, kwargs: dict, out: Any) -> None:
            tally.add(name, "weight", as_rows(m, m.weight, "weight"))
            x = next(iter(tensors((args, kwargs))), None)
            if x is not None and x.is_floating_point():
                tally.add(name, "input", as_rows(m, x, "input"))
            if isinstance(out, torch.Tensor) and out.requires_grad:
                out.register_hook(lambda g: tally.add(name, "grad_output", as_rows(m, g, "grad")))
        return on_forward

    def attach() -> None:
        for name, m in model.named_modules():
            if is_layer(m) and isinstance(getattr(m, "weight", None), torch.Tensor):
                handles.append(m.register_forward_hook(hook(name), with_kwargs=True))

    def detach(_state: Any) -> None:
        while handles:
            handles.pop().remove()

    return Guard(attach, detach)


def _own_loss(output: Any, _targets: Any) -> torch.Tensor | None:
    return model_loss(output)


def what_if(model: nn.Module, batch: Any, loss_fn: Callable[..., Any] | None = None, *,
            formats: Iterable[str] = DEFAULT_FORMATS) -> WhatIf:
    """One training step under 32-true (forward + backward, no update, no autocast: an fp32
    model's fp32 step) of `model` on `batch`: for every Linear/Conv layer's weight, input and
    output gradient, what each format would lose (the reference is the tensor as it ran).

    Without a loss_fn the model's own loss is used; a model without one gives weights and
    inputs only. The model, its gradients, buffers and every RNG are put back; statistics are
    streamed layer by layer, so no tensor is kept beyond the step's own.
    """
    if not isinstance(model, nn.Module):
        raise ValueError(f"what_if needs an nn.Module, got {type(model).__name__}")
    names = (formats,) if isinstance(formats, str) else tuple(formats)
    if not names:
        raise ValueError(f"formats is empty; allowed: e.g. {', '.join(DEFAULT_FORMATS)}")
    tally = Tally(tuple(get_cast(f) for f in names))
    mode = get_mode("32-true")
    device = next(model.parameters(), torch.empty(0)).device
    run = as_batch(batch, loss_fn)
    with untouched(model), _hooks(model, tally):
        with step_context(StepSettings(mode, str(device)), model), torch.enable_grad():
            _, loss = forward_loss(mode, model, run, loss_fn or _own_loss, device)
            if loss is not None:  # a model with no loss still shows weights and inputs
                mode.backward(loss)
    if not tally.sums:
        raise ValueError(f"{type(model).__name__} ran no Linear or Conv layer; allowed: a model "
                         "with nn.Linear, nn.Conv*d or transformers' Conv1D layers")
    return WhatIf(tally.rows(), tuple(c.name for c in tally.casts), str(device))
