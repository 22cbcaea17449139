"""Block-scaled formats: records against torch.finfo, casts bit for bit against torchao's
reference casts and against blocks worked by hand."""

from __future__ import annotations

import math

import pytest
import torch

import ampnb
from ampnb.block_formats import BLOCK_FORMATS, BlockFormat, nvfp4_tensor_scale, quantize
from ampnb.formats import E8M0, FORMATS

ELEM = {"mxfp8_e4m3": torch.float8_e4m3fn, "mxfp8_e5m2": torch.float8_e5m2,
        "mxfp4": torch.float4_e2m1fn_x2}
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-identical (signed zeros distinguished), NaN equal to NaN."""
    assert a.dtype == b.dtype and a.shape == b.shape
    a, b = a.float(), b.float()
    nan = torch.isnan(a)
    return torch.equal(nan, torch.isnan(b)) and torch.equal(a[~nan].view(torch.int32),
                                                            b[~nan].view(torch.int32))


def torchao_cast(x: torch.Tensor, name: str, tensor_scale=None) -> torch.Tensor:
    """torchao's reference: fp16 runs as fp32 (torchao takes fp32/bf16), rounded once to fp16."""
    mx = pytest.importorskip("torchao.prototype.mx_formats.mx_tensor")
    nv = pytest.importorskip("torchao.prototype.mx_formats.nvfp4_tensor")
    work = x.float() if x.dtype == torch.float16 else x
    if name == "nvfp4":
        scale = None if tensor_scale is None else torch.as_tensor(tensor_scale, dtype=torch.float32)
        out = nv.NVFP4Tensor.to_nvfp4(work.contiguous(), block_size=16,
                                      per_tensor_scale=scale).dequantize(work.dtype)
    else:
        out = mx.MXTensor.to_mx(work.contiguous(), ELEM[name], block_size=32).dequantize(work.dtype)
    return out.to(x.dtype)


def cases() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    n = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    outlier = n(8, 64) * 3
    outlier[2, 5] = 1000.0
    zeros = n(4, 64)
    zeros[1] = 0.0
    zeros[3, :32] = 0.0
    wide = n(4, 64) * torch.logspace(-6, 3, 64)  # element subnormals inside the blocks
    signed_zero = n(2, 32)
    signed_zero[0, ::2] = -0.0
    return {"randn_1e-3": n(8, 64) * 1e-3, "randn_1": n(8, 64), "randn_1e3": n(8, 64) * 1e3,
            "randn_1e-20": n(4, 64) * 1e-20, "outlier": outlier, "zero_blocks": zeros,
            "wide_blocks": wide, "signed_zero": signed_zero, "saturating": n(4, 64) * 1e30,
            "all_zero": torch.zeros(2, 32)}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", list(cases()))
@pytest.mark.parametrize("name", list(BLOCK_FORMATS))
def test_quantize_is_torchaos_cast(name, case, dtype):
    x = cases()[case].to(dtype)
    if name == "nvfp4":  # ampnb's default: the two-level scale, from x's amax
        scale = nvfp4_tensor_scale(x)
        assert same(quantize(x, name), torchao_cast(x, name, scale))
        assert same(quantize(x, name, tensor_scale=1.0), torchao_cast(x, name, None))
    else:
        assert same(quantize(x, name), torchao_cast(x, name))


@pytest.mark.parametrize("name", list(BLOCK_FORMATS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_subnormal_only_blocks_match_torchao(name, dtype):
    """Blocks of the input's own subnormals (fp32 below 2**-126, bf16 alike)."""
    tiny = torch.finfo(dtype).tiny
    x = (torch.arange(1, 65, dtype=torch.float32).reshape(2, 32) * tiny / 65).to(dtype)
    assert (x.abs() < tiny).all() and (x != 0).all()
    scale = nvfp4_tensor_scale(x) if name == "nvfp4" else None
    assert same(quantize(x, name), torchao_cast(x, name, scale))


def test_mx_lowest_scale_halves_as_torchao_does():
    """torchao divides by its fp32 floor 2**-126 but multiplies back by e8m0's 2**-127: a
    block of 2**-119 (e4m3's scale would be 2**-127) comes back as 2**-120. ampnb keeps it."""
    x = torch.full((1, 32), 2.0**-119)
    assert torch.equal(quantize(x, "mxfp8_e4m3"), torch.full((1, 32), 2.0**-120))


@pytest.mark.parametrize("name", list(BLOCK_FORMATS))
def test_inf_and_nan(name):
    """NaN: its whole block is NaN. inf: MX saturates it to max x scale and flushes the rest of
    its block; NVFP4 clamps the block scale to 448, so inf becomes the tensor's finite amax
    (6 x 448 x amax/2688) and the block's other values keep that scale."""
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(1))
    x[0, 3] = math.nan
    x[2, 40] = math.inf
    q = quantize(x, name)
    b = BLOCK_FORMATS[name].block_size
    assert torch.isnan(q[0, :b]).all() and not torch.isnan(q[0, b:]).any()
    inf_block = q[2, 40 // b * b:(40 // b + 1) * b]
    others = torch.cat([inf_block[:40 % b], inf_block[40 % b + 1:]])
    if name == "nvfp4":
        finite_amax = x.nan_to_num(0.0, 0.0, 0.0).abs().amax()
        assert q[2, 40] == pytest.approx(finite_amax.item(), rel=1e-6) and (others != 0).any()
    else:
        assert q[2, 40] == math.inf and (others == 0).all()
    scale = nvfp4_tensor_scale(x) if name == "nvfp4" else None
    assert same(q, torchao_cast(x, name, scale))


@pytest.mark.parametrize("name", list(BLOCK_FORMATS))
@pytest.mark.parametrize("length", [1, 17, 40, 70])
def test_ragged_rows_are_zero_padded_blocks(name, length):
    """A row not a multiple of the block ends in a shorter block with its own scale: the
    same values torchao gives on the zero-padded row (torchao itself refuses such rows)."""
    x = torch.randn(3, length, generator=torch.Generator().manual_seed(2)) * 5
    b = BLOCK_FORMATS[name].block_size
    padded = torch.nn.functional.pad(x, (0, -length % b))
    scale = nvfp4_tensor_scale(x) if name == "nvfp4" else None
    assert same(quantize(x, name), torchao_cast(padded, name, scale)[:, :length])


@pytest.mark.parametrize("name", list(BLOCK_FORMATS))
def test_any_rank_along_the_last_dim(name):
    x = torch.randn(2, 3, 64, generator=torch.Generator().manual_seed(3))
    q = quantize(x, name)
    assert q.shape == x.shape and q.dtype == x.dtype
    assert same(q.reshape(6, 64), quantize(x.reshape(6, 64), name, **(
        {"tensor_scale": nvfp4_tensor_scale(x)} if name == "nvfp4" else {})))
    assert quantize(torch.tensor(3.0), name).shape == ()
    assert quantize(torch.empty(0, 5), name).shape == (0, 5)


def test_mxfp8_block_by_hand():
    """amax 1000: scale 2**(floor(log2 1000) - 8) = 2; 1000/2 = 500 saturates at 448 -> 896;
    1/2 -> 1; 0.01/2 = 0.005 is 2.56 steps of 2**-9 -> 3 * 2**-9 * 2; -3.3/2 -> -1.625 -> -3.25."""
    x = torch.zeros(1, 32)
    x[0, :4] = torch.tensor([1000.0, 1.0, 0.01, -3.3])
    q = quantize(x, "mxfp8_e4m3")[0, :4].tolist()
    assert q == [448 * 2, 1.0, 3 * 2.0**-9 * 2, -1.625 * 2]


def test_mxfp4_and_nvfp4_blocks_by_hand():
    """mxfp4: amax 5 -> scale 2**(2 - 2) = 1; e2m1 grid 0, .5, 1, 1.5, 2, 3, 4, 6.
    nvfp4 (tensor scale 1): amax 12 -> block scale 12/6 = 2; values / 2 onto that grid, x 2."""
    x = torch.zeros(1, 32)
    x[0, :5] = torch.tensor([5.0, 2.4, 0.2, -1.3, 0.3])
    assert quantize(x, "mxfp4")[0, :5].tolist() == [4.0, 2.0, 0.0, -1.5, 0.5]
    y = torch.zeros(1, 16)
    y[0, :4] = torch.tensor([12.0, 5.1, -0.6, 0.4])
    assert quantize(y, "nvfp4", tensor_scale=1.0)[0, :4].tolist() == [12.0, 6.0, -1.0, 0.0]
    # two levels: tensor scale amax/(448*6); the block scale 12/6/ts = 448 is exact in e4m3
    assert nvfp4_tensor_scale(y).item() == pytest.approx(12.0 / 2688)
    assert quantize(y, "nvfp4")[0, 0].item() == pytest.approx(12.0, rel=1e-6)


# --- the records ----------------------------------------------------------------------------

@pytest.mark.parametrize("name, element, scale, block", [
    ("mxfp8_e4m3", "fp8_e4m3", "e8m0", 32), ("mxfp8_e5m2", "fp8_e5m2", "e8m0", 32),
    ("mxfp4", "fp4_e2m1", "e8m0", 32), ("nvfp4", "fp4_e2m1", "fp8_e4m3", 16)])
def test_records(name, element, scale, block):
    f = ampnb.get_format(name)
    assert isinstance(f, BlockFormat) and f.block_size == block and f.axis == -1
    assert f.element is FORMATS[element] and f.scale is ampnb.get_format(scale)
    assert (f.tensor_scale is FORMATS["fp32"]) == (name == "nvfp4")
    assert f.max == f.element.max * f.scale.max
    assert f.bits_per_value == f.element.bits + 8 / block
    assert "OCP" in f.source if name != "nvfp4" else "NVIDIA" in f.source
    with pytest.raises(AttributeError):
        f.block_size = 8  # type: ignore[misc]


def test_e8m0_against_finfo():
    fi = torch.finfo(torch.float8_e8m0fnu)
    assert E8M0.torch_dtype == torch.float8_e8m0fnu and E8M0.bits == fi.bits
    assert (E8M0.max, E8M0.smallest_normal, E8M0.eps) == (fi.max, fi.smallest_normal, fi.eps)
    assert E8M0.smallest_subnormal == E8M0.smallest_normal  # no zero, no subnormals
    codes = torch.arange(255, dtype=torch.uint8).view(torch.float8_e8m0fnu).float()
    assert codes.min().item() == E8M0.smallest_normal and codes.max().item() == E8M0.max
    assert torch.isnan(torch.tensor([255], dtype=torch.uint8).view(torch.float8_e8m0fnu).float())


def test_e2m1_against_torchao_codes():
    """float4_e2m1fn_x2 is packed (no finfo): decode the 16 codes with torchao instead."""
    kernels = pytest.importorskip("torchao.prototype.mx_formats.kernels")
    values = kernels.f4_unpacked_to_f32(torch.arange(16, dtype=torch.uint8))
    f = FORMATS["fp4_e2m1"]
    pos = values[values > 0]
    assert f.max == pos.max().item() and f.smallest_subnormal == pos.min().item()
    assert f.smallest_normal == 1.0 and f.bits == 4


@pytest.mark.parametrize("bad", ["mxfp6", "nvfp8", ""])
def test_bad_names_list_the_allowed(bad):
    with pytest.raises(ValueError, match="mxfp8_e4m3, mxfp8_e5m2, mxfp4, nvfp4"):
        ampnb.get_format(bad)


def test_bad_calls():
    x = torch.randn(2, 32)
    with pytest.raises(ValueError, match="scale format"):
        quantize(x, "e8m0")
    with pytest.raises(ValueError, match="nvfp4 only"):
        quantize(x, "mxfp4", tensor_scale=2.0)
    with pytest.raises(ValueError, match="finite positive"):
        quantize(x, "nvfp4", tensor_scale=0.0)
    with pytest.raises(ValueError, match="floating-point"):
        quantize(torch.arange(4), "mxfp4")


def test_float_formats_unchanged():
    x = torch.randn(100)
    assert ampnb.get_format("bf16") is FORMATS["bf16"]
    assert torch.equal(ampnb.quantize(x, "bf16"), x.bfloat16().float())


def test_e2m1_rounding_is_quantize():
    """The fast e2m1 path inside the block casts rounds as `formats.quantize` does."""
    from ampnb.block_formats import round_elements

    v = torch.linspace(-6, 6, 200001)
    v = torch.cat([v, torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -5.0, 0.0, -0.0])])
    assert same(round_elements(v.clone(), FORMATS["fp4_e2m1"]), ampnb.quantize(v, "fp4_e2m1"))


@pytest.mark.parametrize("name, dtype", [("fp8_e4m3", torch.float8_e4m3fn),
                                         ("fp8_e5m2", torch.float8_e5m2)])
def test_element_rounding_is_torchs_fp8_cast(name, dtype):
    """round_elements on random fp32 bit patterns (every binade, subnormals, NaN) within the
    format's max, and on the ties of its smallest steps, is torch's own FP8 cast."""
    from ampnb.block_formats import round_elements

    f = FORMATS[name]
    g = torch.Generator().manual_seed(0)
    bits = torch.randint(-2**31, 2**31 - 1, (2_000_000,), generator=g, dtype=torch.int64)
    v = bits.to(torch.int32).view(torch.float32)
    v = v[~(v.abs() > f.max)]  # the casts clamp first; NaN kept
    k = torch.arange(-40, 40, dtype=torch.float32)
    ties = (k + 0.5) * f.smallest_subnormal
    v = torch.cat([v, ties, -ties, (k.abs() + 0.5) * 2.0**-3, torch.tensor([f.max, -f.max, 0.0, -0.0])])
    assert same(round_elements(v.clone(), f), v.to(dtype).float())


@pytest.mark.parametrize("name, dtype", [("fp8_e4m3", torch.float8_e4m3fn),
                                         ("fp8_e5m2", torch.float8_e5m2), ("fp4_e2m1", None)])
def test_unsigned_zero_rounding_is_the_cast_but_for_the_sign_of_zero(name, dtype):
    """round_elements(signed_zero=False) (what_if's: one pass fewer) on random finite fp32 bit
    patterns within the max and on ties: torch's FP8 cast (e2m1: quantize), except that every
    zero is +0 (what_if's figures cannot tell -0 from +0)."""
    from ampnb.block_formats import round_elements

    f = FORMATS[name]
    g = torch.Generator().manual_seed(1)
    bits = torch.randint(-2**31, 2**31 - 1, (2_000_000,), generator=g, dtype=torch.int64)
    v = bits.to(torch.int32).view(torch.float32)
    v = v[v.abs() <= f.max]  # finite: the casts clamp first
    k = torch.arange(-40, 40, dtype=torch.float32)
    ties = (k + 0.5) * f.smallest_subnormal
    v = torch.cat([v, ties, -ties, (k.abs() + 0.5) * 2.0**-3, torch.linspace(-f.max, f.max, 20001),
                   torch.tensor([f.max, -f.max, 0.0, -0.0])])
    v = v[v.abs() <= f.max]
    want = v.to(dtype).float() if dtype is not None else ampnb.quantize(v, name)
    got = round_elements(v.clone(), f, signed_zero=False)
    assert torch.equal(got, want)  # == : -0 equals +0
    assert not bool(torch.signbit(got[got == 0]).any())


@pytest.mark.parametrize("name", ["mxfp8_e4m3", "mxfp8_e5m2", "mxfp4", "nvfp4"])
def test_finite_cast_blocks_is_the_general_one(name):
    """cast_blocks(finite=True) (what_if's buffer: no inf or NaN; the clamp finds the clamped
    values, rounding by round_elements(signed_zero=False)) gives the general path's values (==:
    -0 may come back +0) and the same count of clamped values per block."""
    from ampnb.block_formats import cast_blocks, nvfp4_tensor_scale

    f = BLOCK_FORMATS[name]
    g = torch.Generator().manual_seed(2)
    x = torch.randn(300, 64, generator=g) * torch.logspace(-30, 30, 64)
    x[::7, 5] = 0.0
    x[3] = 1e-41  # fp32 subnormals: the halved-block case of the MX reference
    blocks = x.view(300, -1, f.block_size)
    amax = blocks.abs().amax(-1, keepdim=True)
    scale = None if f.tensor_scale is None else nvfp4_tensor_scale(x, f)
    ones = torch.ones(f.block_size)

    def per_block(mask):
        return torch.matmul(mask, ones)

    want, want_over = cast_blocks(blocks, f, amax, scale, count=per_block)
    work = torch.empty_like(blocks)
    got, over = cast_blocks(blocks, f, amax, scale, torch.empty_like(blocks),
                            (work, work.view(torch.int32)), per_block, finite=True)
    assert torch.equal(got, want) and int(over.sum()) > 0  # some values were clamped
    assert torch.equal(over, want_over)


def test_nvfp4_smallest_nonzero_is_what_the_cast_reaches():
    """2^-7 = e2m1's 0.5 times e4m3's smallest normal scale 2^-6 (torchao's clamp): kept; half
    of it is a tie to zero; checked against torchao's cast too."""
    f = BLOCK_FORMATS["nvfp4"]
    x = torch.zeros(1, 16)
    x[0, :2] = torch.tensor([f.smallest_subnormal, f.smallest_subnormal / 2])
    q = quantize(x, "nvfp4", tensor_scale=1.0)
    assert q[0, :2].tolist() == [f.smallest_subnormal, 0.0]
    assert same(q, torchao_cast(x, "nvfp4", None))


def test_block_format_table():
    from ampnb.block_formats import block_format_table

    t = block_format_table()
    assert [r[0] for r in t.rows] == list(BLOCK_FORMATS) and "OCP" in t.notes[0]
    assert "2^-136" in repr(t)  # mxfp8_e4m3: e4m3's 2^-9 times e8m0's 2^-127
