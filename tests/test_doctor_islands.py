"""fp32 islands are the cause, not bystanders: verified 1-minimal by rerunning without each one."""

from __future__ import annotations

import dataclasses
import itertools
import math

import pytest
import torch
from doctor_models import ForwardOverflow, data
from torch import nn

import ampnb
from ampnb.batch import as_batch
from ampnb.diagnosis.candidates import candidate
from ampnb.diagnosis.evidence import ModeRow, acceptable, mode_row
from ampnb.diagnosis.layers import LayerRow
from ampnb.diagnosis.recommend import Tolerance, choose, islands
from ampnb.diagnosis.run import Setup, measure
from ampnb.formats import headroom
from ampnb.start import started

CE = nn.functional.cross_entropy
TOL = Tolerance()
FP16_MAX = torch.finfo(torch.float16).max


class Scale(nn.Module):
    """Multiplies by a constant: the planted overflow when the constant is large."""

    def __init__(self, k: float) -> None:
        super().__init__()
        self.k = k

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.k


class Planted(nn.Module):
    """Linear, then x 1e5 (past fp16's max), then bystanders: a ReLU that passes the large values
    on, a LayerNorm that brings them back, and Linear layers whose outputs fit fp16."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(16, 32)
        self.scale = Scale(1e5)
        self.act = nn.ReLU()
        self.norm = nn.LayerNorm(32)
        self.mid = nn.Linear(32, 32)
        self.head = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.mid(self.norm(self.act(self.scale(self.inp(x)))))))


class TwoCauses(Planted):
    """Two branches, each with its own planted overflow: both are causes."""

    def __init__(self) -> None:
        super().__init__()
        self.side = nn.Linear(16, 32)
        self.scale2 = Scale(3e5)
        self.norm2 = nn.LayerNorm(32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.norm(self.act(self.scale(self.inp(x))))
        b = self.norm2(self.scale2(self.side(x)))
        return self.head(torch.tanh(self.mid(a + b)))


class Nested(nn.Module):
    """The plant inside a block whose own output (after its LayerNorm) fits fp16."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.block = nn.Sequential(nn.Linear(16, 32), Scale(1e5), nn.ReLU(), nn.LayerNorm(32))
        self.mid = nn.Linear(32, 32)
        self.head = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.mid(self.block(x))))


def fp32_layers(model: nn.Module, x: torch.Tensor) -> tuple[LayerRow, ...]:
    """Per-module fp32 output range and fp16 headroom from a plain forward (the trusted side)."""
    found: dict[str, tuple[nn.Module, float]] = {}

    def seen(name: str):
        def hook(mod: nn.Module, args: object, out: torch.Tensor) -> None:
            found.setdefault(name, (mod, float(out.detach().abs().max())))
        return hook

    hooks = [m.register_forward_hook(seen(n)) for n, m in model.named_modules() if n]
    with torch.no_grad():
        model(x)
    for h in hooks:
        h.remove()
    return tuple(LayerRow(name, type(m).__name__, not any(True for _ in m.children()), amax,
                          {"fp16": headroom(amax, FP16_MAX)}) for name, (m, amax) in found.items())


def search(model: nn.Module, mode: str = "16-mixed", max_reruns: int | None = None,
           optimizer: torch.optim.Optimizer | None = None):
    """islands() as the doctor calls it, with a rerun from run.measure/evidence.mode_row; also
    the rerun itself (to verify minimality) and the keep sets it was called with."""
    x, y = data()
    layers = fp32_layers(model, x)
    calls: list[tuple[str, ...]] = []
    with started(model, optimizer) as start:
        setup = Setup(start, as_batch((x, y), CE), CE, "cpu")
        ref_cand, cand = candidate("32-true", "cpu"), candidate(mode, "cpu")
        ref = measure(setup, ref_cand, reference=True)
        row = mode_row(cand, measure(setup, cand, ref=ref), ref, None, None)

        def rerun(keep: tuple[str, ...]) -> ModeRow:
            calls.append(tuple(keep))
            return mode_row(cand, measure(setup, cand, keep, ref=ref), ref, None, None, keep)

        fixed = islands(row, layers, TOL, rerun, max_reruns)
        return row, fixed, layers, rerun, calls


def test_the_plant_and_its_bystanders():
    """The plant as torch shows it: fp16 overflows at `scale` only; the LayerNorm and Linear
    downstream produce values well inside fp16's range."""
    model = Planted()
    x, _ = data()
    layers = {r.module: r for r in fp32_layers(model, x)}
    assert layers["scale"].amax > FP16_MAX and layers["act"].amax > FP16_MAX
    for bystander in ("norm", "mid", "head"):
        assert layers[bystander].amax < FP16_MAX / 100
    with torch.autocast("cpu", dtype=torch.float16):
        assert torch.isinf(model.scale(model.inp(x))).any()


def test_islands_are_the_cause_only_and_1_minimal():
    row, fixed, layers, rerun, calls = search(Planted())
    assert not row.finite and row.nonfinite_module == "scale"
    # the causal sites include the ReLU the overflowing values pass through (its fp32 output is
    # past fp16's max too); it is dropped: with `scale` in fp32 the ReLU gets fp32 values
    assert fixed.search.sites == ("scale", "act")
    assert fixed.keep_fp32 == ("scale",) and fixed.search.dropped == ("act",)
    assert acceptable(fixed, TOL.loss, TOL.grad)
    assert fixed.search.minimal and fixed.search.reruns == len(calls) == 2
    assert not {"act", "norm", "mid", "head"} & set(fixed.keep_fp32)
    # 1-minimal, checked by rerunning: without any one island the step breaks
    for m in fixed.keep_fp32:
        rest = tuple(k for k in fixed.keep_fp32 if k != m)
        without = rerun(rest) if rest else row
        assert not acceptable(without, TOL.loss, TOL.grad)


def test_two_causes_are_both_kept_and_each_is_needed():
    row, fixed, layers, rerun, calls = search(TwoCauses())
    assert set(fixed.keep_fp32) == {"scale", "scale2"}
    assert fixed.search.minimal and "act" in fixed.search.dropped
    assert acceptable(fixed, TOL.loss, TOL.grad)
    for m in fixed.keep_fp32:
        assert not acceptable(rerun(tuple(k for k in fixed.keep_fp32 if k != m)), TOL.loss, TOL.grad)


def test_in_a_true_mode_the_block_around_the_overflow_is_kept():
    """16-true: a kept module's fp32 output is cast back to fp16 at its boundary, so keeping the
    overflowing module alone cannot help; the block around it, whose output fits, can. (SGD:
    AdamW's default eps is 0 in fp16 and would break the step whatever is kept.)"""
    model = Nested()
    layers = {r.module: r for r in fp32_layers(model, data()[0])}
    assert layers["block.1"].amax > FP16_MAX > 100 * layers["block"].amax
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    row, fixed, _, rerun, calls = search(model, "16-true", optimizer=opt)
    assert not row.finite and row.nonfinite_module == "block.1"
    assert not acceptable(rerun(("block.1",)), TOL.loss, TOL.grad)  # alone it cannot help
    assert fixed.keep_fp32 == ("block",) and fixed.search.minimal
    assert acceptable(fixed, TOL.loss, TOL.grad) and "block" in fixed.search.sites


def test_the_recommendation_shows_before_and_after_of_the_minimal_set():
    row, fixed, *_ = search(Planted())
    ref = dataclasses.replace(row, name="32-true", keep_fp32=(), finite=True, loss_error=0.0,
                              grad_error=0.0, nonfinite="", nonfinite_module="")
    rec, _ = choose([ref, row, fixed], TOL, lambda m, k, t: f"code {m} {k}")
    low = rec if rec.mode == "16-mixed" else _
    assert low.mode == "16-mixed" and low.keep_fp32 == ("scale",)
    assert low.before is row and low.after is fixed
    assert any("dropped act" in r and "1-minimal" in r for r in low.reasons)


def test_a_rerun_budget_that_runs_out_says_minimality_was_not_verified():
    row, fixed, layers, rerun, calls = search(Planted(), max_reruns=1)
    assert len(calls) == 1 and fixed.keep_fp32 == ("scale", "act")  # verified, not minimized
    assert acceptable(fixed, TOL.loss, TOL.grad)
    assert not fixed.search.minimal and "budget" in fixed.search.text
    assert search(Planted(), max_reruns=0)[1] is None  # nothing verified: no islands offered
    with pytest.raises(ValueError, match="max_reruns=-1"):
        search(Planted(), max_reruns=-1)


def small_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Cross-entropy x 1e-3: gradients near 1e-5, below fp16's normal range without a loss scale."""
    return CE(out, y) * 1e-3


def hand_written_island(scale: float | None) -> float:
    """Gradient error of one plain torch.amp fp16 step with `up` in a hand-written
    autocast(enabled=False) region, its GradScaler at `scale` (None: torch's default), against
    the fp32 step's gradients."""
    x, y = data()
    fp32, amp = ForwardOverflow(), ForwardOverflow()
    small_loss(fp32(x), y).backward()
    scaler = torch.amp.GradScaler("cpu") if scale is None else \
        torch.amp.GradScaler("cpu", init_scale=scale)
    with torch.autocast("cpu", dtype=torch.float16):
        h = torch.relu(amp.inp(x))
        with torch.autocast("cpu", enabled=False):
            h = amp.up(h.float())
        loss = small_loss(amp.head(amp.norm(h)), y)
    scaler.scale(loss).backward()
    got = torch.cat([p.grad.reshape(-1).double() for p in amp.parameters()]) / scaler.get_scale()
    want = torch.cat([p.grad.reshape(-1).double() for p in fp32.parameters()])
    return float((got - want).norm() / want.norm())


def test_an_island_is_judged_from_the_scalers_initial_state_not_the_collapsed_scale():
    """A forward overflow no loss scale cures: the failed run backs its scale off to the floor.
    The island is judged as the user trains it, from the GradScaler's initial scale; at the
    collapsed scale fp16's gradients underflow and a correct island would read as wrong."""
    at_start, collapsed = hand_written_island(None), hand_written_island(2.0**-8)
    assert at_start <= TOL.grad < collapsed  # the plant: the collapsed scale is itself a cause
    r = ampnb.doctor(ForwardOverflow(), data(), small_loss, modes=("32-true", "16-mixed"),
                     repeat=1, budget=math.inf, profile=False, progress=lambda _: None)
    before = r.mode("16-mixed")
    # No scale cures a forward overflow: the failed run is not finite, and whether it backed its
    # scale off (to 2^-8 once) or kept it (an inf loss is not backed off for), the island below
    # is judged from the scaler's initial state, not from what the failed run left.
    assert not before.finite
    rec = r.low_precision
    assert rec is not None and rec.mode == "16-mixed" and rec.keep_fp32 == ("up",)
    assert rec.after.scale == torch.amp.GradScaler("cpu").get_scale()
    assert rec.after.grad_error == pytest.approx(at_start, rel=0.05)


# ----- the minimization itself, on synthetic reruns whose outcome a rule decides -----------------

MODS = ("a", "b", "c", "d")


def _row(keep: tuple[str, ...], good: bool) -> ModeRow:
    return ModeRow("16-mixed", "native", True, keep, None, None, 0, 0, 0, 0, 1.0,
                   0.0 if good else math.inf, 0.0 if good else math.inf, good,
                   "" if good else "inf in a", "" if good else "a", "" if good else "forward",
                   None, 0, "", None)


RULES = {  # which island sets make the step acceptable (some not monotone in the set)
    "a alone": lambda k: "a" in k,
    "a and c": lambda k: {"a", "c"} <= k,
    "a, or b and d": lambda k: "a" in k or {"b", "d"} <= k,
    "c but not d": lambda k: "c" in k and "d" not in k,
}


@pytest.mark.parametrize("rule", RULES)
def test_minimization_is_1_minimal_whatever_the_rule(rule):
    """Every kept island is needed (checked against the rule by brute force) and nothing
    acceptable was given up for a bigger set."""
    ok = RULES[rule]
    layers = tuple(LayerRow(m, "Linear", True, 1e5, {"fp16": -1.0}) for m in MODS)
    calls = []

    def rerun(keep):
        calls.append(keep)
        return _row(tuple(keep), ok(frozenset(keep)))

    start = _row((), False)
    fixed = islands(start, layers, TOL, rerun)
    if not ok(frozenset(MODS)):  # growth adds every site at once; no acceptable superset exists
        assert fixed is not None and not fixed.finite and not fixed.search.minimal
        return
    kept = frozenset(fixed.keep_fp32)
    assert ok(kept) and fixed.search.minimal
    for m in kept:
        assert not ok(kept - {m})
    assert len(calls) == len(set(map(frozenset, calls)))  # no set rerun twice
    subsets = [frozenset(c) for n in range(len(MODS) + 1) for c in itertools.combinations(MODS, n)]
    assert any(ok(s) for s in subsets if s <= kept)
