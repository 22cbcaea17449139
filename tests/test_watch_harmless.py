"""The watch never harms the run it observes: bad paths refused up front, a failed save a warning,
watches independent of each other, nothing of the user's run twice, no host read between
statistics steps, and `record.loss` the loss the loop computed (#33, #32)."""

from __future__ import annotations

import copy
import math
import warnings

import pytest
import torch
from torch import nn
from torch.overrides import TorchFunctionMode, _get_current_function_mode_stack
from watch_models import Blowup, Planted, batches, run

import ampnb
from ampnb.watchlog import read_log


def _opt(m):
    return torch.optim.AdamW(m.parameters(), lr=1e-2)


def _scaler():
    return torch.amp.GradScaler("cpu", init_scale=2.0**10)


# ----- paths ---------------------------------------------------------------------------------


def test_an_unwritable_keep_overflow_is_refused_when_the_watch_starts(tmp_path):
    (tmp_path / "file").write_text("x")
    m = Planted()
    opt = _opt(m)
    for bad in (tmp_path / "file" / "kept", "/proc/ampnb-none/kept"):
        with pytest.raises(ValueError) as e:
            ampnb.watch(m, opt, keep_overflow=bad)
        assert "\n" not in str(e.value) and "keep_overflow" in str(e.value)
    assert not m._forward_pre_hooks and not opt._optimizer_step_pre_hooks
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]  # nothing made


def test_a_failed_save_later_is_a_warning_and_the_run_goes_on(tmp_path, monkeypatch):
    from ampnb.watcher import overflow

    def broken(*args, **kwargs):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(overflow.torch, "save", broken)
    steps = batches(4, blow_at=1)
    m, ref = Planted(), Planted()
    with pytest.warns(UserWarning, match="could not save"):
        w = run(m, _opt(m), steps, scaler=_scaler(), watch={"keep_overflow": tmp_path / "k"})
    run(ref, _opt(ref), steps, scaler=_scaler())
    assert len(w.records) == 4 and w.records[1].skipped
    for p, q in zip(m.parameters(), ref.parameters(), strict=True):
        assert torch.equal(p, q)


def test_a_log_dir_that_is_a_file_is_refused_in_one_line(tmp_path):
    (tmp_path / "f").write_text("x")
    m = Planted()
    with pytest.raises(ValueError) as e:
        ampnb.watch(m, _opt(m), log_dir=tmp_path / "f")
    assert "\n" not in str(e.value) and "is a file" in str(e.value)


def test_a_second_run_in_one_log_dir_is_refused_not_merged(tmp_path):
    m = Planted()
    run(m, _opt(m), batches(2), watch={"log_dir": tmp_path})
    with pytest.raises(ValueError) as e:
        ampnb.watch(m, _opt(m), log_dir=tmp_path)
    assert "\n" not in str(e.value) and "already holds a run" in str(e.value)
    assert [r.step for r in read_log(tmp_path)] == [0, 1]
    assert not m._forward_pre_hooks


def test_a_corrupt_line_names_the_file_and_line(tmp_path):
    m = Planted()
    run(m, _opt(m), batches(3), watch={"log_dir": tmp_path})
    log = tmp_path / "records.jsonl"
    lines = log.read_text().splitlines(keepends=True)
    log.write_text(lines[0] + '{"step": 1, "loss": \n' + lines[2])
    with pytest.raises(ValueError) as e:
        read_log(tmp_path)
    assert "\n" not in str(e.value) and str(e.value).startswith(f"{log}:2: ")


# ----- independent watches -------------------------------------------------------------------


def test_two_watches_on_one_loop_are_independent_and_leave_nothing_behind():
    m, sc = Planted(), _scaler()
    opt = _opt(m)
    own = dict(vars(sc))
    a, b = ampnb.watch(m, opt, sc), ampnb.watch(m, opt, sc)
    steps = batches(4, blow_at=2)
    run(m, opt, steps[:2], scaler=sc)
    a.close()
    run(m, opt, steps[2:], scaler=sc)  # raised AttributeError inside scaler.update() before
    b.close()
    assert len(a.records) == 2 and len(b.records) == 4
    assert [r.skipped for r in b.records] == [False, False, True, False]
    assert [r.micro_batches for r in b.records] == [1] * 4
    assert _get_current_function_mode_stack() == []  # the mode that saw their backwards too
    assert set(vars(sc)) == set(own) and "scale" not in vars(sc) and "update" not in vars(sc)


def test_closing_one_watch_leaves_another_models_watch_recording():
    m1, m2 = Planted(), Planted(seed=1)
    s1, s2 = _scaler(), _scaler()
    o1, o2 = _opt(m1), _opt(m2)
    a, b = ampnb.watch(m1, o1, s1), ampnb.watch(m2, o2, s2)
    a.close()
    run(m2, o2, batches(2), scaler=s2)
    b.close()
    assert [r.micro_batches for r in b.records] == [1, 1]
    assert all(r.loss == r.loss for r in b.records)  # not nan


# ----- nothing runs twice ---------------------------------------------------------------------


class Counting(nn.Module):
    """Planted's layers, and Python state a second forward would advance: a counter and a list."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.blowup, self.fc2 = nn.Linear(8, 16), Blowup(), nn.Linear(16, 4)
        self.calls, self.seen = 0, []

    def forward(self, x: torch.Tensor, blow: bool = False) -> torch.Tensor:
        self.calls += 1
        self.seen.append(self.calls)
        scale = 1.0 + len(self.seen) * 1e-3  # the output depends on the state
        return self.fc2(self.blowup(self.fc1(x), blow) * scale)


@pytest.mark.parametrize("every", [1, 50])
def test_a_stateful_model_trains_bit_for_bit_as_unwatched(every):
    steps = batches(6, blow_at=2, micro=2)
    plain, watched = Counting(), Counting()
    run(plain, _opt(plain), steps, scaler=_scaler())
    w = run(watched, _opt(watched), steps, scaler=_scaler(), watch={"every": every})
    assert watched.seen == plain.seen
    for p, q in zip(watched.parameters(), plain.parameters(), strict=True):
        assert torch.equal(p, q)
    assert w.records[2].skipped and w.records[2].nonfinite
    if every == 1:  # a statistics step names the module from what the step itself produced
        assert w.records[2].first_module == "blowup"


# ----- one meaning of record.loss --------------------------------------------------------------


def test_the_loss_is_the_sum_of_what_the_loops_backward_started_from():
    """A loop dividing by its 4 micro-batches: the step's loss is their undivided mean."""
    m = Planted()
    opt, sc = _opt(m), _scaler()
    steps = batches(3, micro=4)
    expected = []
    with ampnb.watch(m, opt, sc) as w:
        for micro in steps:
            undivided = []
            for x, y, _ in micro:
                with torch.autocast("cpu", dtype=torch.float16):
                    loss = nn.functional.mse_loss(m(x).float(), y)
                undivided.append(loss.item())
                sc.scale(loss / len(micro)).backward()
            sc.step(opt)
            sc.update()
            opt.zero_grad()
            expected.append(sum(undivided) / len(undivided))
    assert [r.loss for r in w.records] == pytest.approx(expected, rel=1e-6)


# ----- no host read between statistics steps --------------------------------------------------


_READS = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__float__, torch.Tensor.__int__,
          torch.Tensor.__bool__, torch.Tensor.cpu, torch.Tensor.numpy}


class CountReads(TorchFunctionMode):
    """Counts the calls that bring a tensor's value to the host."""

    def __init__(self) -> None:
        super().__init__()
        self.reads = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.reads += func in _READS
        return func(*args, **(kwargs or {}))


def test_between_statistics_steps_the_watch_reads_nothing_back_from_the_device():
    """The reference is the same loop unwatched (AdamW reads its own step counters)."""
    steps = batches(5)

    def reads(watched: bool) -> tuple[int, ampnb.watcher.Watch | None]:
        m = Planted()
        opt, counter = _opt(m), CountReads()
        w = ampnb.watch(m, opt, every=5) if watched else None
        run(m, opt, steps[:1], dtype=torch.bfloat16)  # step 0: a statistics step
        with counter:
            run(m, opt, steps[1:], dtype=torch.bfloat16)
        return counter.reads, w
    plain, (seen, w) = reads(False)[0], reads(True)
    assert seen == plain
    assert len(w.records) == 5 and all(r.loss == r.loss for r in w.records)  # read now
    w.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_no_step_between_statistics_steps_synchronises():
    m = Planted().cuda()
    opt = _opt(m)
    x, y = torch.randn(4, 8, device="cuda"), torch.randn(4, 4, device="cuda")

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = nn.functional.mse_loss(m(x).float(), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
    with ampnb.watch(m, opt, every=10) as w:
        step()
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            for _ in range(8):
                step()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    assert len(w.records) == 9


def test_a_copy_of_the_run_without_a_watch_is_the_reference():
    """The tests' own reference: two unwatched runs of Counting are identical."""
    steps = batches(3, blow_at=1)
    a, b = Counting(), copy.deepcopy(Counting())
    run(a, _opt(a), steps, scaler=_scaler())
    run(b, _opt(b), steps, scaler=_scaler())
    with warnings.catch_warnings():
        for p, q in zip(a.parameters(), b.parameters(), strict=True):
            assert torch.equal(p, q)


# ----- compiled models -------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["torch.compile", "model.compile()", "a compiled block"])
def test_a_compiled_model_or_block_is_refused_in_one_line(how):
    m = Planted()
    opt = _opt(m)
    if how == "torch.compile":
        target = torch.compile(m)
    elif how == "model.compile()":
        target = m
        m.compile()  # compiles lazily: nothing is compiled until it runs
    else:
        target = m
        m.fc1 = torch.compile(m.fc1)
    with pytest.raises(ValueError) as e:
        ampnb.watch(target, opt)
    assert "\n" not in str(e.value) and "compiled" in str(e.value)
    assert not any(x._forward_pre_hooks for x in m.modules())


def test_a_skip_from_parameter_gradients_is_named_though_zero_grad_cleared_them():
    """A backward overflow in the layers' weight gradients: a statistics step names the module
    from the gradients as its backward left them (before the loop's zero_grad clears them): the
    last in forward order whose own gradients the loop itself finds non-finite."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 4))
    with torch.no_grad():
        m[0].weight.mul_(1e-3)  # huge inputs, ordinary activations: only m[0]'s weight
    opt, sc = torch.optim.SGD(m.parameters(), lr=1e-3), torch.amp.GradScaler("cpu")
    x = torch.randn(8, 16) * 1e3  # gradient, x^T g, overflows (and x needs no gradient)
    bad, amax = [], []
    with ampnb.watch(m, opt, sc) as w:
        for _ in range(2):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = m(x).float().pow(2).mean()
            sc.scale(loss).backward()
            bad.append([n for n, mod in m.named_children()
                        if not all(torch.isfinite(p.grad).all() for p in mod.parameters())])
            amax.append(max(float(p.grad.abs().nan_to_num(0.0, 0.0).amax())
                            for p in m[1].parameters()) / sc.get_scale())
            sc.step(opt)
            sc.update()
            opt.zero_grad(set_to_none=True)
    first = w.records[0]
    assert first.skipped and math.isfinite(first.loss) and bad[0] == ["0"]
    assert (first.first_module, first.first_phase) == (bad[0][-1], "backward")
    # the skipped step's gradient ranges, as its backward left them (unscaled)
    assert next(la for la in first.layers if la.module == "1").grad_amax == amax[0]
