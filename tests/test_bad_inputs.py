"""Bad input gets one line naming the bad value and what is allowed, and changes nothing; where
torch rejects what the doctor was given, torch's error stays as the cause of that line; the
user's own exceptions reach the user as they are."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import ampnb
from ampnb import apex, lowbit
from ampnb.legacy import explain_precision
from ampnb.modes import get_mode
from ampnb.putback_state import torch_state as snapshot
from ampnb.selective import keep_fp32

MSE = nn.functional.mse_loss
FAST = dict(modes="32-true", repeat=1, profile=False)


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def _big() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 64))


class IntOut(nn.Module):
    """An integer output (argmax): no gradient reaches a loss made from it."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x).argmax(-1)


class Emb(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 4)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.emb(ids).sum()


def _xy() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(3, 4, generator=g), torch.randn(3, 2, generator=g)


def _enter(cm):
    with cm:
        pass


# (name, model factory or None, call(model), fragment of the message)
CASES = [
    ("keep_fp32 entry not a string", _mlp, lambda m: _enter(keep_fp32(m, ["0", 5])), "['0', 5]"),
    ("keep_fp32 patterns=None", _mlp, lambda m: _enter(keep_fp32(m, None)), "got None"),
    ("keep_fp32 patterns=123", _mlp, lambda m: _enter(keep_fp32(m, 123)), "got 123"),
    ("half_except_batchnorm(None)", None, lambda m: apex.half_except_batchnorm(None), "got None"),
    ("master_step('x')", None, lambda m: apex.master_step("x"), "got 'x'"),
    ("apex-O2 convert_module(None)", None, lambda m: get_mode("apex-O2").convert_module(None),
     "got None"),
    ("param_groups(None)", None, lambda m: lowbit.param_groups(None), "NoneType"),
    ("param_groups keep_32bit=5", _mlp, lambda m: lowbit.param_groups(m, 5), "keep_32bit=5"),
    ("quantize_blockwise blocksize 0", None,
     lambda m: lowbit.quantize_blockwise(torch.randn(10), lowbit.dynamic_map(), 0), "blocksize=0"),
    ("quantize_model (inputs, targets)", _big,
     lambda m: lowbit.quantize_model(m, "nf4", inputs=(torch.randn(2, 64), torch.randn(2, 64))),
     "inputs=(float32[2, 64], float32[2, 64])"),
    ("quantize_model ignore_modules=5", _big,
     lambda m: lowbit.quantize_model(m, "nf4", ignore_modules=5), "ignore_modules=5"),
    ("quantize_model bare layer inplace", lambda: nn.Linear(64, 64),
     lambda m: lowbit.quantize_model(m, "nf4", inplace=True), "bare Linear"),
    ("Adam8bit lr='x'", _mlp, lambda m: lowbit.Adam8bit(m.parameters(), lr="x"), "lr='x'"),
    ("Adam8bit weight_decay=-1", _mlp, lambda m: lowbit.Adam8bit(m.parameters(), weight_decay=-1),
     "weight_decay=-1"),
    ("explain_precision amp_backend list", None, lambda m: explain_precision(amp_backend=["apex"]),
     "amp_backend=['apex']"),
    ("explain_precision precision='foo-bar'", None,
     lambda m: explain_precision(precision="foo-bar"), "precision='foo-bar'"),
    ("doctor modes=123", _mlp, lambda m: ampnb.doctor(m, _xy(), MSE, modes=123), "modes=123"),
    ("doctor seed='x'", _mlp, lambda m: ampnb.doctor(m, _xy(), MSE, seed="x"), "seed='x'"),
    ("doctor progress='x'", _mlp, lambda m: ampnb.doctor(m, _xy(), MSE, progress="x"),
     "progress='x'"),
    ("doctor loss_fn='mse'", _mlp, lambda m: ampnb.doctor(m, _xy(), "mse"), "loss_fn='mse'"),
    ("doctor repeat=True", _mlp, lambda m: ampnb.doctor(m, _xy(), MSE, repeat=True), "repeat=True"),
    ("doctor repeat=10**9", _mlp, lambda m: ampnb.doctor(m, _xy(), MSE, repeat=10**9),
     "repeat=1000000000"),
    ("doctor device=''", _mlp, lambda m: ampnb.doctor(m, _xy(), MSE, device=""), "device=''"),
    ("profile_step modes=123", _mlp,
     lambda m: ampnb.diagnosis.profile_step(m, _xy(), MSE, modes=123), "modes=123"),
]


@pytest.mark.parametrize("factory, call, words", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_is_one_line_naming_what_is_allowed(factory, call, words):
    model = factory() if factory else None
    before = copy.deepcopy(model.state_dict()) if model is not None else None
    state = snapshot()
    with pytest.raises(ValueError) as e:
        call(model)
    text = str(e.value)
    assert "\n" not in text and words in text and "allowed" in text, text
    assert snapshot() == state
    if model is not None:
        after = model.state_dict()
        assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)


# The doctor's reference step on what torch rejects: (name, model, batch, loss_fn, words).
TORCH_REJECTS = [
    ("non-scalar loss", _mlp, _xy, lambda o, t: MSE(o, t, reduction="none"),
     "the loss was float32[3, 2]"),
    ("batch that does not fit", _mlp, lambda: (torch.randn(3, 5), torch.randn(3, 2)), MSE,
     "Sequential(float32[3, 5])"),
    ("float ids into an embedding", Emb, lambda: torch.randn(3, 4), None, "Emb(float32[3, 4])"),
    ("integer-output model", IntOut, lambda: (torch.randn(3, 4), torch.zeros(3)),
     lambda o, t: o.float().mean(), "without a gradient"),
    ("targets that do not fit the output", _mlp, lambda: (torch.randn(3, 4), torch.zeros(5, dtype=torch.long)),
     nn.functional.cross_entropy, "loss_fn(float32[3, 2], int64[5])"),
]


@pytest.mark.parametrize("run", ["doctor", "profile_step"])
@pytest.mark.parametrize("factory, batch, loss_fn, words", [c[1:] for c in TORCH_REJECTS],
                         ids=[c[0] for c in TORCH_REJECTS])
def test_what_torch_rejects_keeps_torch_error_and_says_what_was_expected(run, factory, batch,
                                                                        loss_fn, words):
    model = factory()
    before = copy.deepcopy(model.state_dict())
    state = snapshot()
    call = ampnb.doctor if run == "doctor" else ampnb.diagnosis.profile_step
    kwargs = FAST if run == "doctor" else dict(modes="32-true")
    with pytest.raises(ValueError) as e:
        call(model, batch(), loss_fn, **kwargs)
    text, cause = str(e.value), e.value.__cause__
    assert "\n" not in text and words in text and "allowed" in text, text
    assert isinstance(cause, (RuntimeError, TypeError, IndexError, ValueError))  # torch's own
    assert str(cause).splitlines()[0][:60] in text  # torch's message kept in the line
    assert snapshot() == state
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


class Mine(Exception):
    pass


class Raises(nn.Module):
    def __init__(self, error: BaseException) -> None:
        super().__init__()
        self.lin, self.error = nn.Linear(4, 2), error

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise self.error


def _as_it_is(found: BaseException, error: BaseException) -> bool:
    # The doctor runs a deep copy of the model, so the copy's error is raised: same type and text.
    return type(found) is type(error) and str(found) == str(error) and found.__cause__ is None


@pytest.mark.parametrize("error", [Mine("mine"), RuntimeError("my own check failed")])
def test_the_users_own_exception_reaches_the_user_as_it_is(error):
    with pytest.raises(type(error)) as e:
        ampnb.doctor(Raises(error), _xy(), MSE, **FAST)
    assert _as_it_is(e.value, error)

    def loss_fn(out, y):
        raise error

    with pytest.raises(type(error)) as e:
        ampnb.doctor(_mlp(), _xy(), loss_fn, **FAST)
    assert e.value is error
    with pytest.raises(type(error)) as e:
        lowbit.quantize_model(nn.Sequential(Raises(error), nn.Linear(2, 2)), "nf4",
                              inputs=torch.randn(3, 4))
    assert _as_it_is(e.value, error)


def test_quantize_model_takes_a_bare_layer():
    layer = nn.Linear(64, 64)
    before = copy.deepcopy(layer.state_dict())
    x = torch.randn(2, 64)
    q, report = lowbit.quantize_model(layer, "nf4", inputs=x)
    assert isinstance(q, lowbit.Linear4bit) and isinstance(layer, nn.Linear)
    assert [e.name for e in report.layers] == ["(model)"] and report.layers[0].output_sqnr_db > 10
    assert q(x).shape == (2, 64)
    assert all(torch.equal(before[k], v) for k, v in layer.state_dict().items())


@pytest.mark.parametrize("fmt, where", [("nf4", "block of 64"), ("int8", "row")])
def test_roundtrip_of_inf_weights_says_so(fmt, where):
    w = torch.randn(4, 128)
    w[1, 3] = float("inf")
    with pytest.warns(RuntimeWarning, match=f"1 inf/NaN.*each {where}"):
        out = lowbit.roundtrip(w, fmt)
    assert not torch.isfinite(out).all()


def test_the_magic_profile_of_an_integer_output_model_is_one_usage_error():
    pytest.importorskip("IPython")
    from IPython.core.error import UsageError
    from IPython.core.interactiveshell import InteractiveShell

    from ampnb.magics.doctor import doctor_cell, profile_cell

    shell = InteractiveShell.instance()
    model, (x, _) = IntOut(), _xy()
    before = copy.deepcopy(model.state_dict())
    shell.user_ns.update(model=model, x=x)
    try:
        for run in (profile_cell, doctor_cell):
            with pytest.raises(UsageError) as e:
                run(shell, "model(x).float().mean()", modes=("32-true",))
            text = str(e.value)
            assert "\n" not in text and "without a gradient" in text and "allowed" in text, text
        # the cell's own code failing in torch is the user's error, as it is
        with pytest.raises(RuntimeError, match="shapes cannot be multiplied"):
            doctor_cell(shell, "model(x[:, :3]).float().mean()", modes=("32-true",))
    finally:
        shell.user_ns.pop("model", None)
        shell.user_ns.pop("x", None)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


@pytest.mark.parametrize("name", ["32-true", "16-mixed", "bf16-mixed", "16-true", "bf16-true",
                                  "64-true", "transformer-engine", "apex-O1", "apex-O3"])
def test_every_modes_convert_module_refuses_what_is_not_a_module(name):
    from ampnb.modes import get_mode

    with pytest.raises(ValueError, match="allowed: an nn.Module") as e:
        get_mode(name).convert_module(None)
    assert "\n" not in str(e.value)


def test_fp16_kernel_switches_refuse_what_they_would_misread():
    from ampnb.fp16_kernels import emulated_fp16_kernels, fp16_kernels_choice, set_fp16_kernels

    before = fp16_kernels_choice()
    with pytest.raises(ValueError, match=r"set_fp16_kernels\(None\) is not allowed; allowed: "):
        set_fp16_kernels(None)
    with pytest.raises(ValueError, match="enabled='no' is not allowed; allowed: True or False"):
        emulated_fp16_kernels("no")
    assert fp16_kernels_choice() == before
