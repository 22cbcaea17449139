"""Formats against torch.finfo, against an enumeration of every bit pattern, and quantize vs casts."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import ampnb
from ampnb.formats import FORMATS, Encoding, format_table, get_format, quantize

TORCH_FORMATS = [f for f in FORMATS.values() if f.torch_dtype is not None]
SMALL_FORMATS = [f for f in TORCH_FORMATS if f.bits <= 16]  # small enough to enumerate


def all_values(f) -> torch.Tensor:
    """Every value the format can hold, decoded by torch from every bit pattern (float64)."""
    int_dtype = {8: torch.uint8, 16: torch.int16}[f.bits]
    n = 2**f.bits
    patterns = torch.arange(n, dtype=torch.int64)
    if f.bits == 16:
        patterns = patterns - 2**15
    return patterns.to(int_dtype).view(f.torch_dtype).to(torch.float64)


def finite_positive(f) -> torch.Tensor:
    v = all_values(f)
    return torch.unique(v[torch.isfinite(v) & (v > 0)])  # sorted


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-identical, NaN equal to NaN (payloads aside), signed zeros distinguished."""
    nan = torch.isnan(a)
    if not torch.equal(nan, torch.isnan(b)):
        return False
    int_dtype = {torch.float32: torch.int32, torch.float64: torch.int64}[a.dtype]
    return torch.equal(a[~nan].view(int_dtype), b[~nan].view(int_dtype))


# --- figures ------------------------------------------------------------------------------

@pytest.mark.parametrize("f", TORCH_FORMATS, ids=lambda f: f.name)
def test_figures_match_finfo(f):
    fi = torch.finfo(f.torch_dtype)
    assert f.max == fi.max
    assert f.smallest_normal == fi.smallest_normal
    assert f.bits == fi.bits
    assert -f.max == fi.min


@pytest.mark.parametrize("f", SMALL_FORMATS, ids=lambda f: f.name)
def test_figures_match_every_bit_pattern(f):
    """First principles: decode all 2**bits patterns and read the figures off them."""
    values = finite_positive(f)
    assert f.max == values.max().item()
    assert f.smallest_subnormal == values.min().item()
    assert f.smallest_normal == values[values.min().item() * 2**f.mantissa_bits <= values].min().item()
    one = (values == 1.0).nonzero().item()
    assert f.eps == (values[one + 1] - 1.0).item()
    everything = all_values(f)
    assert f.has_inf == bool(torch.isinf(everything).any())
    assert f.has_nan == bool(torch.isnan(everything).any())
    negzero = everything[(everything == 0) & torch.signbit(everything)]
    assert f.has_negative_zero == (len(negzero) > 0)


def test_eps_is_derived_from_bits_not_copied_from_finfo():
    """torch 2.13's finfo reports 0.125 for e5m2fnuz; two mantissa bits give 0.25."""
    f = get_format("fp8_e5m2fnuz")
    assert f.eps == 2.0**-f.mantissa_bits == 0.25
    values = finite_positive(f)
    one = (values == 1.0).nonzero().item()
    assert values[one + 1].item() - 1.0 == f.eps


@pytest.mark.parametrize("f", [f for f in TORCH_FORMATS if f.name != "fp64"], ids=lambda f: f.name)
def test_thresholds_agree_with_torch_cast(f):
    """The coverage thresholds are where torch's rounding changes its answer."""
    def cast(v: torch.Tensor) -> float:
        return v.to(f.torch_dtype).double().item()

    def up(v: float) -> torch.Tensor:
        return torch.nextafter(torch.tensor(v), torch.tensor(math.inf))

    def down(v: float) -> torch.Tensor:
        return torch.nextafter(torch.tensor(v), torch.tensor(0.0))

    over = f.overflow_threshold
    assert cast(down(over)) == f.max
    if f.torch_overflow == "saturate":  # torch clamps e4m3fn, so ask the unsaturated rounding
        q = quantize(torch.stack([torch.tensor(over), up(over)]), f, saturate=False)
        assert math.isnan(q[1]) and (math.isnan(q[0]) == f.overflow_inclusive)
    else:
        assert (not math.isfinite(cast(torch.tensor(over)))) == f.overflow_inclusive
        assert not math.isfinite(cast(up(over)))
    assert cast(torch.tensor(f.underflow_threshold)) == 0.0
    assert cast(up(f.underflow_threshold)) == f.smallest_subnormal
    assert cast(torch.tensor(f.normal_threshold)) == f.smallest_normal
    assert cast(down(f.normal_threshold)) < f.smallest_normal


def test_tf32_figures():
    f = get_format("tf32")
    assert not f.storage and f.torch_dtype is None
    assert f.eps == 2.0**-10 == get_format("fp16").eps
    assert f.smallest_normal == get_format("fp32").smallest_normal
    assert f.max == (2 - 2.0**-10) * 2.0**127


@pytest.mark.parametrize("name, alias", [
    ("fp16", "half"), ("fp16", torch.float16), ("bf16", "bfloat16"), ("bf16", torch.bfloat16),
    ("fp8_e4m3", "e4m3"), ("fp8_e4m3", "E4M3FN"), ("fp8_e4m3", torch.float8_e4m3fn),
    ("fp8_e5m2", "e5m2"), ("fp32", "float"), ("fp64", torch.float64), ("tf32", "tf32"),
    ("fp8_e5m2fnuz", "float8-e5m2fnuz"),
])
def test_get_format_aliases(name, alias):
    assert get_format(alias) is FORMATS[name]
    assert ampnb.get_format(alias) is FORMATS[name]


@pytest.mark.parametrize("bad", ["fp12", "", torch.int32, 3])
def test_get_format_unknown_names_known(bad):
    with pytest.raises(ValueError) as err:
        get_format(bad)
    msg = str(err.value)
    assert "\n" not in msg and "fp16" in msg


def test_format_table_is_derived():
    table = format_table(("fp16", "fp8_e4m3"))
    text = repr(table)
    assert f"{get_format('fp16').max:.6g}" in text and "saturates" in text
    assert "<table" in table._repr_html_()


# --- quantize -----------------------------------------------------------------------------

def edge_cases(f) -> dict[str, torch.Tensor]:
    """Named edge cases in float32, as torchao names its test cases."""
    v = finite_positive(f) if f.bits <= 16 else None
    mx, sn, ss = f.max, f.smallest_normal, f.smallest_subnormal
    cases = {
        "largest finite": [mx, -mx],
        "between max and overflow threshold": [(mx + f.overflow_threshold) / 2],
        "overflow threshold": [f.overflow_threshold, -f.overflow_threshold],
        "just past overflow threshold": [math.nextafter(f.overflow_threshold, math.inf)],
        "far overflow": [1e6 * mx if mx < 1e30 else 3e38],
        "smallest normal": [sn, -sn],
        "largest subnormal boundary": [f.normal_threshold, math.nextafter(f.normal_threshold, 0)],
        "smallest subnormal": [ss, -ss],
        "half the smallest subnormal": [ss / 2, -ss / 2],
        "just above half the smallest subnormal": [math.nextafter(ss / 2, 1)],
        "largest below one": [1 - f.eps / 2, 1 - f.eps / 4],
        "inf": [math.inf, -math.inf],
        "nan": [math.nan],
        "zeros": [0.0, -0.0],
    }
    out = {k: torch.tensor(x, dtype=torch.float32) for k, x in cases.items()}
    if v is not None:
        mids = (v[:-1] + v[1:]) / 2
        out["every tie"] = torch.cat([mids, -mids]).float()
        up = torch.nextafter(mids.float(), torch.tensor(math.inf))
        down = torch.nextafter(mids.float(), torch.tensor(0.0))
        out["either side of every tie"] = torch.cat([up, down])
        out["every value"] = torch.cat([v, -v]).float()
    return out


@pytest.mark.parametrize("f", [f for f in TORCH_FORMATS if f.name != "fp64"], ids=lambda f: f.name)
def test_quantize_equals_torch_cast_on_edge_cases(f):
    for name, x in edge_cases(f).items():
        if f.name == "fp32":
            x = x.double()
        ours = quantize(x, f)
        theirs = x.to(f.torch_dtype).to(x.dtype)
        assert ours.dtype == x.dtype
        assert same(ours, theirs), (f.name, name, x[:8], ours[:8], theirs[:8])


@pytest.mark.parametrize("f", TORCH_FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_quantize_equals_torch_cast_on_random_values(f, dtype):
    g = torch.Generator().manual_seed(0)
    mant = torch.rand(20_000, generator=g, dtype=torch.float64) * 2 - 1
    exps = torch.randint(-40, 40, (20_000,), generator=g)
    x = torch.ldexp(mant, exps).to(dtype)
    ours = quantize(x, f)
    theirs = x.to(f.torch_dtype).to(dtype)
    assert ours.dtype == dtype
    assert same(ours.double(), theirs.double())


@settings(max_examples=300, deadline=None)
@given(st.floats(width=32, allow_nan=True, allow_infinity=True))
def test_quantize_matches_casts_for_any_float32(value):
    x = torch.tensor([value], dtype=torch.float32)
    for f in TORCH_FORMATS:
        if f.name != "fp64":
            assert same(quantize(x, f), x.to(f.torch_dtype).float()), f.name


def _tf32_reference(x: torch.Tensor) -> torch.Tensor:
    """Round fp32's 23-bit mantissa to 10 bits, nearest-even, on the raw bits."""
    bits = x.view(torch.int32).to(torch.int64)
    lsb = (bits >> 13) & 1
    rounded = ((bits + 0xFFF + lsb) >> 13) << 13
    out = rounded.to(torch.int32).view(torch.float32)
    return torch.where(torch.isnan(x), x, out)


def test_quantize_tf32_rounds_mantissa_to_ten_bits():
    g = torch.Generator().manual_seed(1)
    x = torch.ldexp(torch.rand(50_000, generator=g) * 2 - 1, torch.randint(-140, 127, (50_000,), generator=g))
    x = torch.cat([x, torch.tensor([3.4028235e38, 1 + 2.0**-11, 1 + 3 * 2.0**-11, 0.0, -0.0])])
    assert same(quantize(x, "tf32"), _tf32_reference(x))


@pytest.mark.parametrize("name, value, saturate, expected", [
    ("fp16", 1e6, None, math.inf), ("fp16", 1e6, True, 65504.0), ("fp16", -1e6, True, -65504.0),
    ("fp8_e5m2", 1e6, None, math.inf), ("fp8_e5m2", 1e6, True, 57344.0),
    ("fp8_e4m3", 500.0, None, 448.0), ("fp8_e4m3", 500.0, False, math.nan),
    ("fp8_e4m3", math.inf, True, 448.0), ("fp8_e4m3fnuz", 500.0, None, math.nan),
    ("fp8_e4m3fnuz", 500.0, True, 240.0), ("fp4_e2m1", 100.0, None, 6.0),
    ("fp4_e2m1", 100.0, False, 6.0), ("bf16", 3.4e38, True, get_format("bf16").max),
])
def test_quantize_overflow_options(name, value, saturate, expected):
    out = quantize(torch.tensor([value]), name, saturate=saturate).item()
    assert (math.isnan(out) and math.isnan(expected)) or out == expected


def test_fp4_grid_is_the_e2m1_grid():
    """E2M1 holds 0, 0.5, 1, 1.5, 2, 3, 4, 6: every value it rounds to is one of the 2**3 codes."""
    f = get_format("fp4_e2m1")
    x = torch.linspace(-8, 8, 4001)
    grid = torch.unique(quantize(x, f).abs())
    expected = {0.0} | {math.ldexp(1 + m / 2, e) for e in range(f.min_exponent, f.max_exponent + 1)
                        for m in range(2)} | {f.smallest_subnormal}
    assert set(grid.tolist()) == expected


def test_quantize_fnuz_has_no_negative_zero():
    out = quantize(torch.tensor([-0.0, -1e-30]), "fp8_e4m3fnuz")
    assert not torch.signbit(out).any()
    assert get_format("fp8_e4m3fnuz").encoding is Encoding.FNUZ


@pytest.mark.parametrize("bad", [torch.arange(3), torch.tensor([True]), [1.0, 2.0]])
def test_quantize_rejects_non_float(bad):
    with pytest.raises(ValueError, match="floating-point"):
        quantize(bad, "fp16")


def test_quantize_leaves_input_untouched():
    x = torch.tensor([1.2345678, 70000.0])
    before = x.clone()
    quantize(x, "fp16")
    assert torch.equal(x, before)


# --- NaN payloads and bad arguments ------------------------------------------------------------

NAN_PATTERNS = [0x7FC00000, 0x7FC00001, 0x7F800001, 0xFFC12345, 0xFF800001, 0x7FFFFFFF, 0xFFFFFFFF,
                0x7FA0F0F0]


def _bits(t: torch.Tensor) -> list[int]:
    int_dtype = {torch.float32: torch.int32, torch.float64: torch.int64}[t.dtype]
    return t.view(int_dtype).tolist()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("f", TORCH_FORMATS, ids=lambda f: f.name)
def test_quantize_nans_are_torchs_nans_bit_for_bit(f, dtype):
    nans = torch.tensor(NAN_PATTERNS, dtype=torch.int64).to(torch.int32).view(torch.float32)
    for n in (1, len(NAN_PATTERNS), 40 * len(NAN_PATTERNS)):  # torch's scalar and vector paths
        x = torch.cat([nans.repeat(n)[:n], torch.tensor([1.0, -2.5])]).to(dtype)
        assert _bits(quantize(x, f)) == _bits(x.to(f.torch_dtype).to(dtype)), (f.name, n)


@pytest.mark.parametrize("name", ["tf32", "fp4_e2m1"])
def test_quantize_nans_of_formats_without_a_torch_dtype_are_values_of_the_format(name):
    f = get_format(name)
    x = torch.tensor(NAN_PATTERNS, dtype=torch.int64).to(torch.int32).view(torch.float32)
    out = torch.tensor(_bits(quantize(x, f)), dtype=torch.int64)
    assert torch.isnan(quantize(x, f)).all()
    low = (1 << (23 - f.mantissa_bits)) - 1  # mantissa bits the format does not have
    assert ((out & low) == 0).all() and ((out & 0x00400000) != 0).all()  # quiet, no extra bits
    assert torch.equal(out < 0, torch.tensor(NAN_PATTERNS) >= 2**31)  # the sign is kept


@pytest.mark.parametrize("bad", ["yes", 1, 0, "True", 1.0])
def test_quantize_refuses_a_saturate_that_is_not_a_bool_or_none(bad):
    with pytest.raises(ValueError, match=f"saturate must be True, False or None .*got {bad!r}") as err:
        quantize(torch.tensor([1e6]), "fp16", saturate=bad)
    assert "\n" not in str(err.value)
