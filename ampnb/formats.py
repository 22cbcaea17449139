"""Float formats as data: every figure derived from the bits, and `quantize` into any of them."""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum
from functools import cached_property

import torch

from ampnb.display import Table


class Encoding(str, Enum):
    """How the top of the exponent range is spent."""

    IEEE = "ieee"      # top exponent reserved: inf and NaNs (fp16, bf16, e5m2)
    FN = "fn"          # finite only; the all-ones pattern is the single NaN per sign (e4m3fn)
    FNUZ = "fnuz"      # finite only, unsigned zero; the "-0" pattern is the single NaN
    FINITE = "finite"  # no inf and no NaN at all (fp4 e2m1)
    EXPONENT = "exponent"  # unsigned powers of two, no zero, all-ones is NaN (the MX scale e8m0)


# What torch's own cast does with a finite value beyond the largest finite, per encoding
# (checked against torch in tests/test_formats.py): fp16/bf16/e5m2 overflow to inf, e4m3fn
# saturates to +-448 (inf included), the fnuz formats give their single NaN.
_TORCH_OVERFLOW = {
    Encoding.IEEE: "inf",
    Encoding.FN: "saturate",
    Encoding.FNUZ: "nan",
    Encoding.FINITE: "saturate",
    Encoding.EXPONENT: "nan",
}


@dataclass(frozen=True)
class FloatFormat:
    """A binary floating-point format, defined by its bit fields and top-of-range encoding."""

    name: str
    exponent_bits: int
    mantissa_bits: int
    bias: int
    encoding: Encoding = Encoding.IEEE
    torch_dtype_name: str | None = None
    storage: bool = True  # False for tf32: a compute mode of tensor cores, not a storage type
    description: str = ""

    @property
    def bits(self) -> int:
        sign = 0 if self.encoding is Encoding.EXPONENT else 1
        return sign + self.exponent_bits + self.mantissa_bits

    @cached_property  # a frozen record: derived once (casts read it per call)
    def max_exponent(self) -> int:
        """Unbiased exponent of the largest finite value."""
        top = 2**self.exponent_bits - 1
        reserved = self.encoding in (Encoding.IEEE, Encoding.EXPONENT)  # all-ones: inf/NaN
        return (top - 1 if reserved else top) - self.bias

    @cached_property
    def min_exponent(self) -> int:
        """Unbiased exponent of the smallest normal value."""
        # e8m0 has no zero or subnormals: the all-zeros pattern is 2**-bias itself.
        return (0 if self.encoding is Encoding.EXPONENT else 1) - self.bias

    @cached_property
    def max(self) -> float:
        # FN spends the all-ones mantissa of the top exponent on NaN, so its largest
        # mantissa is one step below all-ones.
        steps = 2**self.mantissa_bits - (2 if self.encoding is Encoding.FN else 1)
        return math.ldexp(1 + steps / 2**self.mantissa_bits, self.max_exponent)

    @cached_property
    def smallest_normal(self) -> float:
        return math.ldexp(1.0, self.min_exponent)

    @cached_property
    def smallest_subnormal(self) -> float:
        return math.ldexp(1.0, self.min_exponent - self.mantissa_bits)

    @property
    def eps(self) -> float:
        """Gap between 1.0 and the next larger value."""
        return math.ldexp(1.0, -self.mantissa_bits)

    @property
    def binades(self) -> int:
        """Powers of two spanned by the normal numbers."""
        return self.max_exponent - self.min_exponent + 1

    @property
    def binades_with_subnormals(self) -> int:
        return self.binades + self.mantissa_bits

    @property
    def has_inf(self) -> bool:
        return self.encoding is Encoding.IEEE

    @property
    def has_nan(self) -> bool:
        return self.encoding is not Encoding.FINITE

    @property
    def has_negative_zero(self) -> bool:
        return self.encoding not in (Encoding.FNUZ, Encoding.EXPONENT)

    @property
    def torch_dtype(self) -> torch.dtype | None:
        return getattr(torch, self.torch_dtype_name, None) if self.torch_dtype_name else None

    @property
    def torch_overflow(self) -> str:
        """What torch's cast does past the largest finite: 'inf', 'saturate' or 'nan'."""
        return _TORCH_OVERFLOW[self.encoding]

    @cached_property
    def overflow_threshold(self) -> float:
        """Magnitude half an ulp above `max`: rounding to nearest sends values past it out of range."""
        return self.max + math.ldexp(1.0, self.max_exponent - self.mantissa_bits - 1)

    @property
    def overflow_inclusive(self) -> bool:
        """Whether a value exactly at `overflow_threshold` overflows (ties go to the even mantissa)."""
        max_mantissa_is_odd = self.encoding is not Encoding.FN
        return max_mantissa_is_odd

    @property
    def underflow_threshold(self) -> float:
        """Nonzero magnitudes at or below this round to zero (the tie goes to even, i.e. 0)."""
        return self.smallest_subnormal / 2

    @property
    def normal_threshold(self) -> float:
        """Magnitudes at or above this round to a normal number."""
        return self.smallest_normal - self.smallest_subnormal / 2


def _fmt(name, e, m, bias=None, enc=Encoding.IEEE, dtype=None, storage=True, desc=""):
    return FloatFormat(name, e, m, 2 ** (e - 1) - 1 if bias is None else bias, enc, dtype,
                       storage, desc)


FORMATS: dict[str, FloatFormat] = {
    f.name: f
    for f in (
        _fmt("fp64", 11, 52, dtype="float64", desc="IEEE double"),
        _fmt("fp32", 8, 23, dtype="float32", desc="IEEE single, PyTorch's default"),
        _fmt("tf32", 8, 10, storage=False,
             desc="TensorFloat-32: fp32 range, fp16 precision, inside Ampere+ matmuls"),
        _fmt("fp16", 5, 10, dtype="float16", desc="IEEE half"),
        _fmt("bf16", 8, 7, dtype="bfloat16", desc="bfloat16: fp32 range, 8 bits of precision"),
        _fmt("fp8_e4m3", 4, 3, enc=Encoding.FN, dtype="float8_e4m3fn",
             desc="OCP FP8 E4M3 (e4m3fn): forward activations and weights"),
        _fmt("fp8_e5m2", 5, 2, dtype="float8_e5m2", desc="OCP FP8 E5M2: gradients"),
        _fmt("fp8_e4m3fnuz", 4, 3, bias=8, enc=Encoding.FNUZ, dtype="float8_e4m3fnuz",
             desc="FP8 E4M3 FNUZ (AMD MI300 / Graphcore)"),
        _fmt("fp8_e5m2fnuz", 5, 2, bias=16, enc=Encoding.FNUZ, dtype="float8_e5m2fnuz",
             desc="FP8 E5M2 FNUZ (AMD MI300 / Graphcore)"),
        _fmt("fp4_e2m1", 2, 1, enc=Encoding.FINITE, desc="OCP MX FP4 E2M1: weight-only formats"),
    )
}

# The scale of the OCP MX formats (not in FORMATS: nothing is stored in it but scales, and
# `quantize` has no meaning for it); its figures are checked against torch.finfo(float8_e8m0fnu).
E8M0 = _fmt("e8m0", 8, 0, enc=Encoding.EXPONENT, dtype="float8_e8m0fnu",
            desc="OCP MX E8M0 scale: a power of two 2^-127..2^127, no sign, no zero")

_ALIASES: dict[str, str] = {
    "float64": "fp64", "double": "fp64", "f64": "fp64",
    "float32": "fp32", "float": "fp32", "single": "fp32", "f32": "fp32",
    "tensorfloat32": "tf32", "tensorfloat_32": "tf32",
    "float16": "fp16", "half": "fp16", "f16": "fp16", "binary16": "fp16",
    "bfloat16": "bf16",
    "e4m3": "fp8_e4m3", "e4m3fn": "fp8_e4m3", "fp8_e4m3fn": "fp8_e4m3",
    "float8_e4m3fn": "fp8_e4m3", "fp8": "fp8_e4m3",
    "e5m2": "fp8_e5m2", "float8_e5m2": "fp8_e5m2",
    "e4m3fnuz": "fp8_e4m3fnuz", "float8_e4m3fnuz": "fp8_e4m3fnuz",
    "e5m2fnuz": "fp8_e5m2fnuz", "float8_e5m2fnuz": "fp8_e5m2fnuz",
    "e2m1": "fp4_e2m1", "fp4": "fp4_e2m1",
}


def get_format(fmt: str | torch.dtype | FloatFormat) -> FloatFormat:
    """Look a format up by name, alias or torch dtype."""
    if isinstance(fmt, FloatFormat):
        return fmt
    if isinstance(fmt, torch.dtype):
        for f in FORMATS.values():
            if f.torch_dtype_name and f.torch_dtype == fmt:
                return f
        dtypes = ", ".join(f"torch.{f.torch_dtype_name}" for f in FORMATS.values() if f.torch_dtype_name)
        raise ValueError(f"No float format for dtype {fmt}; known: {', '.join(FORMATS)} ({dtypes})")
    if isinstance(fmt, str):
        key = fmt.strip().lower().replace("-", "_").removeprefix("torch.")
        key = _ALIASES.get(key, key)
        if key in FORMATS:
            return FORMATS[key]
    raise ValueError(
        f"Unknown float format {fmt!r}; known: {', '.join(FORMATS)} "
        f"(aliases: {', '.join(sorted(_ALIASES))}) or a torch float dtype"
    )


def headroom(amax: float, fmt_max: float) -> float:
    """Binades between a tensor's largest magnitude and a format's max (negative: it overflows)."""
    if not amax or math.isnan(amax):
        return math.inf
    return math.log2(fmt_max / amax)


def quantize(x: torch.Tensor, fmt: str | torch.dtype | FloatFormat,
             saturate: bool | None = None) -> torch.Tensor:
    """Round x to nearest-even into `fmt`; returns x's dtype.

    Overflow (a finite value beyond `fmt.max` once rounded, or inf): `saturate=None` does
    what torch's own cast does for the format (`fmt.torch_overflow`: fp16/bf16/e5m2 give inf,
    e4m3fn saturates to +-max, the fnuz formats give NaN); `saturate=True` clamps to +-max;
    `saturate=False` gives inf, or NaN where the format has no inf.
    float64 inputs are rounded to float32 first when the target is narrower, as torch's casts do.
    NaNs come out as torch's own cast makes them (sign, payload); where torch has no dtype, as
    the quiet NaN with x's sign and only the payload bits the format has.
    """
    f = get_format(fmt)
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        got = x.dtype if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"quantize needs a floating-point tensor, got {got}")
    if saturate is not None and not isinstance(saturate, bool):
        raise ValueError(f"saturate must be True, False or None (what torch's cast does), got {saturate!r}")
    if _fp32_field(f) and x.dtype == torch.float32 and saturate is not True:
        return _round_fp32_bits(x, f)
    if x.dtype == torch.float64 and f.mantissa_bits < 23:
        work = x.float()
    else:
        # float32 arithmetic is exact here: a/ulp < 2**(mantissa_bits + 1) and ulp >= 2**-149.
        work = x.to(torch.float64 if x.dtype == torch.float64 else torch.float32)
    a = work.abs()
    _, e = torch.frexp(a)  # a = m * 2**e with m in [0.5, 1)
    exponent = (e - 1).clamp(min=f.min_exponent)  # below the normals the ulp stays fixed
    ulp = torch.ldexp(torch.ones_like(a), exponent - f.mantissa_bits)
    q = torch.round(a / ulp) * ulp  # torch.round rounds half to even
    q = torch.where(q > f.max, _overflow_value(f, saturate, work.dtype), q)
    q = torch.copysign(q, work)
    if not f.has_negative_zero:
        q = torch.where(q == 0, torch.zeros_like(q), q)
    nan = torch.isnan(x)
    if nan.any():
        q = torch.where(nan, _nan_of(x, f), q.to(x.dtype))
    return q.to(x.dtype)


def _fp32_field(f: FloatFormat) -> bool:
    """f is fp32 with fewer mantissa bits (tf32, bf16): same exponent field, IEEE inf/NaN, so
    rounding is integer arithmetic on fp32's bits, and overflow gives inf as IEEE does."""
    return (f.exponent_bits == 8 and f.bias == 127 and f.encoding is Encoding.IEEE
            and f.mantissa_bits < 23 and f.torch_overflow == "inf")


def _round_fp32_bits(x: torch.Tensor, f: FloatFormat) -> torch.Tensor:
    """Round-to-nearest-even on fp32's bits: add half an ulp minus one plus the kept lsb, drop
    the low bits. A carry runs into the exponent (to inf past the max), subnormals included;
    four passes where the general path takes a dozen (TF32 emulation runs it on every product)."""
    drop = 23 - f.mantissa_bits
    bits = x.view(torch.int32)
    lsb = torch.bitwise_right_shift(bits, drop).bitwise_and_(1)
    out = lsb.add_(bits).add_((1 << (drop - 1)) - 1).bitwise_and_(~((1 << drop) - 1))
    out = out.view(torch.float32)
    nan = torch.isnan(x)
    return torch.where(nan, _nan_of(x, f), out) if nan.any() else out


def _nan_of(x: torch.Tensor, f: FloatFormat) -> torch.Tensor:
    """The NaNs x's NaNs become in f: torch's own (its cast decides payload and sign), else
    the quiet NaN keeping x's sign and the payload bits that f has."""
    if f.torch_dtype is not None:
        return x.to(f.torch_dtype).to(x.dtype)
    wide = torch.float64 if x.dtype == torch.float64 else torch.float32
    ints, fraction = (torch.int64, 52) if wide == torch.float64 else (torch.int32, 23)
    bits = x.to(wide).view(ints)
    dropped = (1 << (fraction - f.mantissa_bits)) - 1
    quiet = 1 << (fraction - 1)
    return ((bits & ~dropped) | quiet).view(wide).to(x.dtype)


def _overflow_value(f: FloatFormat, saturate: bool | None, dtype: torch.dtype) -> torch.Tensor:
    if saturate is None:
        behaviour = f.torch_overflow
    elif saturate or not (f.has_inf or f.has_nan):
        behaviour = "saturate"
    else:
        behaviour = "inf" if f.has_inf else "nan"
    value = {"inf": math.inf, "nan": math.nan, "saturate": f.max}[behaviour]
    return torch.tensor(value, dtype=dtype)


def format_table(names: tuple[str, ...] | None = None) -> Table:
    """The derived figures of each format as a deterministic table."""
    rows = []
    for f in (get_format(n) for n in (names or tuple(FORMATS))):
        rows.append((
            f.name, f"{f.exponent_bits}/{f.mantissa_bits}", f"{f.max:.6g}",
            f"2^{f.min_exponent}", f"2^{f.min_exponent - f.mantissa_bits}",
            f"2^-{f.mantissa_bits}", f.binades, f.encoding.value,
            {"inf": "inf", "saturate": "saturates", "nan": "NaN"}[f.torch_overflow],
        ))
    return Table(("format", "exp/mant", "max", "smallest normal", "smallest subnormal", "eps",
                  "binades", "encoding", "overflow"), rows,
                 caption="Float formats (every figure derived from the bits)")
