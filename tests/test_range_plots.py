"""Range plots: the artists drawn match torch.finfo, torch's own casts and ampnb.coverage."""

from __future__ import annotations

import math

import pytest
import torch
from matplotlib.patches import Rectangle

import ampnb
from ampnb import putback_state
from ampnb.display import format_percent as _pct
from ampnb.plots import (
    plot_format_ladder,
    plot_layer_summary,
    plot_loss_scale_effect,
    plot_tensor_histogram,
)
from ampnb.plots._axes import new_axes
from ampnb.plots.ranges import NONE_COLOUR, colour, holds

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16,
          "fp8_e5m2": torch.float8_e5m2, "fp8_e4m3": torch.float8_e4m3fn}


def _by_gid(ax, gid):
    found = [a for a in ax.get_children() if a.get_gid() == gid]
    assert len(found) == 1, f"expected one artist {gid!r}, found {len(found)}"
    return found[0]


def _edges(rect: Rectangle) -> tuple[float, float]:
    return rect.get_x(), rect.get_x() + rect.get_width()


def _finfo_limits(dtype):
    """log2 of smallest subnormal, smallest normal and max, from torch.finfo and torch casts."""
    fi = torch.finfo(dtype)
    sub = fi.tiny * fi.eps
    # The reference must really be the smallest subnormal: it survives a cast, half of it not.
    assert torch.tensor(sub, dtype=torch.float64).to(dtype).double().item() == sub
    assert torch.tensor(sub / 2, dtype=torch.float64).to(dtype).double().item() == 0
    return math.log2(sub), math.log2(fi.tiny), math.log2(fi.max)


@pytest.mark.parametrize("name", list(DTYPES))
def test_ladder_band_edges_are_the_formats_log2_limits(name):
    ax = plot_format_ladder(list(DTYPES))
    lo, normal, hi = _finfo_limits(DTYPES[name])
    assert _edges(_by_gid(ax, f"{name}:subnormal")) == pytest.approx((lo, normal), abs=1e-12)
    assert _edges(_by_gid(ax, f"{name}:normal")) == pytest.approx((normal, hi), abs=1e-12)
    labels = [t.get_text() for t in ax.get_yticklabels()]
    assert labels[0].startswith("fp8_e4m3") and labels[-1].startswith("fp32")  # widest on top
    assert any(t.get_text().startswith(f"max {torch.finfo(DTYPES[name]).max:.5g}")
               for t in ax.texts)


def test_ladder_draws_on_a_given_axes_and_rejects_unknown_formats():
    ax = new_axes()
    assert plot_format_ladder(["fp16"], ax=ax) is ax
    assert len(ax.containers) == 2
    with pytest.raises(ValueError, match="fp12"):
        plot_format_ladder(["fp16", "fp12"])
    with pytest.raises(ValueError, match="formats is empty"):
        plot_format_ladder([])


def _spread(n=4000, lo=-30.0, hi=18.0, seed=0):
    """Values whose log2 magnitudes spread evenly over [lo, hi), with zeros, signs and inf."""
    g = torch.Generator().manual_seed(seed)
    e = torch.rand(n, generator=g) * (hi - lo) + lo
    x = torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0) * torch.exp2(e)
    x[:7] = 0.0
    x[7] = math.inf
    return x


def _cast_fractions(x, dtype):
    """Overflow / underflow / subnormal fractions measured by torch's own cast."""
    q = x.to(dtype).float()
    finite = torch.isfinite(x)
    n = x.numel()
    overflow = (finite & torch.isinf(q)).sum().item() / n
    underflow = ((x != 0) & finite & (q == 0)).sum().item() / n
    subnormal = ((q != 0) & (q.abs() < torch.finfo(dtype).tiny)).sum().item() / n
    return overflow, underflow, subnormal


@pytest.mark.parametrize("fmts", [("fp16", "bf16"), ("fp8_e5m2", "fp16", "bf16")])
def test_histogram_counts_bands_and_annotations(fmts):
    x = _spread()
    ax = plot_tensor_histogram(x, fmts)
    counts = _by_gid(ax, "histogram").get_data().values
    assert counts.tolist() == ampnb.instruments.exponent_histogram(x).tolist()
    # Every finite nonzero element is in exactly one bar.
    assert counts.sum() == (torch.isfinite(x) & (x != 0)).sum().item()
    for name in fmts:
        lo, normal, hi = _finfo_limits(DTYPES[name])
        assert _edges(_by_gid(ax, f"{name}:subnormal")) == pytest.approx((lo, normal))
        assert _edges(_by_gid(ax, f"{name}:normal")) == pytest.approx((normal, hi))
        over, under, sub = _cast_fractions(x, DTYPES[name])
        assert over > 0 or name == "bf16"
        assert _by_gid(ax, f"coverage:{name}").get_text() == (
            f"{name}: overflow {_pct(over)} · underflow {_pct(under)} · subnormal {_pct(sub)}")
    assert "inf/NaN " + _pct(1 / x.numel()) in ax.get_title()
    assert "zeros " + _pct(7 / x.numel()) in ax.get_title()


def test_histogram_of_captured_stats_matches_the_tensor_and_checks_formats():
    x = _spread(seed=1)
    stats = ampnb.instruments.summarize(x, ("fp16", "fp8_e4m3"), name="w", kind="weight")
    a, b = plot_tensor_histogram(x, ("fp16", "fp8_e4m3")), plot_tensor_histogram(
        stats, ("fp16", "fp8_e4m3"))
    assert (_by_gid(a, "histogram").get_data().values.tolist()
            == _by_gid(b, "histogram").get_data().values.tolist())
    assert _by_gid(a, "coverage:fp8_e4m3").get_text() == _by_gid(
        b, "coverage:fp8_e4m3").get_text()
    assert b.get_title().startswith("w (weight)")
    with pytest.raises(ValueError, match="not captured"):
        plot_tensor_histogram(stats, ("bf16",))


def test_histogram_bad_and_empty_inputs():
    with pytest.raises(ValueError, match="floating-point"):
        plot_tensor_histogram(torch.arange(4))
    with pytest.raises(ValueError, match="list"):
        plot_tensor_histogram([1.0, 2.0])
    ax = plot_tensor_histogram(torch.zeros(5))
    assert "no finite nonzero values" in ax.texts[0].get_text()
    stats = ampnb.instruments.summarize(torch.empty(0, 3), name="empty")
    assert "no finite nonzero" in plot_tensor_histogram(stats).texts[0].get_text()


@pytest.mark.parametrize("fmt, inside, outside", [
    ("fp16", 65504.0, 65520.0),            # max, and the first value that rounds past it
    ("fp8_e4m3", 464.0, 464.0 + 2**-10),   # e4m3fn: the tie at 464 rounds down to 448
    ("fp8_e5m2", 57344.0, 61440.0),
])
def test_holds_agrees_with_coverage_at_the_edges(fmt, inside, outside):
    f = ampnb.get_format(fmt)
    small = f.smallest_subnormal / 2  # the tie rounds to even: zero
    for amax, min_nz in ((inside, 1.0), (outside, 1.0), (1.0, small),
                         (1.0, math.nextafter(small, 1.0))):
        c = ampnb.coverage(torch.tensor([amax, min_nz], dtype=torch.float64), fmt)
        assert holds(fmt, amax, min_nz) == (c.n_overflow == 0 and c.n_underflow == 0), (
            amax, min_nz)
    assert holds(fmt, inside, 1.0) and not holds(fmt, outside, 1.0)


def _captured_mlp():
    d = ampnb.models.demo("mlp", width=16, batch_size=32, n_batches=1)
    with ampnb.capture(d.model, keep=True) as cap:
        x, y = d.batches[0]
        d.loss_fn(d.model(x), y).backward()
    return cap


def test_layer_summary_rows_span_the_tensor_and_colour_by_the_first_format_that_holds_it():
    cap = _captured_mlp()
    fmts = ("fp8_e4m3", "fp16", "bf16")
    ax = plot_layer_summary(cap, fmts)
    assert len(cap.records) > 6
    colours = set()
    for r in cap.records:
        t = r.tensor.abs()
        nz = t[t > 0]
        line = _by_gid(ax, f"row:{r.kind}:{r.name}")
        assert list(line.get_xdata()) == pytest.approx(
            [math.log2(nz.min().item()), math.log2(t.max().item())])
        covs = ampnb.instruments.coverage_many(r.tensor, fmts)
        held = [f for f in fmts if covs[f].n_overflow == 0 and covs[f].n_underflow == 0]
        expect = colour(fmts.index(held[0])) if held else NONE_COLOUR
        assert line.get_color() == expect
        assert _by_gid(ax, f"holds:{r.kind}:{r.name}").get_text() == (", ".join(held) or "none")
        colours.add(expect)
    assert len(colours) >= 2  # the MLP's gradients do not all fit e4m3
    labels = [t.get_text() for t in ax.get_yticklabels()]
    assert labels[-1] == f"{cap.records[0].name} ({cap.records[0].kind})"


def test_layer_summary_kind_filter_planted_overflow_and_bad_input():
    cap = _captured_mlp()
    ax = plot_layer_summary(cap, ("fp16",), kind="gradient")
    assert {t.get_text().split(" (")[1] for t in ax.get_yticklabels()} == {"gradient)"}
    big = ampnb.instruments.summarize(torch.tensor([1e5, 1.0]), ("fp16",), name="big")
    ax = plot_layer_summary([big], ("fp16", "bf16"))
    assert _by_gid(ax, "row:activation:big").get_color() == colour(1)  # fp16 overflows, bf16 holds it
    assert plot_layer_summary([big], ("fp16",)).get_lines()[-1].get_color() == NONE_COLOUR
    assert "no gradient tensors" in plot_layer_summary([], kind="gradient").texts[0].get_text()
    with pytest.raises(ValueError, match="TensorStats"):
        plot_layer_summary([torch.ones(2)])


def test_loss_scale_effect_histograms_and_coverage_match_torch_casts():
    g = _spread(seed=2, lo=-40.0, hi=-2.0)[8:]  # gradient-like: small, no inf
    before_state = putback_state.torch_state()
    ax = plot_loss_scale_effect(g, scale=2.0**16, fmt="fp16")
    assert putback_state.torch_state() == before_state
    eh = ampnb.instruments.exponent_histogram
    assert _by_gid(ax, "before").get_data().values.tolist() == eh(g).tolist()
    assert _by_gid(ax, "after").get_data().values.tolist() == eh(g * 2.0**16).tolist()
    for gid, values, title in (("coverage:before", g, "as computed"),
                               ("coverage:after", g * 2.0**16, "× 2^16")):
        over, under, sub = _cast_fractions(values, torch.float16)
        assert _by_gid(ax, gid).get_text() == (
            f"{title}: overflow {_pct(over)} · underflow {_pct(under)} · subnormal {_pct(sub)}")
    assert _cast_fractions(g, torch.float16)[1] > 0.1  # the lesson: without a scale they vanish
    lo, normal, hi = _finfo_limits(torch.float16)
    assert _edges(_by_gid(ax, "fp16:normal")) == pytest.approx((normal, hi))


def test_loss_scale_effect_reads_a_models_gradients_and_rejects_bad_input():
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    with pytest.raises(ValueError, match="backward"):
        plot_loss_scale_effect(model)
    model(torch.randn(16, 8)).pow(2).mean().backward()
    flat = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    ax = plot_loss_scale_effect(model, scale=1024.0)
    assert (_by_gid(ax, "after").get_data().values.tolist()
            == ampnb.instruments.exponent_histogram(flat * 1024).tolist())
    for bad in (0, -2.0, math.inf, "big", True):
        with pytest.raises(ValueError, match="scale="):
            plot_loss_scale_effect(flat, scale=bad)
    with pytest.raises(ValueError, match="floating-point"):
        plot_loss_scale_effect([torch.arange(3)])
