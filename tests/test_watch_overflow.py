"""keep_overflow and ampnb.diagnosis.replay: the first overflowing step saved as it was before its
update, and rerun under the hunter to the same op and module as the hunter run by hand."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from watch_models import Blowup, Planted, batches, run

import ampnb
from ampnb.watcher.overflow import target

K = 2  # the planted step


def _opt(m):
    return torch.optim.AdamW(m.parameters(), lr=1e-2)


def _watched(tmp_path, steps, scaler=True):
    m = Planted()
    sc = torch.amp.GradScaler("cpu", init_scale=2.0**10) if scaler else None
    w = run(m, _opt(m), steps, scaler=sc, watch={"keep_overflow": tmp_path / "kept"})
    return w, m


def _hunt_by_hand(m, batch):
    x, y, blow = batch

    def step():
        with torch.autocast("cpu", dtype=torch.float16):
            out = m(x, blow=blow)
        out.float().sum().backward()
    return ampnb.find_nonfinite(step)


def test_the_first_skipped_step_is_kept_and_replay_names_the_hunters_op_and_module(tmp_path):
    steps = batches(5, blow_at=K, micro=2)
    steps[4][0] = (*steps[4][0][:2], True)  # a second overflow later: not the one kept
    w, _ = _watched(tmp_path, steps)
    assert [r.skipped for r in w.records] == [False, False, True, False, True]
    assert w.overflow_file == target(tmp_path / "kept") and w.overflow_file.is_file()
    data = torch.load(w.overflow_file, weights_only=True)
    assert data["step"] == K and len(data["inputs"]) == 2
    assert data["scale"] == w.records[K].scale and data["scaler"]["scale"] == data["scale"]
    assert data["autocast"] == [("cpu", "float16")]

    r = ampnb.diagnosis.replay(tmp_path / "kept", trust_pickled_model=True)  # the pickled model
    assert r.step == K and r.micro_batch == 0
    assert r.nonfinite and r.nonfinite.module == "blowup" == w.records[K].first_module
    by_hand = _hunt_by_hand(Planted(), steps[K][0])
    assert (r.nonfinite.op, r.nonfinite.module, r.nonfinite.phase) == (
        by_hand.op, by_hand.module, by_hand.phase) == ("mul", "blowup", "forward")
    assert "blowup" in repr(r) and "blowup" in r._repr_html_()


def test_the_kept_state_is_the_state_before_the_step(tmp_path):
    steps = batches(4, blow_at=K)
    w, _ = _watched(tmp_path, steps)
    data = torch.load(w.overflow_file, weights_only=True)
    ref = Planted()
    ref_opt = _opt(ref)
    run(ref, ref_opt, steps[:K], scaler=torch.amp.GradScaler("cpu", init_scale=2.0**10))
    for n, t in ref.state_dict().items():
        assert torch.equal(data["state_dict"][n], t), n
    ref_state = ref_opt.state_dict()["state"]
    for k, st in data["optimizer"]["state"].items():
        assert all(torch.equal(st[s], ref_state[k][s]) for s in st)


def test_the_rng_at_the_steps_first_forward_is_kept_and_replay_leaves_the_callers(tmp_path):
    steps = batches(4, blow_at=K)
    seen = []
    m = Planted()
    m.register_forward_pre_hook(lambda *_: seen.append(torch.get_rng_state()))
    run(m, _opt(m), steps, scaler=torch.amp.GradScaler("cpu", init_scale=2.0**10),
        watch={"keep_overflow": tmp_path / "k.pt"})
    data = torch.load(tmp_path / "k.pt", weights_only=True)
    assert torch.equal(data["rng"]["torch"], seen[K])
    fresh = Planted()  # (seeds torch) the test's hook made m unpicklable
    before = torch.get_rng_state()
    ampnb.diagnosis.replay(tmp_path / "k.pt", model=fresh)
    assert torch.equal(torch.get_rng_state(), before)


def test_a_model_that_cannot_be_pickled_is_replayed_into_a_fresh_instance(tmp_path):
    class Local(Planted):  # a local class: pickle cannot find it again
        pass

    steps = batches(4, blow_at=K)
    m = Local()
    run(m, _opt(m), steps, scaler=torch.amp.GradScaler("cpu", init_scale=2.0**10),
        watch={"keep_overflow": tmp_path})
    with pytest.raises(ValueError, match="pass model=") as e:
        ampnb.diagnosis.replay(tmp_path, trust_pickled_model=True)
    assert "\n" not in str(e.value)
    fresh = Local(seed=7)
    r = ampnb.diagnosis.replay(tmp_path, model=fresh)
    assert r.nonfinite.module == "blowup" and r.nonfinite.op == "mul"
    saved = torch.load(target(tmp_path), weights_only=True)["state_dict"]
    assert all(torch.equal(fresh.state_dict()[n], t) for n, t in saved.items())


def test_without_a_scaler_the_first_nonfinite_step_is_kept_before_its_update(tmp_path):
    steps = batches(4, blow_at=K)
    w, m = _watched(tmp_path, steps, scaler=False)
    assert w.records[K].nonfinite and not w.records[K].skipped
    assert not all(torch.isfinite(p).all() for p in m.parameters())  # the update spread NaN
    data = torch.load(w.overflow_file, weights_only=True)
    assert data["step"] == K and data["scale"] is None
    ref = Planted()
    run(ref, _opt(ref), steps[:K])
    assert all(torch.equal(data["state_dict"][n], t) for n, t in ref.state_dict().items())
    r = ampnb.diagnosis.replay(w.overflow_file, Planted(seed=3))
    assert (r.nonfinite.op, r.nonfinite.module) == ("mul", "blowup")


def test_nothing_is_kept_without_an_overflow(tmp_path):
    w, _ = _watched(tmp_path, batches(3))
    assert w.overflow_file is None and not (tmp_path / "kept").exists()


@pytest.mark.parametrize("path", [3, "missing"])
def test_replay_of_what_is_not_a_kept_step_is_one_line(tmp_path, path):
    with pytest.raises(ValueError) as e:
        ampnb.diagnosis.replay(path if path == 3 else tmp_path / path, Planted())
    assert "\n" not in str(e.value) and "keep_overflow" in str(e.value)


def test_the_report_is_the_doctor_on_the_kept_batch(tmp_path):
    class WithLoss(nn.Module):  # returns its own loss, as a transformers model does
        def __init__(self):
            super().__init__()
            self.net = Planted()

        def forward(self, x, blow=False):
            return self.net(x, blow).float().pow(2).mean()

    steps = batches(3, blow_at=1)
    m = WithLoss()
    opt = _opt(m)
    sc = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    with ampnb.watch(m, opt, sc, keep_overflow=tmp_path):
        for (x, _, blow), in steps:
            with torch.autocast("cpu", dtype=torch.float16):
                loss = m(x, blow=blow)
            sc.scale(loss).backward()
            sc.step(opt)
            sc.update()
            opt.zero_grad()
    r = ampnb.diagnosis.replay(tmp_path, model=WithLoss())
    assert r.nonfinite.module == "net.blowup"
    report = r.report
    assert report is r.report  # computed once
    assert type(report).__name__ == "DoctorReport"


class Wide(nn.Module):
    """Planted with 1024 outputs: a mean loss sends small gradients into them, while a sum of
    the outputs at the same loss scale would overflow fp16 in the last layer's backward."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.blowup, self.fc2 = nn.Linear(8, 16), Blowup(), nn.Linear(16, 1024)

    def forward(self, x: torch.Tensor, blow: bool = False) -> torch.Tensor:
        return self.fc2(self.blowup(self.fc1(x), blow))


def test_replay_runs_the_users_loss_on_the_micro_batch_that_overflowed(tmp_path):
    g = torch.Generator().manual_seed(3)
    steps = [[(torch.randn(4, 8, generator=g), torch.randn(4, 1024, generator=g),
               k == 1 and j == 2) for j in range(3)] for k in range(3)]
    m = Wide()
    sc = torch.amp.GradScaler("cpu", init_scale=2.0**15)
    w = run(m, _opt(m), steps, scaler=sc, watch={"keep_overflow": tmp_path})
    assert [r.skipped for r in w.records] == [False, True, False]
    r = ampnb.diagnosis.replay(tmp_path, Wide())
    assert r.micro_batch == 2  # the user's own loss: micro-batches 0 and 1 stay finite
    assert (r.nonfinite.op, r.nonfinite.module, r.nonfinite.phase) == ("mul", "blowup",
                                                                       "forward")
