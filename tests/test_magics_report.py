"""What %%amp reports: tensors inside structured results, --memory, bad input, syntax errors."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from _magics_kit import amp as _amp
from _magics_kit import shell_with_ampnb
from _magics_kit import shown as _shown
from IPython.core.error import UsageError
from IPython.utils.capture import capture_output

from ampnb.instruments import memory_meter


@pytest.fixture
def ip():
    yield from shell_with_ampnb()


@dataclasses.dataclass
class Output:
    logits: torch.Tensor
    hidden: tuple


class Net(torch.nn.Module):
    """Returns a dict, a dataclass or a tuple around the same Linear."""

    def __init__(self, lin: torch.nn.Module, kind: str) -> None:
        super().__init__()
        self.lin, self.kind = lin, kind

    def forward(self, x: torch.Tensor):
        h = self.lin(x)
        if self.kind == "dict":
            return {"logits": h, "hidden": (h.float(), x)}
        if self.kind == "dataclass":
            return Output(h, (h.float(), x))
        return h, (h.float(), x)


@pytest.mark.parametrize("kind, paths", [
    ("dict", ("out['logits']", "out['hidden'][0]", "out['hidden'][1]")),
    ("dataclass", ("out.logits", "out.hidden[0]", "out.hidden[1]")),
    ("tuple", ("out[0]", "out[1][0]", "out[1][1]")),
])
def test_structured_results_list_the_tensors_inside(ip, kind, paths):
    ip.user_ns["net"] = Net(ip.user_ns["lin"], kind)
    _, out = _amp(ip, "bf16-mixed -o r", "out = net(x)")
    made = {m.name: m for m in ip.user_ns["r"].made}
    result = ip.user_ns["out"]
    leaves = ([result["logits"], *result["hidden"]] if kind == "dict" else
              [result.logits, *result.hidden] if kind == "dataclass" else [result[0], *result[1]])
    for path, t in zip(paths, leaves):
        assert made[path].dtype == str(t.dtype)[6:] and made[path].shape == str(list(t.shape))
    assert made[paths[0]].dtype == "bfloat16" and made[paths[2]].dtype == "float32"
    assert "made no tensors" not in _shown(out) and paths[0] in _shown(out)


def test_a_model_output_lists_its_fields(ip):
    pytest.importorskip("transformers")
    from transformers.modeling_outputs import CausalLMOutput

    ip.user_ns["CausalLMOutput"] = CausalLMOutput
    _amp(ip, "bf16-mixed -o r", "out = CausalLMOutput(logits=lin(x))\nout")
    made = {m.name: m.dtype for m in ip.user_ns["r"].made}
    assert made["out.logits"] == made["Out.logits"] == "bfloat16"


def test_memory_reports_saved_activations_and_the_parameters_the_cell_ran(ip):
    cell = "y = lin(torch.relu(x))\nloss = y.float().square().sum()\nloss.backward()"
    _, out = _amp(ip, "bf16-mixed --memory -o r", cell)
    (m,) = [e for e in ip.user_ns["r"].extras if type(e).__name__ == "CellMemory"]
    lin, x = ip.user_ns["lin"], ip.user_ns["x"]
    with memory_meter() as ref, torch.autocast("cpu", dtype=torch.bfloat16):
        lin(torch.relu(x)).float().square().sum()
    assert m.peak_bytes == ref.peak_bytes > 0 and m.meter.tensors == ref.tensors
    params = sum(p.numel() * p.element_size() for p in lin.parameters())
    assert m.param_bytes == params and m.grad_bytes == params and m.param_dtypes == ("float32",)
    text = _shown(out)
    assert "saved for backward (peak)" in text and "parameters of the modules the cell ran" in text
    lin.zero_grad(set_to_none=True)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the message on a machine without CUDA")
def test_a_bad_line_changes_no_default(ip):
    from ampnb.magics.amp import AmpMagics

    (magics,) = [c for c in ip.configurables if isinstance(c, AmpMagics)]
    before = (magics.default_mode, magics.default_device, magics.default_tf32)
    for line in ("bf16-mixed --device cuda", "16-true --tf32 emulate --device gpu"):
        with pytest.raises(UsageError) as info:
            ip.run_line_magic("amp", line)
        assert "\n" not in str(info.value)
        assert (magics.default_mode, magics.default_device, magics.default_tf32) == before


def _run(ip, code):
    with capture_output() as out:
        result = ip.run_cell(code)
    return result, out.stdout + out.stderr


def test_a_syntax_error_shows_as_in_a_plain_cell(ip):
    plain, expected = _run(ip, "y = (1,\nz = 2 +")
    result, text = _run(ip, "%%amp bf16-mixed\ny = (1,\nz = 2 +")
    assert not result.success and not plain.success
    assert "SyntaxError" in text and "ampnb" not in text and "compile_cell" not in text
    # the same message and the same caret lines, only the cell's number differs
    strip = lambda s: [ln for ln in s.splitlines() if "Cell In[" not in ln]  # noqa: E731
    assert strip(text) == strip(expected)
    assert "y" not in ip.user_ns
