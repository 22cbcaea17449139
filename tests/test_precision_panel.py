"""PrecisionPanel: setting controls and clicking buttons drives the Workbench; the view follows."""

from __future__ import annotations

import contextlib
import copy
import html
import warnings

import pytest
import torch
from _workbench_kit import InterruptAt, consistent, make, same, weights

import ampnb.panels.base as base
from ampnb import putback_state
from ampnb.device import devices
from ampnb.modes import MODES, Availability
from ampnb.panels import PrecisionPanel
from ampnb.plots import plot_loss_curve
from ampnb.plots.training import MODE_COLORS
from ampnb.workbench import Workbench
from ampnb.workbench.ops import summary_table


@pytest.fixture
def shown(monkeypatch):
    """Every figure the panel displays, as the PNG bytes Jupyter would show."""
    images: list[bytes] = []
    monkeypatch.setattr(base, "display", lambda fig: images.append(fig._repr_png_()))
    return images


@pytest.fixture
def panel(shown):
    return PrecisionPanel(Workbench(*make()), run_n=3)


def _curve(panel) -> list[tuple[str, list[float]]]:
    """(legend label, losses) of each coloured segment drawn on the panel's axes."""
    return [(line.get_label(), list(line.get_ydata())) for line in panel.ax.get_lines()
            if line.get_marker() == "o"]


def test_controls_have_stable_names_and_options(panel):
    assert [b.description for b in panel.buttons.values()] == ["Step", "Run N", "Reset"]
    assert list(panel.device.options) == [d.name for d in devices()]
    labels = dict((value, label) for label, value in panel.mode.options)
    assert list(labels) == list(MODES)
    for name, mode in MODES.items():
        found = mode.availability("cpu")
        assert (labels[name] == name) == (found.ok and not found.reason)
        if not found.ok:
            assert labels[name] == f"{name} (unavailable: {found.reason})"
        elif found.reason:  # runs, but not natively (FP8 emulated): the label says how
            assert labels[name] == f"{name} ({found.reason})"


def test_step_and_run_n_redraw_the_loss_curve(panel, shown):
    before = len(shown)
    panel.buttons["Step"].click()
    assert len(shown) == before + 1 and shown[-1] != shown[-2]
    panel.n.value = 4
    panel.buttons["Run N"].click()
    wb = panel.workbench
    assert len(wb.history) == 5 and shown[-1] != shown[-2]
    assert _curve(panel) == [(wb.mode.name, [r.loss for r in wb.history])]
    assert f"last loss {wb.history[-1].loss:.5g}" in panel.status.value


def test_mode_switch_colours_a_new_segment_and_measures_speedup(panel, shown):
    panel.buttons["Run N"].click()
    assert "speedup vs 32-true 1.00x" in panel.status.value
    panel.mode.value = "bf16-mixed"
    wb = panel.workbench
    assert wb.mode.name == "bf16-mixed" and "n/a" in panel.status.value
    panel.buttons["Run N"].click()
    segments = _curve(panel)
    assert [label for label, _ in segments] == ["32-true", "bf16-mixed"]
    assert [line.get_color() for line in panel.ax.get_lines() if line.get_marker() == "o"] == [
        MODE_COLORS["32-true"], MODE_COLORS["bf16-mixed"]]
    assert segments[1][1] == [r.loss for r in wb.history[3:]]
    assert f"speedup vs 32-true {wb.speedup():.2f}x" in panel.status.value
    assert "parameters float32" in panel.status.value
    panel.mode.value = "bf16-true"
    assert "parameters bfloat16" in panel.status.value


def test_unavailable_mode_is_listed_and_refused_with_its_reason(shown, monkeypatch):
    # Every mode runs on a CPU (FP8 emulated), so pretend one needs hardware that is absent.
    blocked = Availability(False, "needs a pretend accelerator", "32-true")
    monkeypatch.setattr(type(MODES["64-true"]), "availability", lambda self, device="cpu": blocked)
    panel = PrecisionPanel(Workbench(*make()), run_n=3)
    assert ("64-true (unavailable: needs a pretend accelerator)", "64-true") in panel.mode.options
    panel.buttons["Step"].click()
    before, state = weights(panel.workbench.model), putback_state.torch_state()
    panel.mode.value = "64-true"
    assert "needs a pretend accelerator" in panel.message.value
    assert "ValueError" in panel.message.value
    assert panel.mode.value == "32-true" and panel.workbench.mode.name == "32-true"
    assert same(weights(panel.workbench.model), before) and putback_state.torch_state() == state
    panel.buttons["Step"].click()  # and it keeps working
    assert len(panel.workbench.history) == 2 and panel.message.value == ""


def test_a_switch_updates_the_readout_without_redrawing_the_curve(panel, shown):
    panel.buttons["Step"].click()
    drawn, status = len(shown), panel.status.value
    panel.mode.value = "bf16-mixed"
    assert len(shown) == drawn and panel.status.value != status  # same curve, new settings
    assert "mode bf16-mixed" in panel.status.value
    panel.buttons["Step"].click()
    assert len(shown) == drawn + 1 and shown[-1] != shown[-2]


def _hand_trace(wb, dtype):
    """The op summary of the same forward + backward written by hand on a copy of the model."""
    from ampnb.instruments import trace
    model = copy.deepcopy(wb.model)
    x, y = wb.batches[len(wb.history) % len(wb.batches)]
    ctx = torch.autocast("cpu", dtype=dtype) if dtype else contextlib.nullcontext()
    with trace.trace_ops() as t:
        with ctx:
            out = model(x.to(dtype or x.dtype))
        wb.loss_fn(out.float(), y).backward()
    return summary_table(t, wb.mode.name)


def test_op_summary_follows_the_mode_and_matches_a_hand_trace(panel):
    hand32 = _hand_trace(panel.workbench, None)
    assert panel.ops.value == hand32._repr_html_()
    assert [r[0] for r in hand32.rows if r[0] == "ran in lower precision"] == []
    panel.mode.value = "bf16-mixed"
    hand = _hand_trace(panel.workbench, torch.bfloat16)
    assert panel.ops.value == hand._repr_html_()
    lowered = [r for r in hand.rows if r[0] == "ran in lower precision"]
    assert lowered and "bfloat16" in lowered[0][2] and "addmm" in lowered[0][3]
    panel.mode.value = "32-true"
    assert panel.ops.value == hand32._repr_html_()


def test_tf32_toggle_is_scoped_to_the_step(panel):
    state = putback_state.torch_state()
    panel.tf32.value = True
    assert panel.workbench.tf32 and "TF32 on" in panel.status.value
    assert "TF32 has no effect on cpu" in panel.status.value or torch.cuda.is_available()
    panel.buttons["Step"].click()
    assert panel.workbench.history[-1].tf32 and putback_state.torch_state() == state


def test_callback_errors_are_shown_and_the_panel_keeps_working(panel):
    state = putback_state.torch_state()

    def broken(out, y):
        raise RuntimeError("loss exploded")

    good, panel.workbench.loss_fn = panel.workbench.loss_fn, broken
    panel.buttons["Step"].click()
    assert "RuntimeError: loss exploded" in panel.message.value
    assert "Traceback" in panel.message.value and putback_state.torch_state() == state
    panel.workbench.loss_fn = good
    panel.buttons["Step"].click()
    assert panel.message.value == "" and len(panel.workbench.history) == 1


def test_carry_forward_is_said_in_the_panel_not_as_a_stray_warning(panel):
    panel.mode.value = "bf16-true"
    panel.buttons["Step"].click()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        panel.mode.value = "32-true"
    assert not caught
    assert "carried forward" in panel.status.value
    assert panel.workbench.notes and html.escape(panel.workbench.notes[0]) in panel.status.value


def test_reset_restores_the_start_and_the_controls(panel, shown):
    start = weights(panel.workbench.model)
    panel.buttons["Step"].click()
    panel.mode.value = "16-mixed"
    panel.tf32.value = True
    panel.buttons["Run N"].click()
    panel.buttons["Reset"].click()
    wb = panel.workbench
    assert wb.history == [] and same(weights(wb.model), start)
    assert (panel.mode.value, panel.tf32.value, wb.mode.name, wb.tf32) == (
        "32-true", False, "32-true", False)
    assert _curve(panel) == [] and "no steps yet" in panel.ax.texts[0].get_text()


def test_default_panel_trains_the_demo_mlp(shown):
    from ampnb.models import MLP

    panel = PrecisionPanel()
    assert isinstance(panel.workbench.model, MLP)
    panel.buttons["Step"].click()
    assert len(panel.workbench.history) == 1 and len(shown) == 2
    assert "application/vnd.jupyter.widget-view+json" in panel._repr_mimebundle_()


def test_plot_loss_curve_from_records_and_empty():
    wb = Workbench(*make(n_batches=2))
    ax = plot_loss_curve([])
    assert "no steps yet" in ax.texts[0].get_text()
    wb.run(2)
    wb.set(mode="bf16-mixed", tf32=True)
    wb.run(2)
    ax = plot_loss_curve(wb.history)
    lines = [ln for ln in ax.get_lines() if ln.get_marker() == "o"]
    assert [ln.get_linestyle() for ln in lines] == ["-", "--"]  # dashed while TF32 was on
    assert [list(ln.get_xdata()) for ln in lines] == [[0, 1], [2, 3]]
    assert [ln.get_color() for ln in lines] == [MODE_COLORS["32-true"], MODE_COLORS["bf16-mixed"]]


def test_warnings_of_an_action_are_shown_in_the_panel(panel):
    # The make() model's last Linear (out_features 4) cannot run in FP8: the swap warns.
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing may escape the panel
        panel.mode.value = "transformer-engine"
    assert panel.workbench.mode.name == "transformer-engine" and panel.message.value == ""
    assert "FP8" in panel.status.value and "higher precision" in panel.status.value
    panel.buttons["Step"].click()
    assert panel.workbench.history[-1].param_dtype == torch.bfloat16


@pytest.mark.parametrize("bad", [dict(workbench=42), dict(run_n=0), dict(window=0),
                                 dict(run_n=2.5), dict(window=True)])
def test_bad_arguments_are_one_line_value_errors(bad):
    wb = Workbench(*make())
    before = weights(wb.model)
    with pytest.raises(ValueError, match="is not allowed; allowed"):
        PrecisionPanel(**({"workbench": wb} | bad))
    assert same(weights(wb.model), before) and wb.history == []


def test_nonfinite_weights_are_shown_in_the_step_that_made_them(shown):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 2))
    wb = Workbench(model, torch.optim.AdamW(model.parameters(), lr=1e-3),
                   torch.nn.functional.mse_loss, [(torch.zeros(8, 4), torch.ones(8, 2))],
                   mode="16-true")
    panel = PrecisionPanel(wb)
    panel.buttons["Step"].click()
    assert "inf/NaN weights after step 0: 0.weight" in html.unescape(panel.status.value)


def test_an_interrupt_at_any_line_of_a_mode_change_leaves_the_workbench_consistent(shown):
    state = putback_state.torch_state()
    panel = PrecisionPanel(Workbench(*make()), run_n=2)
    panel.buttons["Step"].click()
    wb = panel.workbench
    start, n = weights(wb.model), 1
    while True:
        with InterruptAt(n) as sweep:
            try:
                panel.mode.value = "bf16-true"
            except KeyboardInterrupt:
                pass
        if not sweep.fired:
            break
        assert consistent(wb) and putback_state.torch_state() == state, n
        if wb.mode.name == "32-true":
            assert same(weights(wb.model), start), n  # the interrupted switch left nothing
        wb.set(mode="32-true")  # back for the next line (the panel's controls follow)
        panel._sync_widgets()
        assert same(weights(wb.model), start)
        n += 1
    assert n > 20 and wb.mode.name == "bf16-true"


def test_fp16_kernels_control_switches_the_workbench_and_says_how_fp16_runs(panel):
    assert list(panel.fp16_kernels.options) == ["auto", "native", "emulated"]
    panel.mode.value = "16-mixed"
    panel.fp16_kernels.value = "native"
    panel.buttons["Step"].click()
    wb = panel.workbench
    assert wb.fp16_kernels == "native" and "emulated in fp32" not in wb.history[-1].kernels
    panel.fp16_kernels.value = "emulated"
    panel.buttons["Step"].click()
    assert "emulated in fp32" in wb.history[-1].kernels
    assert "emulated in fp32" in html.unescape(panel.status.value)


def test_module_picker_keeps_the_chosen_modules_in_fp32(panel):
    assert tuple(panel.keep_fp32.options) == ("0", "1", "2")
    panel.mode.value = "bf16-true"
    panel.keep_fp32.value = ("2",)
    panel.buttons["Step"].click()
    wb = panel.workbench
    assert wb.keep_fp32 == ("2",) and wb.model[2].weight.dtype == torch.float32
    assert wb.model[0].weight.dtype == torch.bfloat16
    assert "kept in fp32: 2" in panel.status.value
    panel.buttons["Reset"].click()
    assert panel.keep_fp32.value == () and wb.keep_fp32 == ()
