"""Which layers are matmul layers FP8 and low-bit formats convert: nn.Linear and transformers' Conv1D.

GPT-2's attention and MLP projections are `transformers.pytorch_utils.Conv1D`: a Linear whose
weight is stored transposed, (in, out), computing y = x @ W + b. It is recognised by its class
name and module, so transformers is never imported for it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import nn

from ampnb._interrupt import deferred

# Subclasses with their own forward that compute x @ W^T + b all the same, checked by reading
# their source (FalconLinear: `input @ self.weight.T`, then `+ self.bias`). By class name and
# module, so transformers is never imported for them.
SAME_AS_LINEAR = frozenset({"transformers.models.falcon.modeling_falcon.FalconLinear"})
_CONV1D = ("transformers.pytorch_utils", "Conv1D")


def _qualname(cls: type) -> str:
    return f"{cls.__module__}.{cls.__name__}"


# Linear subclasses whose parent reads their weight and never calls them: a swap there would
# claim a format nothing ran in, so they are left out, with this reason (by class name, as
# `left_out` counts them).
READ_BY_PARENT = {
    "NonDynamicallyQuantizableLinear": "nn.MultiheadAttention's out_proj: the attention reads its "
                                       "weight directly (F.multi_head_attention_forward), never "
                                       "calling it",
}


def _linear_base(m: nn.Module) -> type | None:
    if isinstance(m, nn.Linear) and not isinstance(m, nn.modules.linear.NonDynamicallyQuantizableLinear):
        return nn.Linear
    return None


def _conv1d_base(m: nn.Module) -> type | None:
    return next((c for c in type(m).__mro__ if (c.__module__, c.__name__) == _CONV1D), None)


def own_forward_reason(m: nn.Module, base: type) -> str:
    """Why a subclass of `base` is not converted: its own forward ('' when it may be)."""
    cls = type(m)
    if cls.forward is base.forward or _qualname(cls) in SAME_AS_LINEAR:
        return ""
    # A LoRA wrapper or a scaled output would lose what its forward adds if swapped.
    return (f"{cls.__name__} has its own forward, not {base.__name__}'s; ampnb cannot know "
            "it computes x @ W^T + b")


@dataclass(frozen=True)
class LayerKind:
    """A module type that computes x @ W^T + b: how to recognise it and how W is stored."""

    name: str
    base: Callable[[nn.Module], type | None]  # the class it derives from, or None
    transposed: bool  # weight stored (in, out): y = x @ W + b

    def matches(self, m: nn.Module) -> bool:
        """A layer of this kind that can be swapped: its forward is the base's, or known alike."""
        base = self.base(m)
        return base is not None and not own_forward_reason(m, base)

    def features(self, m: nn.Module) -> tuple[int, int]:
        """(in_features, out_features) from the weight's shape."""
        rows, cols = m.weight.shape
        return (rows, cols) if self.transposed else (cols, rows)

    def linear_weight(self, m: nn.Module) -> torch.Tensor:
        """The weight as nn.Linear stores it, (out, in): a view, no copy."""
        return m.weight.t() if self.transposed else m.weight


# The layer types converted, in the order they are tried.
CONVERTIBLE: dict[str, LayerKind] = {k.name: k for k in (
    LayerKind("Linear", _linear_base, transposed=False),
    LayerKind("Conv1D", _conv1d_base, transposed=True),
)}


def not_convertible(m: nn.Module) -> tuple[LayerKind, str] | None:
    """(kind, reason) for a subclass of a convertible kind that is not swapped, else None."""
    for k in CONVERTIBLE.values():
        base = k.base(m)
        if base is not None:
            why = own_forward_reason(m, base)
            return (k, why) if why else None
    return None


def kind_of(m: nn.Module) -> LayerKind | None:
    """The convertible kind of a module, or None."""
    return next((k for k in CONVERTIBLE.values() if k.matches(m)), None)


# FP8 GEMMs need aligned shapes; Lightning's Transformer Engine plugin skips Linear layers
# whose in_features is not a multiple of 8 or out_features not a multiple of 16.
ALIGN_IN, ALIGN_OUT = 8, 16


def unsupported_reason(layer: nn.Module) -> str:
    """Why an FP8 GEMM cannot take this layer's shape ('' when it can)."""
    n_in, n_out = kind_of(layer).features(layer)
    bad = []
    if n_in % ALIGN_IN:
        bad.append(f"in_features {n_in} is not a multiple of {ALIGN_IN}")
    if n_out % ALIGN_OUT:
        bad.append(f"out_features {n_out} is not a multiple of {ALIGN_OUT}")
    return " and ".join(bad)


def left_out(model: nn.Module, taken: Iterable[nn.Module]) -> tuple[tuple[str, int], ...]:
    """Modules holding parameters of their own that were not taken, counted by type name."""
    skip = set(map(id, taken))
    counts = Counter(type(m).__name__ for m in model.modules()
                     if id(m) not in skip and next(m.parameters(recurse=False), None) is not None)
    return tuple(sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))


def _holds_matmul_weights(m: nn.Module) -> bool:
    """A weight of two or more dimensions of its own that is not an embedding table (experts, convs)."""
    return not isinstance(m, nn.Embedding) and any(
        p.dim() >= 2 for p in m.parameters(recurse=False))


@dataclass(frozen=True)
class ParameterShare:
    """How many of a model's parameters the converted layers' weights hold.

    `large_left_out`: a module left out holds matmul-sized weights (fused experts, a convolution,
    attention's packed projections), so counting layers alone would mislead.
    """

    converted: int = 0
    total: int = 0
    large_left_out: bool = False

    @property
    def worth_saying(self) -> bool:
        """Whether a headline should state the share (a large module was left out)."""
        return self.large_left_out and bool(self.total)

    @property
    def percent(self) -> str:
        """'44 %' ('<1 %', '>99 %' rather than rounding to the ends)."""
        if not self.total:
            return "-"
        share = 100 * self.converted / self.total
        if 0 < share < 0.5:
            return "<1 %"
        if 99.5 <= share < 100:
            return ">99 %"
        return f"{share:.0f} %"


def parameter_share(model: nn.Module, taken: Iterable[nn.Module], converted: Iterable[torch.Tensor],
                    extra_total: int = 0, exclude: Iterable[torch.Tensor] = ()) -> ParameterShare:
    """The converted weights (each tensor once) against all the model's parameters (each once).

    `extra_total`: weights no longer held as parameters (a quantized layer's codes) counted in;
    `exclude`: parameters not to count (their stored forms, already in `extra_total`).
    """
    taken_ids = set(map(id, taken))
    skip = set(map(id, exclude))
    total = {id(p): p.numel() for p in model.parameters() if id(p) not in skip}
    done = {id(w): w.numel() for w in converted}
    large = any(id(m) not in taken_ids and _holds_matmul_weights(m) for m in model.modules())
    return ParameterShare(sum(done.values()), sum(total.values()) + extra_total, large)


def describe_left_out(counts: tuple[tuple[str, int], ...]) -> str:
    """'2 Embedding, 5 LayerNorm' ('' when nothing was left out)."""
    return ", ".join(f"{n} {name}" for name, n in counts)


def left_out_notes(counts: tuple[tuple[str, int], ...], others: str) -> tuple[str, ...]:
    """'left out (<others>): 2 LayerNorm', then one note per type left out for its own reason
    (READ_BY_PARENT); none when nothing was left out."""
    plain = tuple((name, n) for name, n in counts if name not in READ_BY_PARENT)
    notes = [f"left out ({others}): {describe_left_out(plain)}"] if plain else []
    return (*notes, *(f"left out ({READ_BY_PARENT[name]}): {n} {name}" for name, n in counts
                      if name in READ_BY_PARENT))


def swap_children(swaps: list[tuple[nn.Module, str, nn.Module]]) -> None:
    """Put each new child in place, all or none: an interrupt puts every old one back."""
    old = [(parent, name, parent._modules[name]) for parent, name, _ in swaps]
    try:
        with deferred():
            for parent, name, new in swaps:
                setattr(parent, name, new)
    except KeyboardInterrupt:
        with deferred():
            for parent, name, previous in old:
                setattr(parent, name, previous)
        raise
