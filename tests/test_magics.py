"""%%amp and %amp in a real IPython InteractiveShell, checked against plain torch."""

from __future__ import annotations

import pytest
import torch
from _magics_kit import amp as _amp
from _magics_kit import shell_with_ampnb
from _magics_kit import shown as _shown
from IPython.core.error import UsageError
from IPython.utils.capture import capture_output

from ampnb import putback_state
from ampnb.device import restore_tf32, tf32_state
from ampnb.formats import quantize
from ampnb.magics.amp import AmpMagics


@pytest.fixture
def ip():
    yield from shell_with_ampnb()


def test_mixed_mode_runs_under_autocast_and_reports_dtypes(ip):
    value, out = _amp(ip, "bf16-mixed -o r", "y = lin(x)\ny")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = ip.user_ns["lin"](ip.user_ns["x"])
    assert torch.equal(value, expected) and value.dtype == torch.bfloat16
    assert ip.user_ns["y"].dtype == torch.bfloat16
    r = ip.user_ns["r"]
    assert (r.mode, r.device) == ("bf16-mixed", "cpu")
    assert ("y", "bfloat16") in [(m.name, m.dtype) for m in r.made]
    assert r.seconds > 0 and r.value is value
    assert "bf16-mixed on cpu" in _shown(out) and "bfloat16" in _shown(out)
    assert "<table" in r._repr_html_()


def test_true_mode_sets_the_default_dtype_only_inside_the_cell(ip):
    _amp(ip, "16-true -o r", "z = torch.ones(2) / 3\nmade = torch.nn.Linear(2, 2)\ny = lin(x)")
    ns = ip.user_ns
    assert ns["z"].dtype == torch.float16 and torch.equal(ns["z"], (torch.ones(2) / 3).half())
    assert ns["made"].weight.dtype == torch.float16
    assert ns["y"].dtype == torch.float32  # made before the cell: keeps its dtype, and says so
    assert any("keep their dtype" in n for n in ns["r"].notes)
    assert torch.get_default_dtype() == torch.float32
    made = {m.name: m.dtype for m in ns["r"].made}
    assert made["made"] == "params float16" and made["z"] == "float16"


def test_tf32_emulate_rounds_matmul_inputs(ip):
    _amp(ip, "32-true --tf32 emulate -o r", "y = lin(x)")
    lin, x = ip.user_ns["lin"], ip.user_ns["x"]
    expected = torch.nn.functional.linear(quantize(x, "tf32"), quantize(lin.weight, "tf32"), lin.bias)
    assert torch.equal(ip.user_ns["y"], expected)
    assert not torch.equal(expected, lin(x))
    assert ip.user_ns["r"].tf32 == "emulated"


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU note")
def test_tf32_on_on_cpu_says_it_changes_nothing(ip):
    _amp(ip, "32-true --tf32 on -o r", "y = lin(x)")
    assert torch.equal(ip.user_ns["y"], ip.user_ns["lin"](ip.user_ns["x"]))
    assert any("no effect on cpu" in n for n in ip.user_ns["r"].notes)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU note")
@pytest.mark.parametrize("line", ["bf16-mixed --tf32 on", "--compare bf16-mixed -r 1 --tf32 on"])
def test_the_tf32_line_and_its_note_agree_and_say_it_once(ip, line):
    _amp(ip, f"{line} -o r", "lin(x)")
    run = ip.user_ns["r"]
    said = [n for n in run.notes if "no effect on cpu" in n]
    assert run.tf32 == "on" and len(said) == 1  # the switch was on while the cell ran
    assert "(switch: on)" in said[0] and "switch: off" not in repr(run)


def test_show_code_runs_and_gives_the_same_result(ip):
    for line, needles in [
        ("bf16-mixed", ['torch.autocast(device_type="cpu", dtype=torch.bfloat16)',
                        'precision="bf16-mixed"', 'mixed_precision="bf16"']),
        ("16-mixed", ['torch.amp.GradScaler("cpu")', 'mixed_precision="fp16"']),
        ("bf16-true", ["torch.set_default_dtype(torch.bfloat16)", 'precision="bf16-true"',
                       'mixed_precision="no"']),
        ("32-true --tf32 on", ["allow_tf32 = True", 'mixed_precision="no"']),
    ]:
        _amp(ip, f"{line} --show-code -o r", "y = lin(x) * 3\nz = torch.ones(3) / 3")
        code = ip.user_ns["r"].code
        for needle in needles:
            assert needle in code, (line, needle)
        ns = {"lin": ip.user_ns["lin"], "x": ip.user_ns["x"]}
        flags = tf32_state()
        try:  # the shown code sets the global TF32 flags itself, as a user's would
            exec(compile(code, "<show-code>", "exec"), ns)
        finally:
            restore_tf32(flags)
        assert torch.equal(ns["y"], ip.user_ns["y"]) and torch.equal(ns["z"], ip.user_ns["z"])


def test_quiet_prints_nothing_and_o_still_stores(ip):
    value, out = _amp(ip, "bf16-mixed -q -o r", "y = lin(x)\ny")
    assert value is None and out.stdout == "" and not out.outputs
    assert ip.user_ns["r"].mode == "bf16-mixed"


@pytest.mark.parametrize("line, match", [
    ("bf17-mixed", "unknown precision mode 'bf17-mixed'; choose one of 32-true"),
    ("--device gpu", "unknown device 'gpu'; available: cpu"),
    ("--tf32 maybe", "invalid choice: 'maybe'"),
    ("bf16-mixed --repeat 3", "--repeat sets the runs of --compare"),
    ("bf16-mixed --compare 16-mixed", "cannot be combined with --compare"),
    ("--compare bf16-mixed --trace", "cannot be combined with --compare"),
    ("--compare bf16-mixed -r 0", "--repeat must be >= 1"),
    ("--compare ,", "--compare needs modes"),
    ("--compare bf16-mixed,nope", "unknown precision mode 'nope'"),
    ("bf16-mixed --measure", "--measure belongs to %amp"),
    ("bf16-mixed -o 1x", "-o needs a Python name"),
])
def test_usage_errors_are_one_line_and_run_nothing(ip, line, match):
    with pytest.raises(UsageError, match=match.replace("(", r"\(")) as info:
        ip.run_cell_magic("amp", line, "y = lin(x)")
    assert "\n" not in str(info.value) and "y" not in ip.user_ns


@pytest.mark.skipif(torch.cuda.is_available(), reason="the message on a machine without CUDA")
def test_cuda_on_a_cpu_machine_says_what_would_run_instead(ip):
    with pytest.raises(UsageError, match="not available on this machine.*--device cpu"):
        ip.run_cell_magic("amp", "bf16-mixed --device cuda", "y = lin(x)")


@pytest.mark.parametrize("line", ["16-true", "bf16-mixed --tf32 emulate", "32-true --tf32 on"])
def test_state_restored_when_the_cell_raises(ip, line):
    before = putback_state.torch_state()
    result = ip.run_cell(f"%%amp {line}\nz = torch.ones(1)\nraise ValueError('boom')")
    assert isinstance(result.error_in_exec, ValueError)
    assert putback_state.torch_state() == before


def test_state_restored_on_keyboard_interrupt(ip):
    before = putback_state.torch_state()
    with pytest.raises(KeyboardInterrupt):
        ip.run_cell_magic("amp", "bf16-true --tf32 emulate", "z = torch.ones(1)\nraise KeyboardInterrupt")
    assert putback_state.torch_state() == before


def test_cell_that_changes_global_state_is_reported(ip):
    _amp(ip, "32-true -o r", "torch.set_grad_enabled(False)")
    torch.set_grad_enabled(True)
    assert any("grad_enabled" in n for n in ip.user_ns["r"].notes)


def test_line_magic_and_config_set_the_defaults(ip):
    with capture_output():
        ip.run_line_magic("amp", "bf16 --tf32 emulate")
    _amp(ip, "-o r", "y = lin(x)")
    assert ip.user_ns["r"].mode == "bf16-mixed" and ip.user_ns["r"].tf32 == "emulated"
    ip.run_line_magic("config", "AmpMagics.default_mode = '16-true'")
    ip.run_line_magic("config", "AmpMagics.default_tf32 = ''")
    _amp(ip, "-o r", "z = torch.ones(1)")
    assert ip.user_ns["z"].dtype == torch.float16
    with pytest.raises(UsageError, match="unknown precision mode"):
        ip.run_line_magic("amp", "nope")
    with pytest.raises(UsageError, match="only work in a %%amp cell"):
        ip.run_line_magic("amp", "--compare bf16-mixed")


def test_status_shows_defaults_support_and_measured_throughput(ip, monkeypatch):
    import ampnb.device as device

    calls = []
    real = device.throughput_table
    monkeypatch.setattr(device, "throughput_table",
                        lambda **kw: calls.append(kw) or real(device="cpu", **kw))
    with capture_output() as out:
        ip.run_line_magic("amp", "")
    assert "%%amp default" in _shown(out) and "Precision support" in _shown(out)
    assert "TFLOP/s" in _shown(out) and calls == [{"refresh": False}]
    with capture_output():
        ip.run_line_magic("amp", "--measure -q")
    assert calls[-1] == {"refresh": True}


def test_unload_removes_everything_and_reload_works(ip):
    mm = ip.magics_manager
    assert "amp" in mm.magics["line"] and "amp" in mm.magics["cell"]
    ip.run_line_magic("unload_ext", "ampnb")
    assert "amp" not in mm.magics["line"] and "amp" not in mm.magics["cell"]
    assert "AmpMagics" not in mm.registry
    assert not any(isinstance(c, AmpMagics) for c in ip.configurables)
    ip.run_line_magic("load_ext", "ampnb")
    ip.run_line_magic("reload_ext", "ampnb")
    assert sum(isinstance(c, AmpMagics) for c in ip.configurables) == 1
    _amp(ip, "bf16-mixed -o r", "y = lin(x)")
    assert ip.user_ns["y"].dtype == torch.bfloat16


def test_help_lists_every_option():
    doc = AmpMagics.amp.__doc__
    for flag in ("--device", "--tf32", "--compare", "--repeat", "--trace", "--hunt", "--memory",
                 "--show-code", "--measure", "-o NAME", "-q"):
        assert flag in doc
    assert "%%amp [--device" in doc
    # help strings go through argparse's %-formatting: a bare "%amp" would print a dict
    assert "%%amp: run the cell under it; %amp: make it the default" in " ".join(doc.split())


# --trace / --hunt / --memory (issue 3): the instruments around one %%amp cell.

def _extra(run, name):
    (found,) = [e for e in run.extras if type(e).__name__ == name]
    return found


def test_trace_shows_the_linear_as_a_bf16_addmm(ip):
    _, out = _amp(ip, "bf16-mixed --trace -o r", "y = lin(x)")
    t = _extra(ip.user_ns["r"], "OpTrace")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = str(ip.user_ns["lin"](ip.user_ns["x"]).dtype)[6:]
    (row,) = t.select(op="addmm")
    assert (row.module, row.output_dtype, row.cast) == ("Linear", expected, True)
    assert "addmm" in _shown(out) and "ran in lower precision (bfloat16)" in _shown(out)
    assert "addmm" in ip.user_ns["r"]._repr_html_()


def test_hunt_blames_the_overflowing_fp16_layer_and_is_quiet_when_finite(ip):
    big = torch.nn.Linear(16, 8)
    with torch.no_grad():
        big.weight.fill_(1e4)
    ip.user_ns.update(big=big, xx=ip.user_ns["x"].abs() + 1)
    _amp(ip, "16-mixed --hunt -o r", "y = big(xx)")
    h = _extra(ip.user_ns["r"], "NonFinite")
    exact = big(ip.user_ns["xx"]).abs().max().item()  # fp32 reference
    assert exact > torch.finfo(torch.float16).max
    assert h and (h.op, h.module, h.phase, h.format) == ("addmm", "Linear", "forward", "fp16")
    assert abs(h.exact_amax - exact) <= 1e-3 * exact
    _amp(ip, "bf16-mixed --hunt -o r", "y = big(xx)")
    assert not _extra(ip.user_ns["r"], "NonFinite")
    ip.user_ns.pop("big"), ip.user_ns.pop("xx")


def test_hunt_notes_the_finding_on_an_error_and_restores_state(ip):
    big = torch.nn.Linear(16, 8)
    with torch.no_grad():
        big.weight.fill_(1e4)
    ip.user_ns.update(big=big)
    before = putback_state.torch_state()
    with pytest.raises(FloatingPointError) as info:
        _amp(ip, "16-mixed --hunt --trace", "y = big(x.abs() + 1)\nraise FloatingPointError('inf')")
    assert "addmm in Linear (forward)" in "".join(info.value.__notes__)
    assert putback_state.torch_state() == before
    ip.user_ns.pop("big")


def test_memory_measures_what_autograd_saved(ip):
    _amp(ip, "bf16-mixed --memory -o r", "y = lin(x)\nloss = y.float().sum()")
    m = _extra(ip.user_ns["r"], "CellMemory")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = ip.user_ns["lin"](ip.user_ns["x"])
    fn = y.grad_fn  # autograd's own record of what addmm saved (the weight is a parameter)
    saved = [getattr(fn, a) for a in ("_saved_mat1", "_saved_self")
             if isinstance(getattr(fn, a, None), torch.Tensor)]
    assert m.peak_bytes == sum(t.untyped_storage().nbytes() for t in saved) > 0
    assert "saved for backward" in repr(ip.user_ns["r"])


def test_all_three_flags_together_keep_the_instruments_out_of_the_trace(ip):
    _amp(ip, "bf16-mixed --trace --hunt --memory -o r", "y = lin(x)\ny.float().sum().backward()")
    r = ip.user_ns["r"]
    t = _extra(r, "OpTrace")
    assert not t.select(op="isfinite") and not _extra(r, "NonFinite")
    assert _extra(r, "CellMemory").meter.live == 0


def test_fp8_mode_says_which_layers_run_in_fp8(ip):
    _amp(ip, "transformer-engine -o r", "y = lin(x)")
    notes = " ".join(ip.user_ns["r"].notes)
    assert "only FP8 layers run in FP8" in notes and "convert_module" in notes


def test_trace_summary_shows_the_counts_without_module_paths(ip):
    _, out = _amp(ip, "bf16-mixed --trace summary -o r", "y = lin(x)")
    t = _extra(ip.user_ns["r"], "OpTrace")
    assert t.detail == "summary" and t.rows == []
    assert {r.module for r in t.grouped} == {""}
    assert "addmm" in _shown(out) and "ran in lower precision (bfloat16)" in _shown(out)
    _amp(ip, "bf16-mixed --trace -o r2", "y = lin(x)")
    assert _extra(ip.user_ns["r2"], "OpTrace").detail == "full"
