"""Tiny pure functions of per-tensor FP8 scaling: amax, scale, history, scaled cast, SQNR."""

from __future__ import annotations

import torch

from ampnb.formats import FloatFormat, get_format, quantize
from ampnb.fp8.recipe import AmaxAlgo

# torchao clamps amax from below so that an all-zero tensor gets a finite scale.
EPS = 1e-12


def tensor_to_amax(x: torch.Tensor) -> torch.Tensor:
    """Largest magnitude of x, as a float32 scalar tensor (on x's device)."""
    if not x.numel():
        return torch.zeros((), device=x.device)
    # One read of x and no |x| temporary (a fresh activation-sized buffer per cast costs more
    # than the reduction on a CPU); the max and min are elements of x, so this is exact.
    low, high = torch.aminmax(x.detach())
    amax = torch.maximum(high, low.neg())
    return amax if amax.dtype == torch.float32 else amax.float()


def amax_to_scale(amax: torch.Tensor, fmt: str | FloatFormat, margin: int = 0,
                  previous: torch.Tensor | None = None) -> torch.Tensor:
    """scale = fmt.max / amax / 2**margin, so that amax lands 2**margin below the format's max.

    Where amax is 0 or not finite the scale cannot be derived: it keeps `previous`
    (Transformer Engine's rule), or uses fmt.max / EPS (torchao's clamp) when there is none.
    """
    f = get_format(fmt)
    amax = amax.detach().double()  # float64, as torchao: eager and compiled agree
    # fmax / 2**margin / amax equals fmax / amax / 2**margin (a power of two moves no rounding).
    top = f.max / 2.0**margin
    if previous is None:
        return (top / amax.clamp(min=EPS)).float()
    # Unclamped, every amax that cannot give a scale gives one outside (0, inf): 0 gives inf,
    # inf gives 0, NaN gives NaN, and one too small overflows float32 to inf.
    scale = (top / amax).float()
    return torch.where((scale > 0) & (scale < float("inf")), scale, previous)


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


def scaled_cast(x: torch.Tensor, fmt: str | FloatFormat, scale: torch.Tensor,
                saturate: bool | None = True) -> torch.Tensor:
    """x * scale cast to fmt's torch dtype by torch itself: the FP8 tensor (1 byte a value).

    The product is taken in float32 in one pass (a 1-element scale promotes a bf16 x, where a
    0-dim one would round the product to bf16 first); `saturate=True` clamps past fmt.max only
    where torch's own cast would not (e5m2 gives inf; e4m3fn already saturates), None is the
    plain cast.
    """
    f = get_format(fmt)
    if f.torch_dtype is None or saturate is False:
        raise ValueError(f"scaled_cast needs a format torch has with saturate True or None, got "
                         f"{f.name} with saturate={saturate!r}; allowed: scaled_quantize for others")
    scale = scale.reshape(1) if scale.dtype == torch.float32 else scale.reshape(1).float()
    y = (x.float() if x.dtype == torch.float64 else x) * scale
    if saturate and f.torch_overflow != "saturate":
        y.clamp_(-f.max, f.max)
    return y.to(f.torch_dtype)


def widen(q: torch.Tensor) -> torch.Tensor:
    """An FP8 tensor's values in float32, exactly as `q.float()` gives them.

    On a CPU torch converts FP8 one element at a time (about 6x slower than these passes, which
    move the bits into an fp16 and widen that with the vectorized fp16 kernel): e5m2 is the upper
    byte of an fp16; e4m3fn's exponent and mantissa land in an fp16 whose bias is 8 larger, so
    the value is 2**-8 of the true one, subnormals included (a power of two: exact).
    """
    if q.device.type != "cpu" or q.dtype not in (torch.float8_e5m2, torch.float8_e4m3fn):
        return q.float()
    b = q.view(torch.uint8)
    h = b.to(torch.int16).bitwise_left_shift_(8)
    if q.dtype == torch.float8_e5m2:
        return h.view(torch.float16).float()
    # Sign stays in bit 15; exponent and mantissa move to bits 13..7 (bit 14, a sign copy, cleared).
    h = h.bitwise_right_shift_(1).bitwise_and_(~0x4000)
    # e4m3fn's NaN (S.1111.111) would read as +-480: found by a byte max (a CPU tensor: no sync),
    # fixed only where present (bool masks cost more than the whole conversion here).
    if b.bitwise_and(0x7F).max().item() == 0x7F:
        h.masked_fill_(b.bitwise_and(0x7F) == 0x7F, 0x7E00)
    return h.view(torch.float16).float().mul_(256.0)


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """FP8 values back to float32: q / scale (torch promotes no FP8 dtype: widen, then divide)."""
    return widen(q).div_(scale) if q.dtype != torch.float32 else q / scale


def scaled_quantize(x: torch.Tensor, fmt: str | FloatFormat, scale: torch.Tensor,
                    saturate: bool | None = True) -> torch.Tensor:
    """x * scale rounded into fmt (float32 values that fmt holds exactly)."""
    f = get_format(fmt)
    if f.torch_dtype is not None and saturate is not False:
        return scaled_cast(x, f, scale, saturate).float()
    return quantize(x.float() * scale, f, saturate=saturate)


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
