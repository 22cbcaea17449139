"""%%amp --fp16-kernels and --keep-fp32, checked against plain torch with the same settings."""

from __future__ import annotations

import pytest
import torch
from _magics_kit import amp, shell_with_ampnb, shown
from IPython.core.error import UsageError

from ampnb import putback_state
from ampnb.device import cpu_features_as
from ampnb.fp16_kernels import emulated_fp16_kernels
from ampnb.magics.amp import AmpMagics


@pytest.fixture
def ip():
    # decided as on a CPU without fp16 units (most CPUs), whatever CPU runs the test
    with cpu_features_as({"avx2"}):
        yield from shell_with_ampnb()


def _two_layers(ip):
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 8))
    ip.user_ns["net"] = net
    return net


@pytest.mark.parametrize("kernels", ["native", "emulated"])
def test_fp16_kernels_flag_runs_those_kernels_and_says_so(ip, kernels):
    value, out = amp(ip, f"16-mixed --fp16-kernels {kernels} -o r", "y = lin(x)\ny")
    with emulated_fp16_kernels(kernels == "emulated"), torch.autocast("cpu", dtype=torch.float16):
        expected = ip.user_ns["lin"](ip.user_ns["x"])
    assert torch.equal(value, expected) and value.dtype == torch.float16
    said = " ".join(ip.user_ns["r"].notes)
    assert ("emulated in fp32" in said) == (kernels == "emulated") and "slower" in said
    assert ("emulated in fp32" in shown(out)) == (kernels == "emulated")


def test_fp16_kernels_flag_reaches_the_backward(ip):
    """The emulation wraps the whole cell: an fp16 backward's products run emulated too."""
    net = _two_layers(ip)
    x = ip.user_ns["x"]
    amp(ip, "16-true --fp16-kernels emulated", "net.half()\nnet(x.half()).float().sum().backward()")
    got = net[0].weight.grad.clone()
    net.zero_grad(set_to_none=True)
    with emulated_fp16_kernels():
        net(x.half()).float().sum().backward()
    assert got.dtype == torch.float16 and torch.equal(got, net[0].weight.grad)


def test_keep_fp32_flag_equals_a_hand_written_region(ip):
    net = _two_layers(ip)
    x = ip.user_ns["x"]
    value, out = amp(ip, '16-mixed --keep-fp32 "2" -o r', "y = net(x)\ny")
    with torch.autocast("cpu", dtype=torch.float16):
        h = net[1](net[0](x))
        with torch.autocast("cpu", enabled=False):
            expected = net[2](h.float())
    assert value.dtype == torch.float32 and torch.equal(value, expected)
    assert "kept in fp32: net.2" in shown(out)
    assert not hasattr(net[2], "__dict__") or "forward" not in net[2].__dict__  # removed after


def test_keep_fp32_in_compare_marks_the_rows(ip):
    _two_layers(ip)
    amp(ip, '--compare bf16-mixed --keep-fp32 "2" -r 1 -o c', "y = net(x)\ny")
    row = ip.user_ns["c"].comparison.row("bf16-mixed")
    assert "kept in fp32: net.2" in row.note
    assert ip.user_ns["c"].comparison.reference.note == ""


@pytest.mark.parametrize(("line", "match"), [
    ('bf16-mixed --keep-fp32 "head"', "pattern 'head' matches no module"),
    ("bf16-mixed --keep-fp32 ,", "keep_fp32 needs module paths"),
    ("16-mixed --fp16-kernels fast", "invalid choice: 'fast'"),
    ("--doctor --keep-fp32 2", "cannot be combined with --doctor"),
])
def test_bad_values_are_one_line_usage_errors_and_run_nothing(ip, line, match):
    _two_layers(ip)
    before = putback_state.torch_state()
    with pytest.raises(UsageError, match=match) as info:
        ip.run_cell_magic("amp", line, "y = net(x)")
    assert "\n" not in str(info.value) and "y" not in ip.user_ns
    assert putback_state.torch_state() == before


def test_keep_fp32_without_a_model_is_refused(ip):
    with pytest.raises(UsageError, match="needs a model made before the cell"):
        ip.run_cell_magic("amp", 'bf16-mixed --keep-fp32 "0"', "y = torch.ones(2)")


def test_help_lists_the_new_options():
    doc = AmpMagics.amp.__doc__
    assert "--fp16-kernels" in doc and "--keep-fp32" in doc


@pytest.mark.parametrize("kernels", ["native", "emulated"])
def test_the_report_says_once_how_fp16_ran(ip, kernels):
    amp(ip, f"16-mixed --fp16-kernels {kernels} -o r", "y = lin(x)")
    notes = [n for n in ip.user_ns["r"].notes if "fp16" in n and "slower" in n]
    assert len(notes) == 1 and ("emulated in fp32" in notes[0]) == (kernels == "emulated")
