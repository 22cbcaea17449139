"""transformer-engine modes: emulated FP8 on any device, real with Transformer Engine on Hopper."""

from __future__ import annotations

import copy
import importlib.util
import warnings

import pytest
import torch
from torch import nn

from ampnb import get_mode
from ampnb.fp8 import Fp8Linear, te_status
from ampnb.fp8.autocast import fp8_active
from ampnb.putback_state import torch_state as snapshot

TE_MODES = {"transformer-engine": torch.bfloat16, "transformer-engine-float16": torch.float16}
HAS_TE = torch.cuda.is_available() and importlib.util.find_spec("transformer_engine") is not None


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16), nn.Linear(16, 3))


def convert(mode, m):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return mode.convert_module(m)


@pytest.mark.parametrize("name", list(TE_MODES))
def test_available_everywhere_and_says_emulated_or_real(name):
    found = get_mode(name).availability("cpu")
    assert found.ok and found.reason.startswith("emulated: ")
    assert found.reason.removeprefix("emulated: ") == te_status("cpu").reason
    get_mode(name).check("cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message without CUDA")
def test_cuda_without_cuda_names_what_runs_instead():
    found = get_mode("transformer-engine").availability("cuda")
    assert not found.ok and "CUDA" in found.reason and found.fallback == "cpu"


@pytest.mark.parametrize(("name", "dtype"), list(TE_MODES.items()))
def test_convert_module_swaps_aligned_linears_and_casts_like_lightning(name, dtype):
    mode = get_mode(name)
    with pytest.warns(UserWarning, match=r"'3' \(Linear 16→3: out_features 3 is not a multiple of 16\)"):
        m = mode.convert_module(model())
    assert [type(c).__name__ for c in m] == ["Fp8Linear", "GELU", "Fp8Linear", "Linear"]
    assert {p.dtype for p in m.parameters()} == {dtype}
    assert all(c.enabled is None for c in m if isinstance(c, Fp8Linear))


@pytest.mark.parametrize(("name", "dtype"), list(TE_MODES.items()))
def test_forward_equals_a_hand_written_fp8_autocast_and_restores_state(name, dtype):
    from ampnb.fp8 import convert_to_fp8, fp8_autocast
    from ampnb.modes import default_dtype

    mode = get_mode(name)
    x = torch.randn(4, 16)
    m = convert(mode, model())
    ref = model()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref, _ = convert_to_fp8(ref, inplace=True, enabled=None)
    ref = ref.to(dtype)
    before = snapshot()
    with mode.forward_context("cpu"):
        assert fp8_active() and torch.get_default_dtype() == dtype
        y = m(mode.convert_input(x))
    with default_dtype(dtype), torch.autocast("cpu", dtype=dtype), fp8_autocast():
        expected = ref(x.to(dtype))
    assert snapshot() == before and not fp8_active()
    assert y.dtype == dtype and torch.equal(y, expected)
    with pytest.raises(RuntimeError, match="boom"), mode.forward_context("cpu"):
        raise RuntimeError("boom")
    assert snapshot() == before and not fp8_active()


def test_a_model_fp8_cannot_take_warns_and_still_runs_in_the_weight_dtype():
    mode = get_mode("transformer-engine")
    with pytest.warns(UserWarning, match="no layer runs in FP8"):
        m = mode.convert_module(nn.Linear(4, 3))
    with mode.forward_context("cpu"):
        assert m(mode.convert_input(torch.randn(2, 4))).dtype == torch.bfloat16


def test_workbench_round_trip_through_fp8_is_lossless():
    from ampnb.workbench import PrecisionLossWarning, Workbench

    torch.manual_seed(1)
    net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16))
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    batches = [(torch.randn(8, 16), torch.randn(8, 16)) for _ in range(2)]
    wb = Workbench(net, opt, nn.functional.mse_loss, batches)
    start = {k: v.clone() for k, v in wb.model.state_dict().items()}
    ref = copy.deepcopy(wb.model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PrecisionLossWarning)
        wb.set(mode="transformer-engine")
        assert isinstance(wb.model[0], Fp8Linear) and wb.param_dtype == torch.bfloat16
        loss = wb.step().loss
        wb.restore()
    assert all(torch.equal(v, start[k]) for k, v in wb.model.state_dict().items())
    assert torch.isfinite(torch.tensor(loss))
    # Left-over FP8 layers compute exactly like nn.Linear outside the FP8 mode.
    x = torch.randn(3, 16)
    assert torch.equal(wb.model(x), ref(x))


@pytest.mark.skipif(not HAS_TE, reason="needs Transformer Engine and a CUDA GPU")
def test_real_transformer_engine_path_swaps_te_layers():  # pragma: no cover - Hopper only
    if not te_status("cuda").ok:
        pytest.skip(te_status("cuda").reason)
    mode = get_mode("transformer-engine")
    assert mode.availability("cuda").reason.startswith("real (")
    m = convert(mode, model().cuda())
    assert "transformer_engine" in type(m[0]).__module__
    with mode.forward_context("cuda"):
        y = m(mode.convert_input(torch.randn(16, 16, device="cuda")))
    assert y.shape == (16, 3) and torch.isfinite(y.float()).all()


def test_te_status_never_imports_transformer_engine():
    import sys

    status = te_status("cpu")
    assert not status.ok and "compute capability >= 8.9" in status.reason
    assert "transformer_engine" not in sys.modules or HAS_TE


def test_forward_context_changes_nothing_until_entered():
    before = snapshot()
    ctx = get_mode("transformer-engine").forward_context("cpu")
    assert snapshot() == before and not fp8_active()
    with ctx:
        assert fp8_active()
    assert snapshot() == before


def test_fp8_never_imports_the_modes_module():
    import subprocess
    import sys

    code = ("import sys, pkgutil, importlib, torch, ampnb.fp8 as f\n"
            "for m in pkgutil.iter_modules(f.__path__):\n"
            "    importlib.import_module('ampnb.fp8.' + m.name)\n"
            "from ampnb.fp8.autocast import emulated_fp8_context\n"
            "with emulated_fp8_context('cpu', torch.bfloat16): pass\n"
            "assert 'ampnb.modes' not in sys.modules, 'ampnb.modes imported'\n")
    subprocess.run([sys.executable, "-c", code], check=True)
