"""`what_if`: one fp32 training step of the user's model, every Linear/Conv layer's weight,
input and output gradient copied as it passes into a bounded buffer that each format rounds at once."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn
from torch.autograd.graph import GradientEdge, get_gradient_edge

from ampnb._interrupt import Guard
from ampnb._tree import tensors
from ampnb.batch import as_batch, model_loss
from ampnb.fp8.layers import CONVERTIBLE
from ampnb.precision import Precision
from ampnb.putback import untouched
from ampnb.step import StepSettings, forward_loss, step_context
from ampnb.whatif.casts import DEFAULT_FORMATS, get_cast
from ampnb.whatif.graph import lowest
from ampnb.whatif.result import WhatIf
from ampnb.whatif.tally import Tally

_CONVS = (nn.Conv1d, nn.Conv2d, nn.Conv3d)
# Elements (zero-padded rows) rounded together: the memory what_if adds is the buffer (4 bytes
# each, 0.6 MiB) and, during a flush, its two scratch copies (1.9 MiB in all). Fewer, larger
# batches cost fewer torch calls: about 1.5 ms a flush on a CPU, within the step (the demo GPT's
# step takes 8 flushes; 4 of 10 x 2**15 values saved about a sixth of the time, but put its memory
# at 1.6-1.8x a plain step's, against a goal of 1.5x: benchmarks/bench_what_if.py).
FLUSH_ELEMENTS = 5 * 2**15


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


def _hooks(model: nn.Module, tally: Tally, edges: list[GradientEdge]) -> Guard:
    """Forward hooks on every layer: weight and input at once, the output's gradient later
    (its edge in the graph appended to `edges`)."""
    handles: list[Any] = []

    def hook(name: str) -> Callable[..., None]:
        def on_forward(m: nn.Module, args: tuple, kwargs: dict, out: Any) -> None:
            tally.add(name, "weight", as_rows(m, m.weight, "weight"))
            x = next(iter(tensors((args, kwargs))), None)
            if x is not None and x.is_floating_point():
                tally.add(name, "input", as_rows(m, x, "input"))
            if isinstance(out, torch.Tensor) and out.requires_grad:
                edges.append(get_gradient_edge(out))
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


def _step(p: Precision, model: nn.Module, run: Any, loss_fn: Callable[..., Any] | None,
          edges: list[GradientEdge]) -> None:
    """The forward and the backward. The graph is gone when it returns, before the last flush:
    the nodes the backward did not need to run (below the lowest outputs) hold saved tensors."""
    with step_context(StepSettings(p), model), torch.enable_grad():
        _, loss = forward_loss(p, model, run, loss_fn or _own_loss)
        if loss is not None:  # a model with no loss still shows weights and inputs
            _backward(p, loss, edges)
    edges.clear()


def _backward(p: Precision, loss: torch.Tensor, edges: list[GradientEdge]) -> None:
    """The gradients of the layers' outputs (`graph.lowest`: no weight gradient is computed);
    the whole backward where the graph needs one (a reentrant checkpoint)."""
    inputs = lowest(loss, edges) if loss.grad_fn is not None else None
    if inputs is None:
        p.backward(loss)
    elif inputs:
        torch.autograd.grad(loss, inputs)


def _own_loss(output: Any, _targets: Any) -> torch.Tensor | None:
    return model_loss(output)


def what_if(model: nn.Module, batch: Any, loss_fn: Callable[..., Any] | None = None, *,
            formats: Iterable[str] = DEFAULT_FORMATS) -> WhatIf:
    """One training step under 32-true (forward + backward, no update, no autocast: an fp32
    model's fp32 step; the backward computes the layers' output gradients, not the weights')
    of `model` on `batch`: for every Linear/Conv layer's weight, input and
    output gradient, what each format would lose (the reference is the tensor as it ran).

    Without a loss_fn the model's own loss is used; a model without one gives weights and
    inputs only. The model, its gradients, buffers and every RNG are put back. Tensors are
    copied into a buffer of `FLUSH_ELEMENTS` values rounded when full, so no tensor is kept
    beyond the step's own and the memory added is that buffer (and its two scratch copies while
    it is rounded).
    """
    if not isinstance(model, nn.Module):
        raise ValueError(f"what_if needs an nn.Module, got {type(model).__name__}")
    names = (formats,) if isinstance(formats, str) else tuple(formats)
    if not names:
        raise ValueError(f"formats is empty; allowed: e.g. {', '.join(DEFAULT_FORMATS)}")
    tally = Tally(tuple(get_cast(f) for f in names), FLUSH_ELEMENTS)
    p = Precision.of("32-true", model=model)  # the model as it is, where place_model says
    run, edges = as_batch(batch, loss_fn), []
    with untouched(model), _hooks(model, tally, edges):
        _step(p, model, run, loss_fn, edges)
    tally.flush()
    if not tally.sums:
        raise ValueError(f"{type(model).__name__} ran no Linear or Conv layer; allowed: a model "
                         "with nn.Linear, nn.Conv*d or transformers' Conv1D layers")
    return WhatIf(tally.rows(), tuple(c.name for c in tally.casts), p.device)
