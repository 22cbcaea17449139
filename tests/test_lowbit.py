"""Weight-only low-bit formats: code books, block-wise absmax quantization, bits per parameter."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from ampnb.fp8 import (
    LOWBIT_FORMATS,
    get_lowbit,
    nf4_codebook,
    quantize_model,
    quantize_weight,
    sqnr,
)
from ampnb.fp8 import roundtrip as lowbit_roundtrip
from ampnb.lowbit import fp4_codebook, int8_codebook

# bitsandbytes' published NF4 table (functional.py, `get_4bit_type("nf4")`), the QLoRA paper's
# Appendix E: the trusted reference the derived code book must reproduce.
PUBLISHED_NF4 = [
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
    -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
    0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
    0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0,
]


def test_nf4_code_book_from_normal_quantiles_equals_the_published_values():
    book = nf4_codebook()
    assert book.dtype == torch.float32 and book.numel() == 16
    assert torch.equal(book, torch.tensor(PUBLISHED_NF4))
    # An exact zero, and 8 positive vs 7 negative codes: NF4 is asymmetric.
    assert (book > 0).sum() == 8 and (book < 0).sum() == 7 and (book == 0).sum() == 1


# bitsandbytes' published FP4 table (functional.py `get_4bit_type("fp4")`), by 4-bit code.
PUBLISHED_FP4 = [0, 0.0625, 8.0, 12.0, 4.0, 6.0, 2.0, 3.0, -0.0, -0.0625, -8.0, -12.0, -4.0, -6.0, -2.0, -3.0]


def test_fp4_code_book_is_bitsandbytes_table_in_code_order():
    assert torch.equal(fp4_codebook(), torch.tensor(PUBLISHED_FP4) / 12)


def test_bitsandbytes_fp4_is_the_ocp_e2m1_grid_but_for_its_subnormal():
    # OCP MX spec: E2M1, bias 1, no inf/NaN; subnormals 0 and 0.5 (max 6).
    ocp = {s * (m / 2 if e == 0 else (1 + m / 2) * 2.0 ** (e - 1))
           for s in (1, -1) for e in range(4) for m in range(2)}
    ocp_grid = sorted(v / max(ocp) for v in ocp)
    bnb_grid = sorted(set(fp4_codebook().tolist()))
    differ = [(o, b) for o, b in zip(ocp_grid, bnb_grid, strict=True) if o != pytest.approx(b, abs=1e-7)]
    assert differ == [(-1 / 12, pytest.approx(-0.0625 / 12)), (1 / 12, pytest.approx(0.0625 / 12))]


def test_int8_code_book_is_symmetric_absmax():
    assert torch.equal(int8_codebook() * 127, torch.arange(-127, 128).float())


def brute_force(w: torch.Tensor, book: torch.Tensor, blocksize: int) -> torch.Tensor:
    """bitsandbytes' reference quantize_4bit: x * (1/absmax), clamp, argmin over the code book."""
    flat = w.reshape(-1).float()
    flat = torch.cat([flat, flat.new_zeros((-flat.numel()) % blocksize)])
    blocks = flat.reshape(-1, blocksize)
    absmax = blocks.abs().amax(1, keepdim=True)
    scaled = torch.clamp(blocks * (1 / absmax), -1, 1)
    idx = (scaled[..., None] - book).abs().argmin(-1)
    return (book[idx] * absmax).reshape(-1)[: w.numel()].reshape(w.shape)


@pytest.mark.parametrize("name", ["nf4", "fp4"])
@pytest.mark.parametrize("shape", [(32, 64), (48, 80)])  # the second is not a block multiple
def test_block_quantization_picks_the_nearest_code_of_each_block(name, shape):
    w = torch.randn(*shape, generator=torch.Generator().manual_seed(0))
    fmt = get_lowbit(name)
    assert torch.equal(lowbit_roundtrip(w, name), brute_force(w, fmt.codebook(), fmt.blocksize))
    q = quantize_weight(w, name)
    assert q.codes.dtype == torch.uint8 and int(q.codes.max()) < fmt.codebook().numel()
    assert q.absmax.numel() == fmt.n_blocks(w.shape) == math.ceil(w.numel() / 64)


def test_int8_uses_one_scale_per_output_row():
    w = torch.randn(8, 40, generator=torch.Generator().manual_seed(1))
    absmax = w.abs().amax(1, keepdim=True)
    expected = torch.round(w / absmax * 127) / 127 * absmax
    torch.testing.assert_close(lowbit_roundtrip(w, "int8"), expected, rtol=0, atol=1e-6)


def test_qlora_bits_per_parameter():
    shape = (4096, 4096)
    nf4, dq = get_lowbit("nf4").bits_per_param(shape), get_lowbit("nf4-dq").bits_per_param(shape)
    # QLoRA §2: an fp32 absmax per 64 weights costs 32/64 = 0.5 bits; double quantization
    # brings it to 8/64 + 32/(64*256) = 0.127 bits (plus one fp32 offset per tensor here).
    assert nf4 == 4 + 32 / 64
    assert dq == pytest.approx(4 + 8 / 64 + 32 / (64 * 256) + 32 / math.prod(shape), rel=1e-12)
    assert round(dq - 4, 3) == 0.127
    assert get_lowbit("int8").bits_per_param(shape) == 8 + 32 / 4096


@pytest.mark.parametrize("name", [n for n, f in LOWBIT_FORMATS.items() if f.weight_bits is None])
def test_bits_per_param_counts_what_is_stored(name):
    w = torch.randn(48, 80, generator=torch.Generator().manual_seed(2))  # not a block multiple
    q = quantize_weight(w, name)
    stored = q.codes.numel() * q.fmt.code_bits  # 4-bit codes pack two to a byte
    if q.dq is None:
        stored += 32 * q.absmax.numel()
    else:
        stored += 8 * q.dq.codes.numel() + 32 * q.dq.absmax2.numel() + 32 * q.dq.offset.numel()
    assert q.bits_per_param == stored / w.numel()
    assert q.dequantize().shape == w.shape and q.dequantize().dtype == w.dtype


def test_more_bits_means_less_error():
    w = torch.randn(64, 128, generator=torch.Generator().manual_seed(4))
    errors = {n: sqnr(w, lowbit_roundtrip(w, n)) for n in LOWBIT_FORMATS}
    assert errors["int8"] > errors["nf4"] > errors["fp4"]  # NF4 fits normal weights best
    assert errors["int8-training"] == errors["int8"]  # the same int8 rounding, made per forward
    assert abs(errors["nf4-dq"] - errors["nf4"]) < 0.5 and abs(errors["fp4-dq"] - errors["fp4"]) < 0.5


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 64)
        self.body = nn.Linear(64, 64)
        self.head = nn.Linear(64, 10, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids):
        return self.head(torch.relu(self.body(self.emb(ids))))


def test_quantize_model_reports_each_layer_and_leaves_the_original():
    torch.manual_seed(5)
    model = Tied()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ids = torch.randint(0, 10, (4, 8))
    q, report = quantize_model(model, "nf4", inputs=ids)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert [e.name for e in report.layers] == ["body", "head"]
    for e in report.layers:
        w = model.get_submodule(e.name).weight.detach()
        # Lightning quantizes weight.half(); dequantized to fp16, then to the bf16 compute dtype.
        used = lowbit_roundtrip(w.half(), "nf4").to(torch.bfloat16)
        assert e.weight_sqnr_db == sqnr(w, used.float())
        assert torch.equal(q.get_submodule(e.name).weight, used)
        assert e.output_sqnr_db is not None and e.output_sqnr_db < float("inf")
    assert report.fp32_bytes == 4 * (64 * 64 + 10 * 64)
    assert "nf4" in repr(report) and "bits/param" in report._repr_html_()


def test_bad_formats_and_models_are_one_line_errors():
    with pytest.raises(ValueError, match="'nf3'.*allowed: nf4, nf4-dq, fp4, fp4-dq, int8, int8-training$"):
        get_lowbit("nf3")
    model = nn.Sequential(nn.ReLU())
    with pytest.raises(ValueError, match="no Linear or Conv1D layers"):
        quantize_model(model, "nf4")


def test_quantize_model_docstring_states_what_it_returns_and_takes():
    from ampnb.lowbit import quantize_model as qm

    for said in ("(model, report)", "inplace=False", "inplace=True", "use_bitsandbytes"):
        assert said in qm.__doc__
