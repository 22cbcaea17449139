"""Workbench, memory_report, PrecisionPanel and RangeExplorer on every zoo model, as users pass them."""

from __future__ import annotations

import copy

import pytest
import torch
from zoo_models import BUILDERS, Case

from ampnb.instruments.memory import memory_meter, memory_report
from ampnb.workbench import Workbench


def _bits(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in [*model.named_parameters(), *model.named_buffers()]}


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)


def _hand_loss(model: torch.nn.Module, case: Case) -> torch.Tensor:
    """The step's loss written out: keyword batch -> the model's own loss, else loss_fn."""
    if isinstance(case.batch, dict):
        return model(**case.batch).loss
    x, y = case.batch
    return case.loss_fn(model(x), y)


def _plain_autocast_error(case: Case) -> type[Exception] | None:
    """What plain torch raises for this model's forward under CPU bf16 autocast (None: runs).

    nn.LSTM under bf16 autocast fails in oneDNN on CPUs without AVX512-BF16 and runs on the
    others: ampnb must do what torch does on the CPU at hand.
    """
    try:
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            _hand_loss(copy.deepcopy(case.model), case)
    except RuntimeError as err:
        return type(err)
    return None


def test_switching_to_bf16_mixed_and_back_is_bit_identical(case: Case):
    fails = _plain_autocast_error(case)
    wb = Workbench(case.model, case.optimizer(), case.loss_fn, [case.batch])
    wb.step()
    wb.set(mode="bf16-mixed")
    if fails:
        with pytest.raises(fails):
            wb.step()
    else:
        assert wb.step().output_dtype == torch.bfloat16
    trained, opt = _bits(wb.model), copy.deepcopy(wb.optimizer.state_dict())
    wb.set(mode="32-true")  # mixed trains fp32 weights: nothing is lost on the way back
    assert _same(_bits(wb.model), trained)
    back = wb.optimizer.state_dict()
    assert all(torch.equal(back["state"][i][k], v) for i, s in opt["state"].items()
               for k, v in s.items())


def test_32_true_steps_equal_a_plain_torch_loop(case: Case):
    ref = copy.deepcopy(case.model)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    torch.manual_seed(7)  # dropout draws the same masks in both loops
    losses = []
    for _ in range(2):
        opt.zero_grad(set_to_none=True)
        loss = _hand_loss(ref, case)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    wb = Workbench(case.model, case.optimizer(), case.loss_fn, [case.batch])
    torch.manual_seed(7)
    assert [r.loss for r in wb.run(2)] == losses
    assert _same(_bits(wb.model), _bits(ref))


def test_memory_report_takes_the_batch_and_an_optimizer_instance(case: Case):
    before = _bits(case.model)
    modes = ("32-true", "bf16-true")
    (fp32, true16) = memory_report(case.model, case.batch, case.loss_fn,
                                   optimizer=case.optimizer(), modes=modes).stats
    assert _same(_bits(case.model), before)  # measured on a copy
    ref = copy.deepcopy(case.model)  # reference: the same step by hand
    opt = case.optimizer.__func__(Case(case.name, ref, case.batch, case.loss_fn, ""))
    with memory_meter() as hand:
        _hand_loss(ref, case).backward()
    opt.step()
    state = sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values())
    assert fp32.saved_bytes == hand.peak_bytes > 0 and fp32.optimizer_bytes == state
    assert 0 < true16.saved_bytes and 2 * true16.param_bytes == fp32.param_bytes


def test_precision_panel_drives_a_zoo_model(monkeypatch):
    import ampnb.panels.base as base
    from ampnb.panels import PrecisionPanel

    monkeypatch.setattr(base, "display", lambda fig: None)
    case = BUILDERS["bert"]()  # keyword inputs and the model's own loss
    panel = PrecisionPanel(Workbench(case.model, case.optimizer(), case.loss_fn, [case.batch]))
    panel.buttons["Step"].click()
    panel.mode.value = "bf16-mixed"
    panel.buttons["Step"].click()
    assert panel.message.value == "", panel.message.value
    assert [r.mode for r in panel.workbench.history] == ["32-true", "bf16-mixed"]
    assert "lower precision" in panel.ops.value  # the op trace of the bf16 probe


@pytest.mark.parametrize("name", ["resnet", "bert"])
def test_range_explorer_leaves_the_model_bit_identical(name):
    from ampnb.panels import RangeExplorer

    case = BUILDERS[name]()
    before = _bits(case.model)
    panel = RangeExplorer(case.model, case.batch, case.loss_fn)
    panel.recapture.click()
    assert "captured again" in panel.message.value
    assert _same(_bits(case.model), before)  # BatchNorm's running stats and counter too
    assert panel.kinds == ("weight", "activation", "gradient")  # the model's own loss
    assert all(p.grad is None for p in case.model.parameters())


def test_amp_memory_cell_measures_a_zoo_model_like_memory_meter():
    from IPython.core.interactiveshell import InteractiveShell
    from IPython.utils.capture import capture_output

    from ampnb.magics.instruments import CellMemory

    case = BUILDERS["gpt2"]()  # keyword inputs, Conv1D, the model's own loss
    ip = InteractiveShell.instance()
    ip.run_line_magic("load_ext", "ampnb")
    try:
        ip.user_ns.update(model=case.model, batch=case.batch)
        with capture_output():
            ip.run_cell_magic("amp", "bf16-mixed --memory -o r",
                              "out = model(**batch)\nout.loss.backward()")
        (cell,) = [e for e in ip.user_ns["r"].extras if isinstance(e, CellMemory)]
    finally:
        ip.run_line_magic("unload_ext", "ampnb")
        for name in ("model", "batch", "out", "r"):
            ip.user_ns.pop(name, None)
    with memory_meter() as hand, torch.autocast("cpu", dtype=torch.bfloat16):
        loss = case.model(**case.batch).loss
    assert cell.meter.peak_bytes == hand.peak_bytes > 0 and loss.dtype == torch.float32
