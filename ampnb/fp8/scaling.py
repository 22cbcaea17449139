"""Tiny pure functions of per-tensor FP8 scaling: amax, scale, history, scaled cast, SQNR."""

from __future__ import annotations

import torch

from ampnb.formats import FloatFormat, get_format, quantize
from ampnb.fp8.recipe import AmaxAlgo

# torchao clamps amax from below so that an all-zero tensor gets a finite scale.
EPS = 1e-12


def tensor_to_amax(x: torch.Tensor) -> torch.Tensor:
    """Largest magnitude of x, as a float32 scalar tensor (on x's device)."""
    return x.detach().abs().amax().float() if x.numel() else torch.zeros((), device=x.device)


def amax_to_scale(amax: torch.Tensor, fmt: str | FloatFormat, margin: int = 0,
                  previous: torch.Tensor | None = None) -> torch.Tensor:
    """scale = fmt.max / amax / 2**margin, so that amax lands 2**margin below the format's max.

    Where amax is 0 or not finite the scale cannot be derived: it keeps `previous`
    (Transformer Engine's rule), or uses fmt.max / EPS (torchao's clamp) when there is none.
    """
    f = get_format(fmt)
    amax = amax.detach().to(torch.float64)
    scale = (f.max / amax.clamp(min=EPS) / 2.0**margin).to(torch.float32)
    if previous is None:
        return scale
    usable = (amax > 0) & torch.isfinite(amax) & torch.isfinite(scale)
    return torch.where(usable, scale, previous.to(torch.float32))


def push_amax(history: torch.Tensor, amax: torch.Tensor, filled: int) -> torch.Tensor:
    """History with `amax` appended (newest last), dropping the oldest when the window is full."""
    n = history.numel()
    if filled < n:
        out = history.clone()
        out[filled] = amax
        return out
    return torch.cat([history[1:], amax.reshape(1).to(history)])


def history_to_amax(history: torch.Tensor, filled: int, algo: AmaxAlgo | str) -> torch.Tensor:
    """One amax from the first `filled` entries of a history, by `max` or `most_recent`."""
    seen = history[: min(filled, history.numel())]
    if AmaxAlgo(algo) is AmaxAlgo.MOST_RECENT:
        return seen[-1]
    return seen.amax()


def scaled_quantize(x: torch.Tensor, fmt: str | FloatFormat, scale: torch.Tensor,
                    saturate: bool | None = True) -> torch.Tensor:
    """x * scale rounded into fmt (float32 values that fmt holds exactly)."""
    return quantize(x.float() * scale, fmt, saturate=saturate)


def fp8_fractions(x_scaled: torch.Tensor, fmt: str | FloatFormat) -> tuple[float, float]:
    """Fractions of a scaled tensor that saturate (past max) or flush to zero in fmt."""
    f = get_format(fmt)
    a = x_scaled.detach().abs().float()
    over = a >= f.overflow_threshold if f.overflow_inclusive else a > f.overflow_threshold
    flushed = (a > 0) & (a <= f.underflow_threshold)
    n = max(a.numel(), 1)
    return over.sum().item() / n, flushed.sum().item() / n


def sqnr(reference: torch.Tensor, approx: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio in dB (torchao's `compute_error`); inf if exact."""
    ref, err = reference.detach().double(), (reference.detach().double() - approx.detach().double())
    noise = err.norm()
    if noise == 0:
        return float("inf")
    return (20 * torch.log10(ref.norm() / noise)).item()
