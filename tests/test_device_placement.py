"""The device follows the data, on a simulated CUDA machine: a CPU model gets CPU autocast.

torch.cuda.is_available() is patched to say yes and ampnb's device list holds a cuda:0, so the
code that chooses the device sees a GPU machine; the tensors stay on the CPU. Before the fix
`--device auto` meant "cuda when present": `%%amp bf16-mixed` on a CPU model ran under
autocast("cuda"), which lowers nothing on CPU tensors.
"""

from __future__ import annotations

import pytest
import torch
from IPython.core.error import UsageError
from torch import nn

from ampnb import putback_state
from ampnb.comparison import compare
from ampnb.device import place
from ampnb.instruments.memory import memory_report
from ampnb.workbench import Workbench
from tests._magics_kit import amp, shell_with_ampnb, shown

ip = pytest.fixture(shell_with_ampnb)
pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="simulates CUDA on a CPU machine")


def test_a_cpu_model_on_a_gpu_machine_is_lowered_and_the_caption_says_why(ip, gpu_machine):
    amp(ip, "bf16-mixed -o r", "y = lin(x)")
    run = ip.user_ns["r"]
    assert ip.user_ns["y"].dtype == torch.bfloat16  # CPU autocast ran: the linear was lowered
    assert run.device == "cpu"
    assert run.caption.startswith("%%amp bf16-mixed on cpu (where the parameters of lin are)")


def test_the_trace_sees_bf16_ops_on_the_cpu(ip, gpu_machine):
    _, out = amp(ip, "bf16-mixed --trace summary", "y = lin(x)")
    text = shown(out)
    assert "addmm" in text and "bfloat16" in text


def test_a_cell_with_only_tensors_runs_where_they_are(ip, gpu_machine):
    ip.user_ns["w"] = torch.randn(16, 4)
    _, out = amp(ip, "bf16-mixed", "z = x @ w")
    assert ip.user_ns["z"].dtype == torch.bfloat16
    assert "on cpu (where the tensors the cell uses (w, x) are)" in shown(out)


def test_a_module_without_parameters_leaves_the_choice_to_the_tensors(ip, gpu_machine):
    ip.user_ns.update(relu=torch.nn.ReLU(), w=torch.randn(16, 4))
    _, out = amp(ip, "bf16-mixed", "z = relu(x @ w)")
    assert ip.user_ns["z"].dtype == torch.bfloat16
    assert "on cpu (where the tensors the cell uses (w, x) are)" in shown(out)


def test_a_cell_that_makes_its_own_tensors_runs_on_torchs_default_device(ip, gpu_machine):
    _, out = amp(ip, "bf16-mixed", "z = torch.ones(2, 3) @ torch.ones(3, 2)")
    assert ip.user_ns["z"].dtype == torch.bfloat16
    assert "on cpu (torch's default device: the cell uses no model or tensor made before it)" \
        in shown(out)


def test_a_stated_device_that_disagrees_is_one_line_naming_both(ip, gpu_machine):
    before = putback_state.torch_state()
    for line in ("bf16-mixed --device cuda", "--compare bf16-mixed --device cuda:0"):
        with pytest.raises(UsageError, match=r"--device cuda.* but the parameters of lin are on "
                                             r"cpu; allowed: cpu") as info:
            ip.run_cell_magic("amp", line, "y = lin(x)")
        assert "\n" not in str(info.value) and "y" not in ip.user_ns
    assert putback_state.torch_state() == before


def test_a_stated_device_that_agrees_is_said(ip, gpu_machine):
    amp(ip, "bf16-mixed --device cpu -o r", "y = lin(x)")
    assert ip.user_ns["r"].why == "where the parameters of lin are; --device cpu agrees"


def test_compare_in_a_cell_lowers_the_cpu_model(ip, gpu_machine):
    amp(ip, "--compare bf16-mixed -r 1 -o c", "lin(x)")
    c = ip.user_ns["c"].comparison
    assert c.device == "cpu" and c.row("bf16-mixed").result_dtypes == ("bfloat16",)
    assert c.table().caption.startswith("on cpu (where the parameters of lin are)")


def test_compare_takes_the_models_device(gpu_machine):
    lin, x = torch.nn.Linear(8, 4), torch.randn(2, 8)
    c = compare(lambda: lin(x), ["bf16-mixed"], repeat=1, model=lin)
    assert c.device == "cpu" and c.row("bf16-mixed").result_dtypes == ("bfloat16",)
    assert c.why == "where the model's parameters are"
    with pytest.raises(ValueError, match="device=cuda but the model's parameters are on cpu"):
        compare(lambda: lin(x), ["bf16-mixed"], device="cuda", repeat=1, model=lin)


def _workbench_parts():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    batches = [(torch.randn(4, 8), torch.randint(0, 2, (4,)))]
    return model, opt, torch.nn.functional.cross_entropy, batches


def test_the_workbench_runs_where_the_model_is(gpu_machine):
    wb = Workbench(*_workbench_parts(), mode="bf16-mixed")
    assert str(wb.device) == "cpu" and wb.placement.why == "where the model's parameters are"
    assert wb.step().output_dtype == torch.bfloat16
    assert wb.table().caption == "Workbench steps, started on cpu (where the model's parameters are)"


def test_the_workbench_refuses_a_stated_device_the_model_is_not_on(gpu_machine):
    model, opt, loss_fn, batches = _workbench_parts()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match="device=cuda but the model's parameters are on cpu") as e:
        Workbench(model, opt, loss_fn, batches, device="cuda")
    assert "\n" not in str(e.value)
    assert all(p.device.type == "cpu" and torch.equal(p, b)
               for p, b in zip(model.parameters(), before))


def test_memory_report_runs_where_the_model_is(gpu_machine):
    model, opt, loss_fn, batches = _workbench_parts()
    report = memory_report(model, batches[0], loss_fn, modes=("32-true", "bf16-mixed"))
    assert report.device == "cpu"
    assert report.table().caption.endswith("on cpu (where the model's parameters are)")
    assert report.stats[1].saved_bytes < report.stats[0].saved_bytes  # bf16 activations saved
    with pytest.raises(ValueError, match="device=cuda but the model's parameters are on cpu"):
        memory_report(model, batches[0], loss_fn, device="cuda")


def test_place_without_a_gpu_machine():
    lin = torch.nn.Linear(2, 2)
    assert str(place([("the model's parameters", lin)])) == "cpu (where the model's parameters are)"
    assert place([("the model's parameters", torch.nn.Identity()), ("the batch", torch.ones(1))]
                 ).why == "where the batch are"
    with pytest.raises(ValueError, match="not available on this machine"):
        place([("the model's parameters", lin)], "cuda:3")


def test_run_distributed_runs_its_ranks_where_the_namespace_model_is(gpu_machine, monkeypatch):
    """run_distributed picked CUDA whenever present, though the namespace's model was on the CPU."""
    import ampnb.distributed.run as run_module

    picked = []

    class _Ran:
        ok = True

        def output(self) -> str:
            return ""

    monkeypatch.setattr(run_module, "launch",
                        lambda payload, nproc, device, timeout: picked.append(device) or _Ran())
    run_module.run_distributed("y = net(x)", 2, namespace={"net": nn.Linear(2, 2),
                                                         "x": torch.randn(1, 2)})
    run_module.run_distributed("y = 1", 2)  # no data: the ranks make theirs on CUDA's device
    assert picked == ["cpu", "cuda:0"]
