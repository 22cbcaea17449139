"""convert_to_fp8's backends (#34): the choice and its reason, and torchao's emulation against ampnb's."""

from __future__ import annotations

import copy
import html
import warnings

import pytest
import torch
from torch import nn

from ampnb.fp8 import Fp8Linear, convert_to_fp8
from ampnb.fp8.linear import Role
from ampnb.fp8.scaling import amax_to_scale, tensor_to_amax


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32))


def test_a_bad_backend_name_is_one_line_listing_the_allowed_ones():
    with pytest.raises(ValueError) as err:
        convert_to_fp8(mlp(), backend="cuda")
    said = str(err.value)
    assert "backend='cuda'" in said and "'auto', 'te', 'torchao', 'ampnb'" in said
    assert "\n" not in said


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU auto may choose a real backend")
def test_auto_on_a_cpu_takes_the_emulation_and_the_report_says_why_first():
    import subprocess
    import sys

    # Choosing never imports a real backend: torchao stays unimported until it is used.
    code = ("import sys, torch; from ampnb.fp8 import convert_to_fp8; "
            "convert_to_fp8(torch.nn.Linear(32, 32)); "
            "print('torchao' in sys.modules, 'transformer_engine' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]
    f, report = convert_to_fp8(mlp())
    assert isinstance(f[0], Fp8Linear) and report.backend.name == "ampnb"
    first = repr(report).splitlines()[0]
    assert first.startswith("FP8 backend: ampnb (emulated in torch), recipe delayed") and \
        ": auto: " in first
    # Why each real one did not run.
    assert "Transformer Engine: real FP8 needs a CUDA GPU" in first and "torchao: " in first
    assert html.escape(first) in report._repr_html_()


def test_real_backends_refuse_a_cpu_in_one_line_and_emulate_is_torchao_only():
    model = mlp()
    for name in ("te", "torchao"):
        if torch.cuda.is_available():
            break
        with pytest.raises(ValueError, match=f"backend='{name}' cannot run here: .*allowed here"):
            convert_to_fp8(model, backend=name)
    with pytest.raises(ValueError, match="emulate=True only with backend='torchao'"):
        convert_to_fp8(model, backend="ampnb", emulate=True)
    with pytest.raises(ValueError, match="compile='yes'"):
        convert_to_fp8(model, compile="yes")


# --- torchao's own emulation against ampnb's: the same amax, scales, casts and outputs ----------
# Both compute amax = max|x|, scale = fp8_max / amax in float64 rounded to float32, cast
# clamp(x * scale).to(fp8), and the product (qa / sa) @ (qb / sb) in float32 (torchao's
# emulate=True mm): the same float32 operations in the same order, so in float32 the tolerance
# is zero. Only where the bias is added differs in dtype (torchao adds it in the output dtype,
# ampnb in float32 before the cast): the bf16 comparison allows one bf16 rounding of that sum.


def _torchao(layer: nn.Linear, **kw):
    torchao_float8 = pytest.importorskip("torchao.float8")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = torchao_float8.Float8LinearConfig(emulate=True)
        return torchao_float8.convert_to_float8_training(nn.Sequential(layer), config=config)[0]


@pytest.mark.parametrize("bias", [True, False])
def test_torchao_emulation_equals_ampnb_emulation_in_float32(bias):
    torch.manual_seed(1)
    base = nn.Linear(64, 32, bias=bias)
    theirs = _torchao(copy.deepcopy(base))
    ours = Fp8Linear.from_linear(copy.deepcopy(base), "tensorwise", matmul="dequantize")
    x = torch.randn(2, 8, 64) * 3
    grad = torch.randn(2, 8, 32) * 1e-3
    outs = []
    for layer in (theirs, ours):
        xi = x.clone().requires_grad_()
        y = layer(xi)
        y.backward(grad)
        outs.append((y, xi.grad, layer.weight.grad, None if layer.bias is None else layer.bias.grad))
    for a, b in zip(*outs):
        assert (a is None and b is None) or torch.equal(a, b)


def test_torchao_emulation_within_one_bf16_rounding_under_autocast():
    torch.manual_seed(2)
    base = nn.Linear(64, 32)
    theirs = _torchao(copy.deepcopy(base))
    ours = Fp8Linear.from_linear(copy.deepcopy(base), "tensorwise", matmul="dequantize")
    x = torch.randn(16, 64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        a, b = theirs(x), ours(x)
    assert a.dtype == b.dtype == torch.bfloat16
    # torchao rounds the product and the bias to bf16 and then their sum; ampnb rounds the fp32
    # sum once. Each rounding is within half a bf16 ulp (2**-8 relative) of what it rounds, so
    # the two differ by at most 2**-8 * (|product| + |bias|) * 2, however small the sum.
    product = ours(x) - base.bias.detach()  # fp32 outside autocast; the same casts
    bound = 2.0**-7 * (product.abs() + base.bias.detach().abs())
    assert ((a.float() - b.float()).abs() <= bound).all()


def test_torchao_amax_scale_and_cast_equal_ampnb_ones():
    pytest.importorskip("torchao.float8")
    from torchao.float8.float8_training_tensor import hp_tensor_and_scale_to_float8
    from torchao.float8.float8_utils import amax_to_scale as ao_scale
    from torchao.float8.float8_utils import tensor_to_amax as ao_amax

    torch.manual_seed(3)
    layer = Fp8Linear(64, 32, recipe="tensorwise")
    for role, dtype in ((Role.INPUT, torch.float8_e4m3fn), (Role.GRAD_OUTPUT, torch.float8_e5m2)):
        x = torch.randn(16, 64) * 10.0 ** (3 * role.value - 2)
        amax = ao_amax(x)
        assert torch.equal(tensor_to_amax(x), amax)
        scale = ao_scale(amax, dtype)
        assert torch.equal(amax_to_scale(amax, layer.format_of(role)), scale)
        q, s = layer.cast(role, x)
        assert torch.equal(s, scale)
        theirs = hp_tensor_and_scale_to_float8(x, scale, dtype)
        assert torch.equal(q.float(), theirs._data.float())


def test_convert_with_torchao_emulated_reports_its_own_choices():
    pytest.importorskip("torchao.float8")
    torch.manual_seed(4)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 24), nn.ReLU(),
                          nn.Linear(24, 32))
    with pytest.warns(UserWarning, match="divisible by 16"):
        f, report = convert_to_fp8(model, backend="torchao", emulate=True)
    assert type(f[0]).__name__ == "Float8Linear" and type(f[2]) is nn.Linear
    assert report.backend.name == "torchao" and not report.backend.real
    assert repr(report).startswith("FP8 backend: torchao emulated")
    assert report.converted == ("0",) and isinstance(f, nn.Sequential)  # not compiled: emulated
    f(torch.randn(4, 32)).sum().backward()
    with pytest.raises(ValueError, match="torchao scales dynamically"):
        convert_to_fp8(model, "delayed", backend="torchao", emulate=True)


def test_torch_compile_wraps_the_model_when_asked_and_by_default_only_for_real_fp8(monkeypatch):
    pytest.importorskip("torchao.float8")
    compiled = []
    monkeypatch.setattr(torch, "compile", lambda m, **kw: compiled.append(m) or m)
    convert_to_fp8(mlp(), backend="torchao", emulate=True)  # emulated: not real, not compiled
    convert_to_fp8(mlp(), backend="ampnb")
    assert compiled == []
    f, _ = convert_to_fp8(mlp(), backend="torchao", emulate=True, compile=True)
    assert compiled == [f]  # as torchao's README: convert, then torch.compile the model


def test_the_reports_first_line_names_the_recipe_that_ran():
    """recipe=None is each backend's own default: the first line says which ran, and for torchao
    why it is not the ampnb backend's default (torchao has no delayed scaling)."""
    pytest.importorskip("torchao.float8")
    from ampnb.fp8.recipe import RECIPES, Scaling

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ao, ao_report = convert_to_fp8(mlp(), backend="torchao", emulate=True)
        asked, asked_report = convert_to_fp8(mlp(), "e4m3-dynamic", backend="torchao", emulate=True)
    ours, ours_report = convert_to_fp8(mlp(), backend="ampnb")
    # what ran, read off the layers themselves
    assert "DYNAMIC" in str(ao[0].config.cast_config_input.scaling_type)
    assert ours[0].recipe == RECIPES["delayed"] and ours[0].recipe.scaling is Scaling.DELAYED
    first = repr(ao_report).splitlines()[0]
    assert "recipe tensorwise" in first and "torchao has no delayed scaling" in first
    assert html.escape(first) in ao_report._repr_html_()
    ours_first = repr(ours_report).splitlines()[0]
    assert "recipe delayed" in ours_first and "no delayed scaling" not in ours_first
    asked_first = repr(asked_report).splitlines()[0]
    assert "recipe e4m3-dynamic" in asked_first and "no delayed scaling" not in asked_first
