"""The real thing: NVIDIA Transformer Engine FP8 on a GPU of compute capability >= 8.9.

Written after Lightning's TransformerEnginePrecision. It runs only where `transformer_engine`
imports and such a GPU exists; ampnb's CI has neither, so this path is untested there.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any

import torch
from torch import nn

from ampnb.fp8.autocast import autocast_guard, default_dtype_guard

# The status lives with the other backends' (no import cycle); these names stay reachable here.
from ampnb.fp8.backends import MIN_CAPABILITY, TeStatus, te_status  # noqa: F401
from ampnb.fp8.layers import kind_of, swap_children, unsupported_reason
from ampnb.fp8.recipe import Fp8Recipe, Scaling, from_recipe_name


def to_te_recipe(recipe: Fp8Recipe | str | None = None) -> Any:
    """The Transformer Engine recipe object for an ampnb recipe."""
    from transformer_engine.common import recipe as te_recipe

    r = from_recipe_name(recipe)
    fmt = getattr(te_recipe.Format, r.fp8_format.value)
    if r.scaling is Scaling.DYNAMIC:
        if not hasattr(te_recipe, "Float8CurrentScaling"):
            raise ValueError("dynamic (current) scaling needs Transformer Engine >= 2.2; "
                             "use a delayed recipe instead")
        return te_recipe.Float8CurrentScaling(fp8_format=fmt)
    return te_recipe.DelayedScaling(fp8_format=fmt, amax_history_len=r.amax_history_len,
                                    amax_compute_algo=r.amax_compute_algo.value,
                                    margin=r.margin)


def _te_layer(te: Any, child: nn.Module) -> nn.Module | None:
    """TE's layer for a Linear / Conv1D / LayerNorm child (a copy of its values), or None."""
    kind = kind_of(child)
    if kind is not None:
        n_in, n_out = kind.features(child)
        new = te.Linear(n_in, n_out, bias=child.bias is not None, device=child.weight.device)
        new.weight.data = kind.linear_weight(child).data.clone()
    elif (isinstance(child, nn.LayerNorm) and child.elementwise_affine
          and child.bias is not None and len(child.normalized_shape) == 1):
        new = te.LayerNorm(child.normalized_shape[0], eps=child.eps, device=child.weight.device)
        new.weight.data = child.weight.data.clone()
    else:
        return None
    if child.bias is not None:
        new.bias.data = child.bias.data.clone()
    return new


def convert_to_te(module: nn.Module) -> nn.Module:
    """Swap Linear / Conv1D / LayerNorm for TE's layers in place, skipping unaligned layers."""
    import transformer_engine.pytorch as te

    if any("transformer_engine" in type(m).__module__ for m in module.modules()):
        return module  # the user built it with TE layers already (Lightning does the same)
    skipped, swaps = [], []
    for parent in module.modules():
        for name, child in parent.named_children():
            why = unsupported_reason(child) if kind_of(child) is not None else ""
            new = None if why else _te_layer(te, child)
            if why:
                skipped.append(f"{name!r} ({why})")
            elif new is not None:
                swaps.append((parent, name, new))
    swap_children(swaps)
    if skipped:
        warnings.warn(f"FP8: linear layers stay in higher precision: {'; '.join(skipped)}",
                      stacklevel=2)
    return module


@contextlib.contextmanager
def te_forward_context(recipe: Fp8Recipe | str | None, dtype: torch.dtype,
                       fallback: torch.dtype | None = None):
    """Lightning's forward context: default dtype, fallback CUDA autocast, te.fp8_autocast."""
    import transformer_engine.pytorch as te

    fp8 = te.fp8_autocast(enabled=True, fp8_recipe=to_te_recipe(recipe))
    with default_dtype_guard(dtype), autocast_guard("cuda", fallback or dtype), fp8:
        yield
