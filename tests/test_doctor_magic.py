"""`%%amp --doctor` / `--profile` functions on a cell's step, with a real IPython shell."""

from __future__ import annotations

import pytest
import torch
from doctor_models import ForwardOverflow, data
from torch import nn

import ampnb

IPython = pytest.importorskip("IPython")
from IPython.core.error import UsageError  # noqa: E402
from IPython.core.interactiveshell import InteractiveShell  # noqa: E402

from ampnb.magics.doctor import doctor_cell, profile_cell  # noqa: E402

FAST = dict(modes=("32-true", "16-mixed"), repeat=1, profile=False)


@pytest.fixture()
def ip():
    shell = InteractiveShell.instance()
    x, y = data()
    model = ForwardOverflow()
    shell.user_ns.update(model=model, x=x, y=y, CE=nn.functional.cross_entropy,
                         opt=torch.optim.SGD(model.parameters(), lr=0.1))
    yield shell
    for k in ("model", "x", "y", "CE", "opt", "loss"):
        shell.user_ns.pop(k, None)


def test_cell_doctor_matches_the_batch_doctor(ip):
    before = {k: v.clone() for k, v in ip.user_ns["model"].state_dict().items()}
    cell = doctor_cell(ip, "out = model(x)\nCE(out, y)", **FAST)
    batch = ampnb.doctor(ip.user_ns["model"], (ip.user_ns["x"], ip.user_ns["y"]),
                         nn.functional.cross_entropy, optimizer=ip.user_ns["opt"], **FAST)
    for a, b in zip(cell.modes, batch.modes):
        assert (a.label, a.finite) == (b.label, b.finite)
        assert a.loss == b.loss or (a.loss != a.loss and b.loss != b.loss)  # equal, or both NaN
    assert cell.low_precision.keep_fp32 == ("up",)
    after = ip.user_ns["model"].state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert "out" not in ip.user_ns  # the cell ran in a copy of the namespace


def test_cell_with_a_loss_variable_and_profile(ip):
    prof = profile_cell(ip, "loss = CE(model(x), y)", modes=("32-true", "bf16-mixed"))
    assert [p.name for p in prof.profiles] == ["32-true", "bf16-mixed"]


@pytest.mark.parametrize("cell, words", [
    ("CE(x, y)", "no model"),
    ("loss = CE(model(x), y)\nloss.backward()", "leave backward()"),
    ("model(x)\nz = 1", "no loss"),
    ("CE(model(x), y", "not valid Python"),
])
def test_cell_mistakes_are_usage_errors(ip, cell, words):
    with pytest.raises(UsageError, match=words):
        doctor_cell(ip, cell, **FAST)


def test_the_flags_run_the_doctor_and_the_profile_and_refuse_other_options(ip):
    from IPython.utils.capture import capture_output

    from ampnb import putback_state

    ip.run_line_magic("load_ext", "ampnb")
    before = putback_state.torch_state()
    weights = {k: v.clone() for k, v in ip.user_ns["model"].state_dict().items()}
    try:
        with capture_output():
            ip.run_cell_magic("amp", "--profile -o prof -q", "CE(model(x), y)")
        assert [p.name for p in ip.user_ns["prof"].profiles][0] == "32-true"
        for line in ("bf16-mixed --doctor", "--doctor --compare 16-mixed", "--doctor --trace",
                     "--doctor --profile"):
            with pytest.raises(UsageError, match="cannot be combined with --doctor"):
                ip.run_cell_magic("amp", line, "CE(model(x), y)")
    finally:
        ip.run_line_magic("unload_ext", "ampnb")
        ip.user_ns.pop("prof", None)
    assert putback_state.torch_state() == before
    assert all(torch.equal(v, ip.user_ns["model"].state_dict()[k]) for k, v in weights.items())
