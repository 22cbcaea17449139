"""FP8 casts against torch's float8 dtypes; recipe scales against TE's formula, window and margin."""

from __future__ import annotations

import itertools

import pytest
import torch

from ampnb.formats import get_format, quantize
from ampnb.fp8 import DelayedScaling, Fp8Recipe, amax_to_scale, from_recipe_name, sqnr
from ampnb.fp8.linear import Fp8Linear, Role
from ampnb.fp8.recipe import AmaxAlgo, Fp8Format, Scaling
from ampnb.fp8.scaling import fp8_fractions, history_to_amax, push_amax, scaled_quantize

DTYPES = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def every_fp8_value(dtype: torch.dtype) -> torch.Tensor:
    """All 256 bit patterns of an FP8 dtype, as float32 (NaNs included)."""
    return torch.arange(256, dtype=torch.uint8).view(dtype).float()


def edge_cases(fmt: str) -> dict[str, torch.Tensor]:
    f = get_format(fmt)
    grid = every_fp8_value(DTYPES[fmt])
    finite = grid[torch.isfinite(grid)].unique()
    mids = (finite[1:] + finite[:-1]) / 2  # exact ties: round half to even decides
    return {
        "every value": grid,
        "midpoints": mids,
        "just off midpoints": torch.cat([torch.nextafter(mids, mids + 1),
                                         torch.nextafter(mids, mids - 1)]),
        "smallest subnormal and half of it": torch.tensor([f.smallest_subnormal,
                                                           f.smallest_subnormal / 2]),
        "past max": torch.tensor([f.max * 1.06, f.max * 2, 1e6, -1e30, float("inf")]),
        "random wide": torch.randn(4096, generator=torch.Generator().manual_seed(0)) * f.max / 8,
    }


CASES = [(fmt, name) for fmt in DTYPES for name in edge_cases(fmt)]


@pytest.mark.parametrize(("fmt", "case"), CASES)
def test_emulated_cast_equals_torch_float8_cast_bit_for_bit(fmt, case):
    x = edge_cases(fmt)[case]
    ours = quantize(x, fmt)
    theirs = x.to(DTYPES[fmt]).float()
    assert torch.equal(ours.view(torch.int32), theirs.view(torch.int32)) or (
        torch.equal(torch.isnan(ours), torch.isnan(theirs))
        and torch.equal(ours[~torch.isnan(ours)], theirs[~torch.isnan(theirs)]))


@pytest.mark.parametrize("fmt", list(DTYPES))
def test_scaled_quantize_saturates_like_a_clamped_torch_cast(fmt):
    f = get_format(fmt)
    x = torch.randn(2048, generator=torch.Generator().manual_seed(1)) * 3
    scale = torch.tensor(f.max / 2.0)  # a quarter of the values land past max
    ours = scaled_quantize(x, fmt, scale, saturate=True)
    theirs = (x * scale).clamp(-f.max, f.max).to(DTYPES[fmt]).float()
    assert torch.equal(ours, theirs)
    assert ours.abs().max().item() == f.max


def test_without_saturation_e5m2_overflows_to_inf_as_torch_does():
    x = torch.tensor([1.0, -3.0])
    ours = scaled_quantize(x, "fp8_e5m2", torch.tensor(get_format("fp8_e5m2").max), saturate=None)
    assert torch.equal(ours, (x * get_format("fp8_e5m2").max).to(torch.float8_e5m2).float())
    assert torch.isinf(ours[1])


@pytest.mark.parametrize(("fmt", "margin"), list(itertools.product(DTYPES, [0, 1, 3])))
@pytest.mark.parametrize("amax", [1e-3, 0.37, 1.0, 2.5e4, 3.0e38])
def test_scale_is_fp8_max_over_amax_over_two_to_the_margin(fmt, margin, amax):
    a = torch.tensor(amax)
    expected = torch.finfo(DTYPES[fmt]).max / a.double() / 2.0**margin
    assert amax_to_scale(a, fmt, margin).item() == expected.float().item()
    # Transformer Engine computes it in float32: the same correctly rounded value.
    te = torch.tensor(torch.finfo(DTYPES[fmt]).max) / a / 2.0**margin
    assert amax_to_scale(a, fmt, margin).item() == te.item()


def test_scale_keeps_the_previous_one_where_amax_is_zero_or_not_finite():
    previous = torch.tensor(3.0)
    for amax in (0.0, -0.0, float("inf"), float("nan"), 1e-40):  # 1e-40: the scale overflows
        assert amax_to_scale(torch.tensor(amax), "fp8_e4m3", 0, previous).item() == 3.0
    # Without a previous scale, an all-zero tensor still gets a finite scale (torchao's clamp).
    assert torch.isfinite(amax_to_scale(torch.tensor(0.0), "fp8_e4m3"))


def reference_scales(amaxes: list[float], n: int, algo: str, margin: int, fmax: float):
    """Transformer Engine's delayed scaling, by hand: (scale used, scale after) per step."""
    used, scale, seen = [], 1.0, []
    for a in amaxes:
        used.append(scale)
        seen.append(a)
        window = seen[-n:]
        best = max(window) if algo == "max" else window[-1]
        if best > 0:
            scale = (torch.tensor(fmax) / torch.tensor(best) / 2.0**margin).item()
    return used


@pytest.mark.parametrize("algo", ["max", "most_recent"])
@pytest.mark.parametrize(("n", "margin"), [(1, 0), (3, 0), (3, 2), (16, 1)])
def test_delayed_scaling_follows_the_amax_history_window(algo, n, margin):
    recipe = DelayedScaling(amax_history_len=n, amax_compute_algo=algo, margin=margin)
    layer = Fp8Linear(8, 16, recipe=recipe)
    fmax = torch.finfo(torch.float8_e4m3fn).max
    # A spike at step 2 then small values: `max` remembers it for n steps, most_recent does not.
    magnitudes = [1.0, 2.0, 40.0, 0.5, 0.25, 0.5, 3.0, 0.125, 1.0, 0.5]
    used = []
    for m in magnitudes:
        x = torch.zeros(4, 8)
        x[1, 3] = -m
        used.append(layer.cast(Role.INPUT, x)[1].item())
    assert used == reference_scales(magnitudes, n, algo, margin, fmax)
    padding = [0.0] * max(n - len(magnitudes), 0)  # TE's history starts as zeros
    assert layer.amax_history[Role.INPUT].tolist() == (magnitudes + padding)[-n:]


def test_push_and_history_helpers_keep_the_newest_n():
    h = torch.zeros(3)
    for i, a in enumerate([5.0, 1.0, 2.0, 4.0]):
        h = push_amax(h, torch.tensor(a), i)
    assert h.tolist() == [1.0, 2.0, 4.0]
    assert history_to_amax(h, 4, "max").item() == 4.0
    assert history_to_amax(h, 4, AmaxAlgo.MOST_RECENT).item() == 4.0
    assert history_to_amax(torch.tensor([2.0, 7.0, 0.0]), 2, "max").item() == 7.0


def test_dynamic_scaling_uses_the_current_tensor():
    layer = Fp8Linear(8, 16, recipe="tensorwise")
    x = torch.randn(4, 8) * 7
    q, scale = layer.cast(Role.INPUT, x)
    assert scale.item() == amax_to_scale(x.abs().amax(), "fp8_e4m3").item()
    # The cast gives torch's own FP8 tensor (one byte a value, what backward keeps).
    assert q.dtype == torch.float8_e4m3fn
    assert q.float().abs().max().item() == torch.finfo(torch.float8_e4m3fn).max


def test_hybrid_uses_e5m2_for_gradients_and_e4m3_recipe_everywhere():
    hybrid, e4m3 = from_recipe_name("delayed"), from_recipe_name("e4m3-delayed")
    assert hybrid.backward_format.max == torch.finfo(torch.float8_e5m2).max
    assert e4m3.backward_format.max == torch.finfo(torch.float8_e4m3fn).max
    assert hybrid.forward_format == e4m3.forward_format == get_format("fp8_e4m3")


def test_recipe_defaults_are_transformer_engines():
    r = DelayedScaling()
    assert (r.fp8_format, r.amax_history_len, r.amax_compute_algo, r.margin, r.scaling) == (
        Fp8Format.HYBRID, 1024, AmaxAlgo.MAX, 0, Scaling.DELAYED)
    assert "1024" in r.describe() and "fp8_e5m2" in r.describe()


@pytest.mark.parametrize(("kw", "bad"), [
    (dict(amax_history_len=0), "amax_history_len=0"),
    (dict(amax_history_len=True), "amax_history_len=True"),
    (dict(margin=-1), "margin=-1"),
    (dict(amax_compute_algo="mean"), "'mean'"),
    (dict(fp8_format="E3M4"), "'E3M4'"),
    (dict(saturate="yes"), "saturate='yes'"),
])
def test_bad_recipe_fields_name_the_value_and_the_choices(kw, bad):
    with pytest.raises(ValueError, match="allowed") as err:
        Fp8Recipe(**kw)
    assert bad in str(err.value) and "\n" not in str(err.value)


def test_unknown_recipe_names_and_fields_are_one_line_errors():
    with pytest.raises(ValueError, match="'fastest'.*allowed: delayed, tensorwise"):
        from_recipe_name("fastest")
    with pytest.raises(ValueError, match="no field 'history'"):
        DelayedScaling(history=3)
    assert from_recipe_name(" Tensorwise ").scaling is Scaling.DYNAMIC


def test_sqnr_and_fractions_against_their_definitions():
    x = torch.randn(1000, generator=torch.Generator().manual_seed(2))
    noisy = x + 0.01 * torch.randn(1000, generator=torch.Generator().manual_seed(3))
    expected = 10 * torch.log10((x.double() ** 2).sum() / ((x.double() - noisy.double()) ** 2).sum())
    assert sqnr(x, noisy) == pytest.approx(expected.item(), rel=1e-12)
    assert sqnr(x, x) == float("inf")
    f = get_format("fp8_e4m3")
    scaled = torch.tensor([0.0, f.smallest_subnormal / 4, 1.0, f.max, f.max * 2, -f.max * 3,
                           f.max * 1.03, f.max * 1.04])  # either side of the rounding midpoint
    saturated, flushed = fp8_fractions(scaled, f)
    q = scaled.to(torch.float8_e4m3fn).float()
    assert flushed == ((q == 0) & (scaled != 0)).sum().item() / scaled.numel()
    overflowed = torch.isnan(quantize(scaled, f, saturate=False))  # e4m3fn has no inf
    assert saturated == overflowed.sum().item() / scaled.numel() == 3 / 8


def test_delayed_scaling_shows_its_fields_in_its_signature():
    # Shift-Tab in Jupyter shows inspect.signature: the fields, not (**kw) (#34).
    import inspect

    params = inspect.signature(DelayedScaling).parameters
    for name in ("fp8_format", "amax_history_len", "amax_compute_algo", "margin", "saturate"):
        assert params[name].kind is inspect.Parameter.KEYWORD_ONLY
        assert params[name].default == getattr(Fp8Recipe(), name)
    assert DelayedScaling(margin=1) == Fp8Recipe(margin=1)
