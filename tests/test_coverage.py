"""coverage() and exponent_histogram() against element-by-element references (torch casts)."""

from __future__ import annotations

import math
import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import ampnb
from ampnb.formats import FORMATS as KNOWN_FORMATS
from ampnb.formats import get_format, quantize
from ampnb.instruments import EXP_BINS, coverage, coverage_many, exponent_histogram

FORMATS = ["fp16", "bf16", "fp8_e4m3", "fp8_e5m2", "fp8_e4m3fnuz", "fp8_e5m2fnuz", "tf32", "fp32"]


def up(v: float, dtype=torch.float32) -> float:
    return torch.nextafter(torch.tensor(v, dtype=dtype), torch.tensor(math.inf, dtype=dtype)).item()


def down(v: float, dtype=torch.float32) -> float:
    return torch.nextafter(torch.tensor(v, dtype=dtype), torch.tensor(0.0, dtype=dtype)).item()


def edge_values(f) -> list[float]:
    """Named edge cases of a format, with their neighbours in float32, both signs."""
    points = [f.max, f.overflow_threshold, f.smallest_normal, f.normal_threshold,
              f.smallest_subnormal, f.underflow_threshold, f.smallest_subnormal / 2,
              f.smallest_subnormal * 1.5, 1.0, 2 * f.max]
    vals = []
    for p in points:
        p32 = torch.tensor(p, dtype=torch.float32).item()
        if math.isfinite(p32) and p32 != 0:
            vals += [p32, up(p32), down(p32)]
    vals += [0.0, -0.0, math.inf, -math.inf, math.nan]
    return vals + [-v for v in vals]


def reference_category(v: float, f) -> str:
    """One element's category from a real rounding: torch's cast, or quantize without saturation."""
    if not math.isfinite(v):
        return "nonfinite"
    if v == 0:
        return "zero"
    t = torch.tensor([v], dtype=torch.float32)
    if f.torch_dtype is not None and f.torch_overflow != "saturate":
        q = t.to(f.torch_dtype).double().item()
    else:  # e4m3fn saturates in torch's cast and tf32 has no dtype: ask the unsaturated rounding
        q = quantize(t, f, saturate=False).double().item()
    if not math.isfinite(q):
        return "overflow"
    if q == 0:
        return "underflow"
    return "subnormal" if abs(q) < f.smallest_normal else "normal"


def reference_counts(values: list[float], f) -> dict[str, int]:
    out = dict.fromkeys(("overflow", "underflow", "subnormal", "normal", "zero", "nonfinite"), 0)
    for v in values:
        out[reference_category(v, f)] += 1
    return out


def counts_of(c) -> dict[str, int]:
    return {k: getattr(c, f"n_{k}") for k in ("overflow", "underflow", "subnormal", "normal",
                                               "zero", "nonfinite")}


@pytest.mark.parametrize("name", FORMATS)
def test_edge_cases_match_element_by_element_reference(name):
    f = get_format(name)
    values = [v for g in FORMATS for v in edge_values(get_format(g))]
    x = torch.tensor(values, dtype=torch.float32)
    x32 = x.tolist()  # the values as float32 holds them
    c = coverage(x, f)
    assert counts_of(c) == reference_counts(x32, f)
    assert sum(c.fractions().values()) == pytest.approx(1.0)
    assert c.count == len(values)


def test_documented_boundaries():
    """The issue's examples: fp16 overflows from 65520, e4m3fn only above 464."""
    fp16 = coverage(torch.tensor([65504.0, down(65520.0), 65520.0]), "fp16")
    assert (fp16.n_normal, fp16.n_overflow) == (2, 1)
    e4m3 = coverage(torch.tensor([448.0, 464.0, up(464.0)]), "e4m3")
    assert (e4m3.n_normal, e4m3.n_overflow) == (2, 1)
    tiny = get_format("fp16").smallest_subnormal
    half_way = coverage(torch.tensor([tiny / 2, up(tiny / 2), tiny]), "fp16")
    assert (half_way.n_underflow, half_way.n_subnormal) == (1, 2)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("name", ["fp16", "bf16", "fp8_e4m3", "fp8_e5m2", "fp8_e4m3fnuz"])
def test_narrow_input_dtypes_compare_exactly(dtype, name):
    """Thresholds that the input dtype cannot hold must not be rounded the wrong way."""
    f = get_format(name)
    values = [v for g in FORMATS for v in edge_values(get_format(g))]
    x = torch.tensor(values, dtype=torch.float32).to(dtype)
    assert counts_of(coverage(x, f)) == reference_counts(x.float().tolist(), f)


def test_float64_input_against_fp32():
    f = get_format("fp32")
    vals = [f.max, 2.0**128, 2.0**-149, 2.0**-150, 2.0**-150 * 1.0001, 2.0**-126, 1e-300, 0.0]
    x = torch.tensor(vals, dtype=torch.float64)
    c = coverage(x, "fp32")
    ref = x.float()
    assert c.n_overflow == int(torch.isinf(ref).sum())
    assert c.n_underflow == int(((ref == 0) & (x != 0)).sum())
    assert c.n_subnormal == int(((ref != 0) & (ref.abs() < f.smallest_normal)).sum())


@settings(max_examples=40, deadline=None)
@given(st.lists(st.floats(width=32, allow_nan=True, allow_infinity=True), min_size=1,
                max_size=40),
       st.sampled_from(["fp16", "bf16", "fp8_e4m3", "fp8_e5m2", "fp8_e5m2fnuz"]))
def test_random_values_match_reference(values, name):
    f = get_format(name)
    c = coverage(torch.tensor(values, dtype=torch.float32), f)
    assert counts_of(c) == reference_counts(values, f)


def test_amax_and_smallest_nonzero_match_torch():
    x = torch.randn(1000) * 300
    x[3], x[7], x[9] = math.inf, math.nan, 0.0
    c = coverage(x, "fp16")
    finite = x[torch.isfinite(x)].abs()
    assert c.amax == finite.max().item()
    assert c.min_nonzero == finite[finite > 0].min().item()
    assert math.isnan(coverage(torch.zeros(3), "fp16").min_nonzero)


def test_many_equals_one_by_one():
    x = torch.randn(5000) * 1e3
    many = coverage_many(x, FORMATS)
    assert all(many[get_format(n).name] == coverage(x, n) for n in FORMATS)


def test_exponent_histogram_against_frexp():
    x = torch.cat([torch.randn(2000) * 1e4, torch.tensor([0.0, math.inf, math.nan, 2.0**-149])])
    h = exponent_histogram(x)
    assert h.shape == (len(EXP_BINS) - 1,)
    ref = torch.zeros_like(h)
    for v in x.tolist():
        if v != 0 and math.isfinite(v):
            ref[math.frexp(abs(v))[1] - 1 - EXP_BINS[0]] += 1
    assert torch.equal(h, ref)
    assert h.sum().item() == int((torch.isfinite(x) & (x != 0)).sum())


@pytest.mark.parametrize("bad, message", [
    (torch.arange(4), "floating-point"),
    (torch.empty(0), "non-empty"),
    ([1.0, 2.0], "torch.Tensor"),
    (torch.ones(3, device="meta"), "meta tensor.*allowed: a tensor with data"),
])
def test_bad_input_one_line_error(bad, message):
    with pytest.raises(ValueError, match=message) as e:
        coverage(bad, "fp16")
    assert "\n" not in str(e.value)


def test_unknown_format_names_allowed_ones():
    with pytest.raises(ValueError, match="fp16"):
        coverage(torch.ones(3), "fp7")


def test_public_name_and_repr():
    c = ampnb.coverage(torch.tensor([1.0, 1e6]), "fp16")
    assert c.overflow == 0.5
    assert "fp16" in repr(c) and "<table" in c._repr_html_()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_cpu():
    x = torch.randn(10_000) * 1e5
    assert coverage(x.cuda(), "fp16") == coverage(x, "fp16")
    assert torch.equal(exponent_histogram(x.cuda()), exponent_histogram(x))


# The oracle. Float32 counts come from bit keys (_bitkeys: keys, chunks, runs of short
# segments joined on rows, stragglers); bucketize_counts is the simple computation, one
# bucketize of |x| against every level. The fast path must give exactly what it gives.

def _awkward_float32(n: int = 4000) -> torch.Tensor:
    """Random magnitudes over fp32's whole range, tiny subnormals, NaN payloads, exact cut points."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(n, generator=g) * torch.exp2(torch.empty(n).uniform_(-150, 128, generator=g))
    bits = torch.tensor([0, 1, 2, 4095, 4096, 4097, 0x7F800000, 0x7F800001, 0x7FC00000,
                         0x7FFFFFFF, 0x7F7FFFFF], dtype=torch.int32)
    edges = [v for f in FORMATS for v in edge_values(get_format(f))]
    return torch.cat([x, bits.view(torch.float32), -bits.view(torch.float32),
                      torch.tensor(edges, dtype=torch.float32)])


def _oracle_tensors() -> dict[str, torch.Tensor]:
    """Float32 tensors of each kind the oracle test runs on, both signs."""
    g = torch.Generator().manual_seed(17)
    n = 3000
    sign = torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0)
    normal = torch.randn(n, generator=g) * torch.exp2(torch.empty(n).uniform_(-40, 40, generator=g))
    subnormal = torch.randint(1, 1 << 23, (n,), generator=g, dtype=torch.int32).view(
        torch.float32) * sign
    zeros = torch.zeros(n) * sign  # +0 and -0
    specials = torch.tensor([0x7F800000, 0x7F800001, 0x7FC00000, 0x7FFFFFFF], dtype=torch.int32)
    nonfinite = torch.cat([specials.view(torch.float32).repeat(n // 8), normal[: n // 2]]) * \
        sign[: n // 2 + 4 * (n // 8)]
    return {"normal": normal, "subnormal": subnormal, "zeros": zeros,
            "inf and NaN": nonfinite, "mixed": _awkward_float32(),
            "only inf and NaN": specials.view(torch.float32).repeat(50)}


def _same_float(a: float, b: float) -> bool:
    return a == b or (math.isnan(a) and math.isnan(b))


def _assert_same_as_oracle(fast, oracle) -> None:
    assert [h for _, h in fast] == [h for _, h in oracle]
    for (cf, _), (co, _) in zip(fast, oracle):
        assert cf.keys() == co.keys()
        for name in cf:
            a, b = cf[name], co[name]
            assert counts_of(a) == counts_of(b), name
            assert a.count == b.count
            assert _same_float(a.amax, b.amax) and _same_float(a.min_nonzero, b.min_nonzero)


ALL_FORMATS = tuple(KNOWN_FORMATS)  # every format ampnb knows


@pytest.mark.parametrize("names", [(f,) for f in ALL_FORMATS] + [ALL_FORMATS],
                         ids=[*ALL_FORMATS, "all together"])
@pytest.mark.parametrize("kind", list(_oracle_tensors()))
def test_oracle_fast_path_equals_bucketize(kind, names, monkeypatch):
    """The oracle test: coverage and histogram from bit keys equal bucketize_counts, for
    one segment alone (in several chunks), segments joined on rows, and |x| staged."""
    from ampnb.instruments import _bitkeys
    from ampnb.instruments import coverage_stats as cs
    x = _oracle_tensors()[kind]
    fmts = tuple(get_format(f) for f in names)
    n = x.numel()
    monkeypatch.setattr(_bitkeys, "CHUNK", 999)  # several chunks, the last one short
    for lengths in ([n], [1, 100, 7, 64, n - 172]):
        oracle = cs.per_segment(cs.bucketize_counts(x, lengths, fmts))
        _assert_same_as_oracle(cs.segment_stats(x, lengths, fmts), oracle)
        _assert_same_as_oracle(cs.segment_stats(x.abs(), lengths, fmts, absolute=True), oracle)


def test_formats_rounding_inside_cells_make_stragglers():
    """tf32 and bf16 round inside the same cells near float32's ends, and tiny subnormals share
    cell 0: those levels are stragglers (the oracle test covers their masked pass)."""
    from ampnb.instruments._keyplan import key_plan
    plan = key_plan(tuple(get_format(f) for f in FORMATS))
    assert {s.cell for s in plan.stragglers} == {0, 0x7F, 0x7F7F}


def test_tiny_subnormals_histogram_against_frexp():
    x = torch.tensor([2.0**-149, 3 * 2.0**-149, 2.0**-140, 2.0**-138, 2.0**-137, 0.0, 1.0])
    h = exponent_histogram(x)
    ref = torch.zeros_like(h)
    for v in x.tolist():
        if v:
            ref[math.frexp(v)[1] - 1 - EXP_BINS[0]] += 1
    assert torch.equal(h, ref)


def test_formats_rounding_inside_one_cell_count_exactly():
    """tf32 and bf16 both round within the key cells just under 2**-126 and near float32's max."""
    g = torch.Generator().manual_seed(5)
    near = [get_format("bf16").normal_threshold, get_format("bf16").overflow_threshold,
            get_format("tf32").normal_threshold, get_format("tf32").overflow_threshold]
    x = torch.cat([torch.tensor([v for f in ("tf32", "bf16") for v in edge_values(get_format(f))]),
                   *(torch.tensor(v, dtype=torch.float32) * (1 + torch.rand(200, generator=g)
                     * 2.0**-8 * (torch.rand(200, generator=g) - 0.5)) for v in near)])
    many = coverage_many(x, ["bf16", "tf32", "fp16"])
    for name in ("bf16", "tf32", "fp16"):
        assert counts_of(many[name]) == reference_counts(x.tolist(), get_format(name))


def test_large_chunks_counted_on_two_threads_agree_with_the_general_path(monkeypatch):
    """Keys of a large chunk are counted half on a worker thread; the sum must be exact."""
    from ampnb.instruments import _bitkeys
    from ampnb.instruments import coverage_stats as cs
    g = torch.Generator().manual_seed(11)
    n = (1 << 21) + 5
    x = torch.randn(n, generator=g) * torch.exp2(torch.empty(n).uniform_(-30, 20, generator=g))
    fmts = tuple(get_format(f) for f in ("fp16", "bf16", "fp8_e4m3"))
    monkeypatch.setattr(_bitkeys, "_BINCOUNT_WORKERS", {})
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        fast = cs.segment_stats(x, [n], fmts)
    finally:
        torch.set_num_threads(before)
    assert list(_bitkeys._BINCOUNT_WORKERS) == [os.getpid()]  # the worker thread took part
    assert fast == cs.per_segment(cs.bucketize_counts(x, [n], fmts))


def test_long_segments_counted_alone_between_runs_of_short_ones(monkeypatch):
    """Segments counted alone (long) and in packed runs (short), interleaved, give what one
    bucketize per segment gives, in the segments' own order."""
    from ampnb.instruments import _bitkeys
    from ampnb.instruments import coverage_stats as cs
    x = _awkward_float32()
    fmts = tuple(get_format(f) for f in FORMATS)
    monkeypatch.setattr(_bitkeys, "ALONE", 500)
    monkeypatch.setattr(_bitkeys, "CHUNK", 1200)
    lens = [3, 600, 10, 0, 2000, 1, 1, 700]
    lens[3] = 5
    lens.append(x.numel() - sum(lens))
    fast = cs.segment_stats(x, lens, fmts)
    general = cs.per_segment(cs.bucketize_counts(x, lens, fmts))
    assert [h for _, h in fast] == [h for _, h in general]
    for (cf, _), (cg, _) in zip(fast, general):
        for k in cf:
            assert counts_of(cf[k]) == counts_of(cg[k])
            assert cf[k].min_nonzero == cg[k].min_nonzero or math.isnan(cf[k].min_nonzero)
