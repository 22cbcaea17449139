"""what_if's batched statistics (many tensors rounded in one pass per format) against the same
figures computed tensor by tensor from trusted casts: torch's fp16/bf16/fp8 casts, torchao's
FP8 scales, and `quantize_blocks` (bit for bit torchao's MX/NVFP4 casts, tests/test_block_formats)."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import ampnb
from ampnb.block_formats import BLOCK_FORMATS, quantize_blocks
from ampnb.formats import FORMATS
from ampnb.whatif import DEFAULT_FORMATS, run
from ampnb.whatif.result import sqnr_db

torchao_utils = pytest.importorskip("torchao.float8.float8_utils")
E4M3 = FORMATS["fp8_e4m3"]


def past_max(scaled: torch.Tensor, fmt) -> int:
    """Finite values that round past the format's max (to inf, or clamped)."""
    a = scaled.abs()
    over = a >= fmt.overflow_threshold if fmt.overflow_inclusive else a > fmt.overflow_threshold
    return int((over & (a != math.inf)).sum())


def reference_cast(x: torch.Tensor, name: str) -> tuple[torch.Tensor, int]:
    """(x rounded into `name`, how many values overflowed or saturated), one tensor at a time."""
    if name in ("fp16", "bf16"):
        return x.to(FORMATS[name].torch_dtype).float(), past_max(x, FORMATS[name])
    if name in BLOCK_FORMATS:
        q, clamped = quantize_blocks(x, BLOCK_FORMATS[name])
        return q, int(clamped.sum())
    rowwise = name == "fp8_e4m3_rowwise"
    amax = x.abs().amax(-1, keepdim=True) if rowwise else x.abs().amax()
    scale = torchao_utils.amax_to_scale(amax, torch.float8_e4m3fn,
                                        round_scales_to_power_of_2=rowwise)
    scaled = x * scale
    q = scaled.clamp(-E4M3.max, E4M3.max).to(torch.float8_e4m3fn).float() / scale
    return q, 0 if bool(torch.isfinite(x.abs().amax())) else past_max(scaled, E4M3)


def reference_rows(seen: dict[tuple[str, str], list[torch.Tensor]], names) -> dict:
    """(module, tensor, format) -> (sqnr_db, underflow, overflow, numel), summed over calls."""
    out = {}
    for (module, tensor), xs in seen.items():
        for name in names:
            noise = signal = flushed = over = n = 0
            for x in xs:
                q, o = reference_cast(x, name)
                # In float64 and in one sum, where what_if sums fp32 blocks: the summation order
                # differs, hence the tolerance on sqnr_db below (and only there).
                noise += float(((q.double() - x.double()) ** 2).sum())
                signal += float((x.double() ** 2).sum())
                flushed += int((x != 0).sum()) - int((q != 0).sum())
                over, n = over + o, n + x.numel()
            out[(module, tensor, name)] = (sqnr_db(signal, noise), flushed / n, over / n, n)
    return out


def capture(model: nn.Module, step) -> dict[tuple[str, str], list[torch.Tensor]]:
    """Every layer's weight, input and output gradient of one step, as what_if sees them."""
    seen: dict[tuple[str, str], list[torch.Tensor]] = {}
    handles = []

    def keep(key, m, t, kind):
        seen.setdefault(key, []).append(run.as_rows(m, t, kind).clone())

    for name, m in model.named_modules():
        if run.is_layer(m):
            def hook(m, args, out, name=name):
                keep((name, "weight"), m, m.weight, "weight")
                keep((name, "input"), m, args[0], "input")
                if out.requires_grad:
                    out.register_hook(lambda g: keep((name, "grad_output"), m, g, "grad"))
            handles.append(m.register_forward_hook(hook))
    step()
    for h in handles:
        h.remove()
    model.zero_grad(set_to_none=True)
    return seen


class Ragged(nn.Module):
    """Rows of 27, 3, 20, 40 and 24 (no multiple of 16 or 32 but one), a Conv2d, a reused layer,
    an outlier, an all-zero weight on a side branch (its gradient is not zero), and Conv1D."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.Conv2d(3, 20, 3)
        self.fc1 = nn.Linear(20, 40)
        try:
            from transformers.pytorch_utils import Conv1D
            self.mid = Conv1D(24, 40)
        except ImportError:
            self.mid = nn.Linear(40, 24)
        self.fc2 = nn.Linear(24, 24)
        self.zero = nn.Linear(40, 24)
        with torch.no_grad():
            self.fc1.weight[3, 7] = 300.0
            self.zero.weight.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = nn.functional.gelu(self.fc1(self.conv(x).permute(0, 2, 3, 1)))
        return self.fc2(self.fc2(self.mid(h))) + self.zero(h)


def assert_same_rows(result, expected) -> None:
    assert len(result.rows) == len(expected)
    for r in result.rows:
        sqnr, under, over, n = expected[(r.module, r.tensor, r.format)]
        where = (r.module, r.tensor, r.format)
        assert (r.underflow, r.overflow, r.numel) == (under, over, n), where
        if math.isfinite(sqnr):
            assert r.sqnr_db == pytest.approx(sqnr, abs=1e-4), where
        else:
            assert r.sqnr_db == sqnr or (math.isnan(r.sqnr_db) and math.isnan(sqnr)), where


def test_batched_rows_are_the_per_tensor_figures():
    model = Ragged()
    x, y = torch.randn(2, 3, 8, 8) * 2, torch.randn(2, 6, 6, 24)
    seen = capture(model, lambda: nn.functional.mse_loss(model(x), y).backward())
    assert {k[1] for k in seen} == {"weight", "input", "grad_output"} and len(seen["fc2", "input"]) == 2
    result = ampnb.what_if(model, (x, y), nn.functional.mse_loss)
    assert_same_rows(result, reference_rows(seen, DEFAULT_FORMATS))


@pytest.mark.parametrize("bound", [None, 1])
def test_inf_nan_zero_and_tiny_tensors(bound, monkeypatch):
    """NaN and inf in weights and inputs, an all-zero input row, values that flush, fp16 overflow;
    also with every tensor split row by row (the tensor's amax must still be the whole one's)."""
    if bound is not None:
        monkeypatch.setattr(run, "FLUSH_ELEMENTS", bound)
    torch.manual_seed(1)
    layer = nn.Linear(40, 24)
    with torch.no_grad():
        layer.weight[0, 5] = math.nan
        layer.weight[1, 33] = math.inf
        layer.weight[2, :] = 1e-30
        layer.weight[3, 0] = 1e5
    x = torch.randn(5, 40)
    x[0, 3], x[1] = -math.inf, 0.0
    names = (*DEFAULT_FORMATS, "mxfp8_e5m2")
    seen = capture(layer, lambda: layer(x))
    assert_same_rows(ampnb.what_if(layer, x, formats=names), reference_rows(seen, names))


def test_flush_bound_changes_no_figure(monkeypatch):
    """Everything flushed slice by slice (a bound of 1 element: tensors split along their first
    axis, each piece alone) or all at the end: same rows."""
    model = Ragged()
    x, y = torch.randn(2, 3, 8, 8), torch.randn(2, 6, 6, 24)
    rows = []
    for bound in (1, 2**40):
        monkeypatch.setattr(run, "FLUSH_ELEMENTS", bound)
        rows.append(ampnb.what_if(model, (x, y), nn.functional.mse_loss).rows)
    # Exact but for the SQNR: BLAS may sum a block's 32 fp32 squares in another order for
    # another number of blocks (and a split tensor's pieces add in float64).
    assert [(r.module, r.tensor, r.format, r.underflow, r.overflow, r.numel) for r in rows[0]] == [
        (r.module, r.tensor, r.format, r.underflow, r.overflow, r.numel) for r in rows[1]]
    assert [r.sqnr_db for r in rows[0]] == pytest.approx([r.sqnr_db for r in rows[1]], abs=1e-5)
