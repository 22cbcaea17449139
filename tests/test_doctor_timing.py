"""The doctor's speed evidence on a shared machine: round-robin steps, a spread, and no speed
claim (nor a recommendation on speed) where the noise could explain the difference."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from doctor_models import Plain, data
from torch import nn

import ampnb
import ampnb.diagnosis.headline as headline
import ampnb.diagnosis.pipeline as pipeline
import ampnb.diagnosis.run as run
from ampnb.diagnosis.candidates import candidates
from ampnb.diagnosis.evidence import speed, spread

CE = nn.functional.cross_entropy
MODES = ("32-true", "bf16-mixed")
MS = 1e-3


def _inject(monkeypatch: pytest.MonkeyPatch, times: dict[str, list[float]], native: bool = True
            ) -> list[list[tuple[str, int]]]:
    """The headline's round-robin answers the given step times per mode, and 32-true's
    step-to-step variation is taken from them (bf16 counted native when asked)."""
    calls: list[list[tuple[str, int]]] = []

    def fake(setup, timed, copies, scalers, estimates, clock, repeat, say, *, must):
        calls.append([(c.name, repeat) for c in timed])
        return {c.name: list(times[c.name][:repeat]) for c in timed} if len(timed) > 1 else {}

    def cands(modes, device):
        found, skipped = candidates(modes, device)
        return [dataclasses.replace(c, native=native, how="native") if native else c
                for c in found], skipped

    real_noise = headline._noise
    monkeypatch.setattr(headline, "_rounds", fake)
    monkeypatch.setattr(headline, "_noise", lambda _: real_noise(times["32-true"]))
    monkeypatch.setattr(pipeline, "candidates", cands)
    return calls


@pytest.mark.parametrize("ref_ms, bf16_ms", [
    ([1.0, 15.0], [1.0, 1.1]),            # median of two: one 15 ms spike made it "14x"
    ([1.0, 15.0, 1.1], [0.95, 1.0, 1.05]),  # one spike in 32-true's range: 1.1x by medians
])
def test_one_noisy_outlier_is_no_measurable_difference(monkeypatch, ref_ms, bf16_ms):
    _inject(monkeypatch, {"32-true": [t * MS for t in ref_ms], "bf16-mixed": [t * MS for t in bf16_ms]})
    r = ampnb.doctor(Plain(), data(), CE, modes=MODES, tolerance=1.0, repeat=len(ref_ms),
                     profile=False)
    row = r.mode("bf16-mixed")
    assert not row.measurable and row.speedup == 1.0 and row.ratio > 1
    assert row.speed.startswith("no measurable difference")
    assert r.recommended.mode == "32-true"            # not recommended on speed
    assert "measurably faster" in r.recommended.reasons[0]
    assert "bf16-mixed: no measurable difference" in r.verdict
    assert "no measurable difference" in repr(r.table())


def test_clear_consistent_difference_is_faster_with_its_spread(monkeypatch):
    ref = [10.0, 10.5, 11.0, 10.2, 30.0]   # a spike does not hide a clear difference either
    bf16 = [5.0, 5.2, 5.1, 5.3, 5.0]
    calls = _inject(monkeypatch, {"32-true": [t * MS for t in ref], "bf16-mixed": [t * MS for t in bf16]})
    r = ampnb.doctor(Plain(), data(), CE, modes=MODES, tolerance=1.0, repeat=5, profile=False)
    assert calls[0] == [("32-true", 5), ("bf16-mixed", 5)]   # one round-robin call for all modes
    row = r.mode("bf16-mixed")
    assert row.measurable and row.speedup == pytest.approx(10.5 / 5.1)
    low, high = row.ratio_spread
    assert low == pytest.approx(10.2 / 5.2) and high == pytest.approx(11.0 / 5.0) and low > 1
    assert row.speed == f"{10.5 / 5.1:.2f}x ({low:.2f}-{high:.2f}x)"
    assert r.recommended.mode == "bf16-mixed"
    assert any(row.speed in reason for reason in r.recommended.reasons)
    assert f"{torch.get_num_threads()} CPU threads" in r.verdict


def test_clearly_slower_is_measurable_but_never_recommended(monkeypatch):
    _inject(monkeypatch, {"32-true": [1 * MS] * 5, "bf16-mixed": [3 * MS, 3.1 * MS, 2.9 * MS, 3 * MS, 3 * MS]})
    r = ampnb.doctor(Plain(), data(), CE, modes=MODES, tolerance=1.0, repeat=5, profile=False)
    row = r.mode("bf16-mixed")
    assert row.measurable and row.speedup < 1 and r.recommended.mode == "32-true"


def test_spread_rule():
    assert spread([1.0, 2.0]) is None                       # too few steps for a spread
    assert spread([3.0, 1.0, 2.0]) == (1.0, 3.0)             # min-max under 5 steps
    assert spread([1.0, 2.0, 3.0, 4.0, 100.0]) == (2.0, 4.0)  # interquartile range
    assert speed(None, [1.0] * 3) == (None, None, None, False)
    assert speed([1.0] * 3, [2.0] * 3)[3] and not speed([1.0, 2.5, 1.5], [2.0] * 3)[3]


def test_time_steps_interleaves_and_keeps_threads(monkeypatch):
    order: list[str] = []
    real = run._step

    def step(net, opt, setup, p, grads=None):
        order.append(p.mode.name)
        return real(net, opt, setup, p, grads)

    monkeypatch.setattr(run, "_step", step)
    found, _ = candidates(MODES, "cpu")
    threads = torch.get_num_threads()
    from ampnb.batch import as_batch
    from ampnb.start import started

    model = Plain()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with started(model, opt) as start:
        setup = run.Setup(start, as_batch(data(), CE), CE, "cpu")
        times = run.time_steps(setup, [(found[0], None, (), 3), (found[1], None, (), 1)])
    assert [len(t) for t in times] == [3, 1] and all(x > 0 for t in times for x in t)
    # warm-up round, then round-robin; a run with fewer steps drops out once it has them
    assert order == ["32-true", "bf16-mixed"] * 2 + ["32-true"] * 2
    assert torch.get_num_threads() == threads


def test_a_gap_larger_than_the_measured_variation_is_slower_even_from_one_step(monkeypatch):
    """Notebook 05's case (repeat=1, a CPU with native fp16): 16-mixed at 9.38 ms against
    32-true's 1.12 ms was 'no measurable difference'; one step each cannot give a spread, but an
    8x gap is far larger than 32-true's own step-to-step variation."""
    _inject(monkeypatch, {"32-true": [1.12 * MS, 1.10 * MS], "bf16-mixed": [9.38 * MS]})
    r = ampnb.doctor(Plain(), data(), CE, modes=MODES, tolerance=1.0, repeat=1, profile=False)
    row = r.mode("bf16-mixed")
    assert row.measurable and row.timed == 1 and row.ratio == pytest.approx(1.12 / 9.38)
    assert "8.4x slower" in row.speed and "1 timed step each" in row.speed
    assert "step-to-step variation" in row.speed and r.recommended.mode == "32-true"


def test_bf16_and_fp16_not_measurably_apart_go_to_bf16(monkeypatch):
    ref = [10.0, 10.2, 10.1, 10.3, 10.0]
    bf16 = [5.0, 5.3, 5.1, 5.2, 5.4]
    fp16 = [5.0, 5.2, 5.0, 5.1, 5.3]   # a hair faster by the median, within the spreads
    _inject(monkeypatch, {"32-true": [t * MS for t in ref], "bf16-mixed": [t * MS for t in bf16],
                          "16-mixed": [t * MS for t in fp16]})
    r = ampnb.doctor(Plain(), data(), CE, modes=("32-true", "bf16-mixed", "16-mixed"),
                     tolerance=1.0, repeat=5, profile=False)
    assert r.mode("16-mixed").speedup > r.mode("bf16-mixed").speedup  # 16-mixed wins on speed
    assert r.recommended.mode == "bf16-mixed"
    assert any("not measurably different" in x and "no GradScaler" in x
               for x in r.recommended.reasons)
