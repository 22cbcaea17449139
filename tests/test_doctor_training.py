"""Answers that hold over training: a true mode's multi-step check, its lost updates, train=False."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import math

import pytest
import torch
from doctor_models import Embedded, ForwardOverflow, Plain, data, sum_loss, token_data
from torch import nn

from ampnb.batch import as_batch
from ampnb.diagnosis.candidates import candidate
from ampnb.diagnosis.evidence import ModeRow
from ampnb.diagnosis.recommend import TRUE_MODES, Tolerance, choose, needs_check
from ampnb.diagnosis.run import Setup
from ampnb.diagnosis.training import (
    LOST_MAX,
    inference_check,
    peak_lrs,
    reference_check,
    train_check,
)
from ampnb.start import started

CE = nn.functional.cross_entropy
TOL = Tolerance()


@contextlib.contextmanager
def setup_for(model, opt, batch, loss_fn):
    with started(model, opt) as start:
        yield Setup(start, as_batch(batch, loss_fn), loss_fn, "cpu")


def one_weight(lr: float):
    """A bias-free Linear(1, 1) holding 1.0 and a batch whose gradient for it is exactly 1."""
    lin = nn.Linear(1, 1, bias=False)
    with torch.no_grad():
        lin.weight.fill_(1.0)
    return lin, torch.optim.SGD(lin.parameters(), lr=lr), (torch.ones(1, 1), torch.zeros(1))


def test_true_modes_are_the_ones_whose_optimizer_steps_narrow_weights():
    assert {"16-true", "bf16-true"} <= TRUE_MODES
    assert not {"32-true", "16-mixed", "bf16-mixed", "64-true", "apex-O2"} & TRUE_MODES


@pytest.mark.parametrize("lr, lost", [(1e-4, 1.0), (1e-2, 0.0)])
def test_lost_share_matches_bf16_rounding_by_hand(lr, lost):
    """SGD on a bf16 weight of 1.0 with gradient 1: an update of 1e-4 is under half a unit in
    the last place (torch's own cast leaves 1 - 1e-4 at 1.0), 1e-2 is not."""
    w = torch.tensor(1.0)
    assert ((w - lr).bfloat16() == w.bfloat16()) == (lost == 1.0)  # torch's cast says which
    assert (w - lr) != w                                             # fp32 moves either way
    model, opt, batch = one_weight(lr)
    plain = copy.deepcopy(model).bfloat16()  # a plain bf16 loop: does the weight move?
    p_opt = torch.optim.SGD(plain.parameters(), lr=lr)
    moved = []
    for _ in range(6):
        before = plain.weight.detach().clone()
        p_opt.zero_grad()
        sum_loss(plain(batch[0].bfloat16()), None).backward()
        p_opt.step()
        moved.append(bool((plain.weight != before).all()))
    with setup_for(model, opt, batch, sum_loss) as setup:
        check = train_check(setup, candidate("bf16-true", "cpu"), 6)
    assert check.lost == lost == 1.0 - sum(moved) / len(moved)
    assert check.lost_by_param == {"weight": lost} and check.lrs == (lr,)
    assert check.ok() == (lost <= LOST_MAX)
    assert model.weight.item() == 1.0 and not opt.state  # the user's objects untouched


def test_a_warmup_scheduler_is_checked_at_its_peak():
    """Warm-up from 1% of lr: lr now is 1e-4 (lost in bf16); the check runs at the peak 1e-2."""
    model, opt, batch = one_weight(1e-2)
    sched = torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.01, total_iters=10)
    assert opt.param_groups[0]["lr"] == pytest.approx(1e-4)
    with setup_for(model, opt, batch, sum_loss) as setup:
        now = train_check(setup, candidate("bf16-true", "cpu"), 3)
        peak = train_check(setup, candidate("bf16-true", "cpu"), 3, scheduler=sched)
    assert now.lost == 1.0 and now.lrs == (pytest.approx(1e-4),)
    assert peak.lost == 0.0 and peak.lrs == (pytest.approx(1e-2),)


def test_peak_lr_is_the_largest_the_scheduler_reaches():
    """OneCycleLR starts below max_lr; stepping a copy of it (torch's own schedule) finds the peak."""
    def make():
        opt = torch.optim.SGD(Plain().parameters(), lr=0.1)
        return opt, torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.3, total_steps=20)

    opt, sched = make()
    seen_opt, seen = make()
    lrs = []
    for _ in range(20):
        lrs.append(seen_opt.param_groups[0]["lr"])
        seen_opt.step()
        seen.step()
    assert peak_lrs(opt, sched) == (pytest.approx(max(lrs)),)
    assert peak_lrs(opt) == (pytest.approx(opt.param_groups[0]["lr"]),)
    other, _ = make()
    with pytest.raises(ValueError, match="scheduler=OneCycleLR"):
        peak_lrs(other, sched)


@pytest.fixture(scope="module")
def embedded():
    """Embedding + Linear under AdamW(lr=1e-3): 24 steps of bf16-true and of bf16-mixed."""
    model = Embedded()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with setup_for(model, opt, token_data(), CE) as setup:
        ref = reference_check(setup)
        return {m: train_check(setup, candidate(m, "cpu"), reference=ref)
                for m in ("bf16-true", "bf16-mixed", "16-true")}


def test_embedding_model_loses_its_updates_in_bf16_true(embedded):
    check = embedded["bf16-true"]
    assert check.finite and check.lost > LOST_MAX and not check.ok()
    assert check.worst[0] == "emb.weight" and check.lost_by_param["emb.weight"] > LOST_MAX
    assert "emb.weight" in check.summary and f"{check.lost:.1%}" in check.summary
    mixed = embedded["bf16-mixed"]
    assert mixed.ok() and mixed.lost == 0.0  # fp32 weights take every update
    assert mixed.reference_losses == check.reference_losses
    fp16 = embedded["16-true"]  # AdamW's eps=1e-8 is 0 in fp16 (torch's cast says so)
    assert float(torch.tensor(1e-8, dtype=torch.float16)) == 0
    assert not fp16.ok() and "inf/NaN" in fp16.summary and "eps=1e-08 is 0 in fp16" in fp16.summary


def test_first_step_lost_share_against_a_plain_adamw_step():
    """One step by hand: a bf16 model under AdamW, and an fp32 AdamW stepped from the same
    weights and gradients; lost = nonzero fp32 updates the bf16 step did not take."""
    ids, y = token_data()
    net = Embedded().bfloat16()
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    CE(net(ids).float(), y).backward()
    wide = [nn.Parameter(p.detach().float()) for p in net.parameters()]
    for w, p in zip(wide, net.parameters()):
        w.grad = p.grad.float()
    before = [p.detach().clone() for p in net.parameters()]
    torch.optim.AdamW(wide, lr=1e-3).step()
    opt.step()
    wanted = [w.detach() != b.float() for w, b in zip(wide, before)]
    lost = sum(int((m & (p.detach() == b)).sum()) for m, p, b in zip(wanted, net.parameters(), before))
    share = lost / sum(int(m.sum()) for m in wanted)
    model = Embedded()
    with setup_for(model, torch.optim.AdamW(model.parameters(), lr=1e-3), (ids, y), CE) as setup:
        check = train_check(setup, candidate("bf16-true", "cpu"), 1)
    assert check.lost == share and share > LOST_MAX


def test_32_true_against_itself_loses_nothing():
    model = Embedded()
    with setup_for(model, torch.optim.AdamW(model.parameters(), lr=1e-3), token_data(), CE) as setup:
        check = train_check(setup, candidate("32-true", "cpu"), 8)
    assert check.lost == 0.0 and check.deviation == 0.0 and check.ok()
    assert check.losses == check.reference_losses and len(check.losses) == 8


def test_reference_follows_a_plain_fp32_loop_over_cycled_batches():
    x, y = data(16)
    batches = [(x[:8], y[:8]), (x[8:], y[8:])]
    model = Plain()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with setup_for(model, opt, batches[0], CE) as setup:
        ref = reference_check(setup, 5, batches=batches)
    plain = Plain()
    p_opt = torch.optim.SGD(plain.parameters(), lr=0.1)
    want = []
    for i in range(5):
        bx, by = batches[i % 2]
        p_opt.zero_grad()
        loss = CE(plain(bx), by)
        loss.backward()
        p_opt.step()
        want.append(loss.item())
    assert ref.losses == pytest.approx(want, rel=1e-6)


def test_gpt2_config_in_bf16_true_loses_updates():
    """The issue's case: a GPT-2 config under AdamW, which one step judged fit for bf16-true."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=512, n_positions=64)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg)
    ids = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(0))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with setup_for(model, opt, {"input_ids": ids, "labels": ids}, None) as setup:
        true = train_check(setup, candidate("bf16-true", "cpu"), 6)
    assert true.finite and true.lost > LOST_MAX and not true.ok() and true.worst
    assert all(true.lost_by_param[n] > 0 for n in true.worst)
    assert all(n in true.summary for n in true.worst)


def test_bad_arguments_name_the_value():
    model, opt, batch = one_weight(1e-2)
    bf16 = candidate("bf16-true", "cpu")
    with setup_for(model, opt, batch, sum_loss) as setup:
        ref = reference_check(setup, 2)
        for kwargs, text in ((dict(steps=0), "steps=0"), (dict(tol=-1.0), "tol=-1.0"),
                             (dict(batches=[]), "batches=list"),
                             (dict(steps=3, reference=ref), "reference=32-true")):
            with pytest.raises(ValueError, match=text):
                train_check(setup, bf16, **kwargs)


@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
def test_state_is_restored_when_the_loss_raises_midway(error):
    """A loss_fn that raises at the 3rd step: torch's default dtype and autocast are as they
    were, the user's weights and optimizer untouched; the error reaches the caller."""
    calls = []

    def loss_fn(out, y):
        calls.append(torch.get_default_dtype())
        if len(calls) == 3:
            raise error("from the user's loss")
        return CE(out.float(), y)

    model = Embedded()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with setup_for(model, opt, token_data(), loss_fn) as setup:
        ref = reference_check(setup, 2)
        with pytest.raises(error, match="user's loss"):
            train_check(setup, candidate("bf16-true", "cpu"), 2, reference=ref)
    assert calls[2] == torch.bfloat16  # it raised inside the true mode's forward context
    assert torch.get_default_dtype() == torch.float32 and not torch.is_autocast_enabled("cpu")
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items()) and not opt.state


# ----- choose(): no true mode for training without a passing multi-step check ------------------

def _row(name: str, speedup: float) -> ModeRow:
    return ModeRow(name, "native", True, (), 0.01, speedup, 0, 0, 0, 0, 1.0, 0.0, 0.0, True, "", "",
                   "", None, 0, "", None, speedup, (speedup, speedup), None, speedup > 1)


ROWS = [_row("32-true", 1.0), _row("bf16-mixed", 1.5), _row("bf16-true", 2.0)]


def code(mode, keep, tf32):
    return f"code for {mode}"


def test_needs_check_lists_the_true_modes_to_check():
    assert [r.name for r in needs_check(ROWS, TOL)] == ["bf16-true"]


def test_without_a_check_the_true_mode_is_not_recommended_and_says_why():
    rec, _ = choose(ROWS, TOL, code)
    assert rec.mode == "bf16-mixed"
    assert any("bf16-true: not recommended: its multi-step check did not run" in r
               for r in rec.reasons)


def test_a_failing_check_names_the_parameters_and_recommends_the_mixed_mode(embedded):
    check = embedded["bf16-true"]
    rec, _ = choose(ROWS, TOL, code, {"bf16-true": check})
    assert rec.mode == "bf16-mixed" and rec.code == "code for bf16-mixed"
    why = next(r for r in rec.reasons if r.startswith("bf16-true: not recommended for training"))
    assert "emb.weight" in why and f"{check.lost:.1%}" in why and "bf16-mixed keeps fp32" in why


def test_a_passing_check_lets_the_true_mode_be_recommended(embedded):
    passing = dataclasses.replace(embedded["bf16-true"], lost=0.0)
    assert passing.ok()
    rec, _ = choose(ROWS, TOL, code, {"bf16-true": passing})
    assert rec.mode == "bf16-true" and any("multi-step check" in r for r in rec.reasons)
    other = dataclasses.replace(passing, keep_fp32=("emb",))  # run with other islands: not it
    assert choose(ROWS, TOL, code, {"bf16-true": other})[0].mode == "bf16-mixed"


def test_inference_needs_no_multi_step_check():
    assert choose(ROWS, TOL, code, train=False)[0].mode == "bf16-true"


# ----- train=False: one forward --------------------------------------------------------------

def test_inference_check_matches_a_plain_bf16_forward():
    x, y = data()
    model = Plain()
    with setup_for(model, None, (x, y), CE) as setup:
        check = inference_check(setup, candidate("bf16-true", "cpu"))
    with torch.no_grad():
        want = Plain().eval()(x).double()
        got = Plain().eval().bfloat16()(x.bfloat16()).double()
    err = (torch.linalg.vector_norm(got - want) / torch.linalg.vector_norm(want)).item()
    assert check.finite and check.output.rel == pytest.approx(err, rel=1e-6)
    assert check.loss_error == pytest.approx(abs(CE(got.float(), y).item() - CE(want.float(), y).item())
                                             / CE(want.float(), y).item(), rel=1e-4)
    assert check.ok(TOL) == (check.loss_error <= TOL.loss and err <= TOL.grad)


def test_inference_check_sees_an_overflow():
    x, y = data()
    with setup_for(ForwardOverflow(), None, (x, y), CE) as setup:
        check = inference_check(setup, candidate("16-true", "cpu"))
    assert not check.finite and not check.ok() and math.isinf(check.output.rel)
