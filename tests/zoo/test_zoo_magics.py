"""%%amp on every zoo model in a real InteractiveShell: modes, --compare, instruments, -o."""

from __future__ import annotations

import copy

import pytest
import torch
from IPython.core.interactiveshell import InteractiveShell
from IPython.utils.capture import capture_output
from zoo_models import Case

from ampnb import putback_state
from ampnb._tree import named_tensors
from ampnb.batch import as_batch, step_loss
from ampnb.display import dtype_name
from ampnb.instruments import memory_meter

FORWARD = "out = model(*args, **kwargs)"
TRAIN = """\
def train_step():
    opt.zero_grad()
    loss = step_loss(model(*args, **kwargs), batch, loss_fn)
    loss.backward()
    opt.step()
    return loss
"""


@pytest.fixture
def ip(case: Case):
    shell = InteractiveShell.instance()
    shell.run_line_magic("load_ext", "ampnb")
    batch = as_batch(case.batch, case.loss_fn)
    names = set(shell.user_ns)
    shell.user_ns.update(torch=torch, model=case.model, opt=case.optimizer(), batch=batch,
                         args=batch.args, kwargs=dict(batch.kwargs), loss_fn=case.loss_fn,
                         step_loss=step_loss)
    assert shell.run_cell(TRAIN).success
    before = putback_state.torch_state()
    yield shell
    shell.run_line_magic("unload_ext", "ampnb")
    for name in set(shell.user_ns) - names:
        del shell.user_ns[name]
    assert putback_state.torch_state() == before


def _onednn_refuses(error: BaseException) -> bool:
    """oneDNN has no LSTM kernel for a low dtype on some CPUs (a torch limit, CPU-dependent)."""
    return isinstance(error, RuntimeError) and "primitive" in str(error)


def _amp_or_skip(ip, case, line, cell=FORWARD):
    try:
        return _amp(ip, line, cell)
    except RuntimeError as e:
        if case.name == "lstm" and _onednn_refuses(e):
            pytest.skip(f"oneDNN refuses nn.LSTM under {line} on this CPU")
        raise


def _amp(ip, line, cell=FORWARD):
    with capture_output() as out:
        ip.run_cell_magic("amp", line + " -o r", cell)
    return ip.user_ns["r"], out.stdout + "".join(o.data.get("text/plain", "") for o in out.outputs)


def _reported_match_outputs(ip, run):
    """Every tensor of `out` is in the report with its own dtype and shape."""
    made = {m.name: m for m in run.made}
    found = named_tensors(ip.user_ns["out"], "out")
    assert found
    for path, t in found:
        assert (made[path].dtype, made[path].shape) == (dtype_name(t.dtype), str(list(t.shape)))
    return {dtype_name(t.dtype) for _, t in found if t.is_floating_point()}


def _state_dict(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _unchanged(model, start):
    now = model.state_dict()
    assert now.keys() == start.keys()
    for k, v in start.items():
        assert now[k].dtype == v.dtype and torch.equal(now[k], v), k


@pytest.mark.parametrize("mode", ["32-true", "bf16-mixed", "bf16-true", "64-true"])
def test_each_cpu_mode_runs_a_forward_and_reports_its_dtypes(ip, case, mode):
    run, text = _amp_or_skip(ip, case, f"{mode} --tf32 emulate" if mode == "32-true" else mode)
    dtypes = _reported_match_outputs(ip, run)
    if mode == "bf16-mixed":
        assert "bfloat16" in dtypes  # the head is a Linear: autocast lowers it
    else:  # the model was made before the cell: it keeps fp32, and the report says so
        assert dtypes == {"float32"}
    if mode in ("bf16-true", "64-true"):
        assert any("keep their dtype" in n for n in run.notes)
    if mode == "32-true":
        assert run.tf32 == "emulated" and any("TF32 emulated" in n for n in run.notes)
    assert run.mode in text


def test_fp16_modes_on_every_model(ip, case):
    # fp16 products run in ampnb's emulated kernels on a CPU without fp16 units: fp32 speed
    c = _amp(ip, "--compare 16-mixed,16-true -r 1")[0].comparison
    for mode, dtype in (("16-mixed", "float16"), ("16-true", "float16")):
        row = c.row(mode)
        if row.failed:  # oneDNN may refuse fp16 LSTM kernels on this CPU: the row says why
            assert case.name == "lstm" and row.note.startswith("failed: ")
        else:
            assert dtype in row.result_dtypes and row.max_abs_error > 0


def test_compare_a_forward_and_a_train_step_leave_the_model_as_it_was(ip, case):
    model, opt = ip.user_ns["model"], ip.user_ns["opt"]
    start = _state_dict(model)
    c = _amp(ip, "--compare 32-true,bf16-mixed -r 1")[0].comparison
    assert c.labels == ("32-true", "bf16-mixed")
    assert "float32" in c.reference.result_dtypes and "bfloat16" not in c.reference.result_dtypes
    row = c.row("bf16-mixed")
    if row.failed:  # only where oneDNN refuses bf16 LSTM kernels: the row says so in one line
        assert case.name == "lstm" and row.note.startswith("failed: RuntimeError: could not")
    else:
        assert "bfloat16" in row.result_dtypes and row.max_abs_error > 0
    _unchanged(model, start)
    run, text = _amp(ip, "--compare bf16-mixed -r 1", "train_step()")
    row = run.comparison.row("bf16-mixed")
    assert row.failed or (row.result_dtypes == ("float32",) and row.max_abs_error >= 0)  # loss
    _unchanged(model, start)
    assert not opt.state and all(p.grad is None for p in model.parameters())
    assert model.training and "out" not in ip.user_ns and "restored" in text


def test_instruments_and_show_code_on_a_forward(ip, case):
    model = ip.user_ns["model"]
    run, text = _amp_or_skip(ip, case, "bf16-mixed --hunt --memory --show-code")
    kinds = {type(e).__name__: e for e in run.extras}
    hunt, memory = kinds["NonFinite"], kinds["CellMemory"]
    assert hunt.ops_checked > 0 and not hunt, hunt.message  # a healthy model: nothing to blame
    with memory_meter() as ref, torch.autocast("cpu", dtype=torch.bfloat16):
        model(*ip.user_ns["args"], **ip.user_ns["kwargs"])
    assert memory.peak_bytes == ref.peak_bytes > 0
    assert memory.param_bytes == sum(p.numel() * p.element_size() for p in model.parameters())
    assert 'torch.autocast(device_type="cpu", dtype=torch.bfloat16)' in run.code
    assert "bfloat16" in _reported_match_outputs(ip, run)
    assert "saved for backward (peak)" in text


def test_trace_shows_the_ops_that_ran_in_bf16(ip, case):
    run, text = _amp_or_skip(ip, case, "bf16-mixed --trace")
    (trace,) = [e for e in run.extras if type(e).__name__ == "OpTrace"]
    low = [row for row in trace.rows if row.output_dtype == "bfloat16"]
    assert low and any(row.cast for row in low)
    assert "bfloat16" in _reported_match_outputs(ip, run) and "ran in lower precision" in text


def test_a_single_train_step_under_bf16_mixed_is_torchs_recipe(ip, case):
    model = ip.user_ns["model"]
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    batch = ip.user_ns["batch"]
    torch.manual_seed(0)
    try:  # torch's recipe: autocast around forward and loss; backward and step outside
        ref_opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = step_loss(batch.call(ref), batch, ip.user_ns["loss_fn"])
        loss.backward()
        ref_opt.step()
    except RuntimeError as e:
        if case.name == "lstm" and _onednn_refuses(e):
            pytest.skip("oneDNN refuses nn.LSTM under bf16 autocast on this CPU")
        raise
    torch.manual_seed(0)
    _amp(ip, "bf16-mixed", "train_step()")
    for (k, a), b in zip(model.state_dict().items(), ref.state_dict().values()):
        assert torch.equal(a, b), k
