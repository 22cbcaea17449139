"""ampnb.watch on a plain torch.amp loop: same weights as without it, records checked against
what the loop itself shows (the scaler, the loss, the gradients read by hand)."""

from __future__ import annotations

import importlib.util
import math

import pytest
import torch
from torch import nn
from watch_models import Planted, batches, run

import ampnb
from ampnb.watchlog import read_log


def _pair(**kw):
    m = Planted()
    return m, torch.optim.AdamW(m.parameters(), lr=1e-2, **kw)


def _plain_losses(steps, scaler, dtype=torch.float16):
    """(loss per step, scale per step, skipped per step) of the loop without a watch."""
    m, opt = _pair()
    losses, scales, skipped = [], [], []
    torch.manual_seed(0)
    for micro in steps:
        total = 0.0
        for x, y, blow in micro:
            with torch.autocast("cpu", dtype=dtype):
                out = m(x, blow=blow)
                loss = nn.functional.mse_loss(out.float(), y) / len(micro)
            total += float(loss.detach())
            (scaler.scale(loss) if scaler else loss).backward()
        losses.append(total)  # the step's loss: the sum of what backward started from
        if scaler:
            scales.append(scaler.get_scale())
            scaler.step(opt)
            scaler.update()
            skipped.append(scaler.get_scale() < scales[-1])
        else:
            opt.step()
        opt.zero_grad(set_to_none=True)
    return losses, scales, skipped


@pytest.mark.parametrize("dtype, scaled, micro", [(torch.float16, True, 1),
                                                  (torch.float16, True, 3),
                                                  (torch.bfloat16, False, 2)])
def test_weights_are_bit_identical_with_and_without_the_watch(dtype, scaled, micro):
    steps = batches(6, blow_at=2 if scaled else None, micro=micro)
    got = {}
    for watched in (False, True):
        m, opt = _pair()
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10) if scaled else None
        run(m, opt, steps, dtype=dtype, scaler=scaler, watch={"every": 2} if watched else None)
        got[watched] = (m, opt, scaler)
    (m0, o0, s0), (m1, o1, s1) = got[False], got[True]
    for (n, a), b in zip(m0.named_parameters(), m1.parameters()):
        assert torch.equal(a, b), n
    for a, b in zip(o0.state.values(), o1.state.values()):
        assert all(torch.equal(a[k], b[k]) for k in a)
    if scaled:
        assert s0.get_scale() == s1.get_scale()


def test_records_match_the_loop_loss_scale_and_skips():
    steps = batches(6, blow_at=3, micro=2)
    ref_loss, ref_scale, ref_skip = _plain_losses(
        steps, torch.amp.GradScaler("cpu", init_scale=2.0**10))
    m, opt = _pair()
    w = run(m, opt, steps, scaler=torch.amp.GradScaler("cpu", init_scale=2.0**10),
            watch={"every": 1})
    recs = w.records
    assert [r.step for r in recs] == list(range(6))
    assert [r.micro_batches for r in recs] == [2] * 6
    assert [r.scale for r in recs] == ref_scale
    assert [r.skipped for r in recs] == ref_skip == [k == 3 for k in range(6)]
    for r, want in zip(recs, ref_loss):
        assert r.loss == pytest.approx(want, rel=1e-6, nan_ok=True)
    planted = recs[3]
    assert planted.nonfinite and planted.first_module == "blowup"
    assert planted.first_phase == "forward"
    assert recs[4].scale == planted.scale * 0.5  # backoff_factor halves it
    assert not any(r.nonfinite for k, r in enumerate(recs) if k != 3)
    assert all(r.first_module == "" for k, r in enumerate(recs) if k != 3)


def test_without_a_scaler_a_nonfinite_step_is_recorded_not_skipped():
    steps = batches(4, blow_at=1)
    m, opt = _pair()
    w = run(m, opt, steps, dtype=torch.float16, watch={})
    r = w.records[1]
    assert r.scale is None and not r.has_scaler and not r.skipped
    assert r.nonfinite and r.first_module == "blowup" and r.first_phase == "forward"
    assert not w.records[0].nonfinite


def test_layer_statistics_match_what_the_loop_reads_itself():
    """act amax from a forward hook of the test's own, the output gradient via retain_grad,
    parameter gradients after the user's unscale_, fp16 flush from torch's own cast."""
    torch.manual_seed(0)
    m, opt = _pair()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12)
    seen = {}
    m.fc1.register_forward_hook(lambda mod, a, out: seen.__setitem__("act", out.detach()))
    with ampnb.watch(m, opt, scaler, every=2) as w:
        want = []
        for (x, y, _), in batches(4):
            with torch.autocast("cpu", dtype=torch.float16):
                out = m(x)
                out.retain_grad()
                loss = nn.functional.mse_loss(out.float(), y)
            scale = scaler.get_scale()
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            g = m.fc1.weight.grad
            nz = torch.cat([g.flatten(), m.fc1.bias.grad.flatten()])
            nz = nz[nz != 0]
            want.append(dict(act=float(seen["act"].abs().max()),
                             act_grad=float(out.grad.abs().max()) / scale,
                             grad=max(float(g.abs().max()), float(m.fc1.bias.grad.abs().max())),
                             flush=float((nz.half() == 0).float().mean())))
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)
    for r, ref in zip(w.records, want):
        if r.step % 2:
            assert r.layers == ()
            continue
        layers = {s.module: s for s in r.layers}
        assert set(layers) == {"fc1", "blowup", "act", "drop", "fc2"}  # leaves and own params
        assert layers["fc1"].act_amax == ref["act"]
        assert layers["fc2"].act_grad_amax == pytest.approx(ref["act_grad"], rel=1e-6)
        assert layers["fc1"].grad_amax == ref["grad"]
        assert layers["fc1"].fp16_flush == pytest.approx(ref["flush"])
        assert math.isnan(layers["act"].grad_amax)  # no parameters of its own
        assert layers["fc1"].headroom("act", "fp16") == pytest.approx(
            math.log2(torch.finfo(torch.float16).max / ref["act"]))


def test_a_fused_optimizer_reads_scaled_gradients_and_the_record_unscales_them():
    """GradScaler steps a fused Adam without unscale_ (as Lightning does): the gradients the
    watch reads are scaled, and the record divides them by the scale."""
    grads = {}
    for scale in (2.0**4, 2.0**10):
        m = Planted()
        opt = torch.optim.Adam(m.parameters(), lr=1e-2, fused=True)
        assert opt._step_supports_amp_scaling
        w = run(m, opt, batches(1), scaler=torch.amp.GradScaler("cpu", init_scale=scale),
                watch={})
        grads[scale] = {s.module: s.grad_amax for s in w.records[0].layers}
    assert grads[2.0**4]["fc1"] == pytest.approx(grads[2.0**10]["fc1"], rel=1e-3)
    assert grads[2.0**4]["fc1"] < 1  # unscaled: the scaled ones are 2**4 and 2**10 times this


def test_true_mode_lost_updates_match_a_plain_loop():
    def losses(watched):
        torch.manual_seed(0)
        m = nn.Linear(64, 64).half()
        opt = torch.optim.SGD(m.parameters(), lr=1e-4)
        w = ampnb.watch(m, opt) if watched else None
        shares = []
        for k in range(3):
            x = torch.randn(8, 64, generator=torch.Generator().manual_seed(k)).half()
            m(x).float().pow(2).mean().backward()
            before = [(p, p.detach().clone(), p.grad != 0) for p in m.parameters()]
            opt.step()
            lost = sum(int((mv & (p == b)).sum()) for p, b, mv in before)
            shares.append(lost / sum(int(mv.sum()) for _, _, mv in before))
            opt.zero_grad()
        if w:
            w.close()
            return [r.lost_updates for r in w.records], m
        return shares, m
    want, m0 = losses(False)
    got, m1 = losses(True)
    assert torch.equal(m0.weight, m1.weight)
    assert 0 < want[0] < 1  # tiny lr: some updates are below half an ulp
    assert got == pytest.approx(want)


def test_mixed_mode_has_no_lost_updates_figure():
    m, opt = _pair()
    w = run(m, opt, batches(2), dtype=torch.bfloat16, watch={})
    assert all(r.lost_updates is None for r in w.records)


def _json(records):
    return [r.to_json() for r in records]


def test_log_dir_holds_the_records_and_callbacks_get_each(tmp_path):
    m, opt = _pair()
    got = []
    w = ampnb.watch(m, opt, every=3, log_dir=tmp_path)
    w.on_record(got.append)
    with w:
        for (x, y, _), in batches(4):
            nn.functional.mse_loss(m(x), y).backward()
            opt.step()
            opt.zero_grad()
    assert _json(w.records) == _json(got) == _json(read_log(tmp_path))  # nan != nan in ==
    assert (tmp_path / "records.jsonl").is_file()
    if importlib.util.find_spec("tensorboard") is not None:  # the optional extra: also events
        assert list(tmp_path.glob("events.out.tfevents*"))
    assert [bool(r.layers) for r in got] == [True, False, False, True]


def test_log_loss_replaces_what_backward_saw():
    m, opt = _pair()
    with ampnb.watch(m, opt) as w:
        (x, y, _), = batches(1)[0]
        nn.functional.mse_loss(m(x), y).backward()
        w.log_loss(torch.tensor(7.0))
        opt.step()
    assert w.records[0].loss == 7.0


def test_wrapped_optimizers_and_ddp_names(tmp_path):
    from lightning.pytorch.core.optimizer import LightningOptimizer

    class AcceleratedOptimizer(torch.optim.Optimizer):  # Accelerate's shape: .optimizer inside
        def __init__(self, optimizer):
            self.optimizer = optimizer

    m, opt = _pair()
    for wrapped in (LightningOptimizer(opt), AcceleratedOptimizer(opt)):
        with ampnb.watch(m, wrapped) as w:
            (x, y, _), = batches(1)[0]
            nn.functional.mse_loss(m(x), y).backward()
            opt.step()  # the hooks sit on the optimizer inside
            opt.zero_grad()
        assert len(w.records) == 1
    dist = torch.distributed
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1)
    try:
        ddp = nn.parallel.DistributedDataParallel(m)
        with ampnb.watch(ddp, opt, log_dir=tmp_path / "log") as w:
            (x, y, _), = batches(1)[0]
            nn.functional.mse_loss(ddp(x), y).backward()
            opt.step()
    finally:
        dist.destroy_process_group()
    assert {s.module for s in w.records[0].layers} == {"fc1", "blowup", "act", "drop", "fc2"}
    assert (tmp_path / "log" / "rank0" / "records.jsonl").is_file()
    assert _json(read_log(tmp_path / "log")) == _json(w.records)


def _bad_cases():
    m, opt = _pair()
    other = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=1)
    return {
        "no parameters": ((nn.ReLU(), opt), {}, "no parameters"),
        "not a module": (("model", opt), {}, "model="),
        "not an optimizer": ((m, "adam"), {}, "optimizer="),
        "other parameters": ((m, other), {}, "not this model's parameters"),
        "scaler": ((m, opt, object()), {}, "scaler="),
        "every=0": ((m, opt), {"every": 0}, "every=0"),
        "every=True": ((m, opt), {"every": True}, "every=True"),
        "every=1.5": ((m, opt), {"every": 1.5}, "every=1.5"),
        "keep_overflow": ((m, opt), {"keep_overflow": 3}, "keep_overflow=3"),
        "log_dir": ((m, opt), {"log_dir": 3}, "log_dir=3"),
        "compiled": ((torch.compile(m), opt), {}, "torch.compile"),
    }


@pytest.mark.parametrize("case", list(_bad_cases()))
def test_bad_input_is_one_line_and_touches_nothing(case):
    args, kwargs, says = _bad_cases()[case]
    model = args[0]
    before = dict(model._forward_hooks) if isinstance(model, nn.Module) else None
    with pytest.raises(ValueError) as e:
        ampnb.watch(*args, **kwargs)
    msg = str(e.value)
    assert says in msg and "\n" not in msg and "allowed" in msg
    if before is not None:
        assert dict(model._forward_hooks) == before
    if len(args) > 2 or isinstance(args[1], torch.optim.Optimizer):
        opt = args[1]
        assert not opt._optimizer_step_pre_hooks and not opt._optimizer_step_post_hooks


def test_ampnb_watch_is_callable_however_it_was_reached():
    import ampnb.watchlog.records  # noqa: F401 - importing a submodule sets the attribute

    m, opt = _pair()
    with ampnb.watch(m, opt) as w:
        pass
    assert isinstance(w, ampnb.watcher.Watch)


def test_a_backward_overflow_names_the_module_the_hunter_names_on_stats_steps():
    """Tiny activations into `b`, whose huge weights overflow fp16 gradients in backward only:
    on a stats step the watch names the module whose backward made the inf, as the hunter does;
    between stats steps it says the step went non-finite and names nothing (no rerun)."""
    from doctor_models import BackwardOverflow

    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(0))

    def step(m, scale):
        with torch.autocast("cpu", dtype=torch.float16):
            loss = m(x).float().pow(2).mean()
        (loss * scale).backward()

    m = BackwardOverflow()
    hunted = ampnb.find_nonfinite(step, m, 2.0**16)
    m = BackwardOverflow()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    with ampnb.watch(m, opt, scaler, every=2) as w:
        for _ in range(2):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = m(x).float().pow(2).mean()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
    first, second = w.records
    assert hunted.phase == "backward"
    assert first.skipped and (first.first_module, first.first_phase) == (hunted.module,
                                                                          "backward")
    assert second.skipped and second.nonfinite
    assert (second.first_module, second.first_phase) == ("", "")
