"""The doctor's wall time on the demo GPT and on a ~5M-parameter transformers model (CPU)."""

from __future__ import annotations

import time
from collections import defaultdict

import torch

from benchmarks._common import Result, gpt2_5m

GOALS = {"gpt": 15.0, "gpt2-5M": 60.0}  # seconds for the whole doctor, default modes


def _gpt():
    from ampnb.models import demo

    d = demo("gpt", seed=0)
    return d.model, d.batches[0], d.loss_fn, d.optimizer, "demo gpt"


def _gpt2_5m():
    model, batch, opt = gpt2_5m()
    return model, batch, None, opt, "GPT-2 from config"


CASES = {"gpt": _gpt, "gpt2-5M": _gpt2_5m}


class _Phases:
    """Progress callback that charges the time between messages to the stage that was running."""

    def __init__(self) -> None:
        self.t, self.stage = time.perf_counter(), "start"
        self.spent: dict[str, float] = defaultdict(float)

    def __call__(self, text: str) -> None:
        now = time.perf_counter()
        self.spent[self.stage] += now - self.t
        self.t, self.stage = now, text.split(" (")[0].split(":")[0]

    def close(self) -> None:
        self(" end")


def run() -> list[Result]:
    import ampnb

    results = []
    for name, build in CASES.items():
        model, batch, loss_fn, opt, what = build()
        n = sum(p.numel() for p in model.parameters())
        phases = _Phases()
        t0, c0 = time.perf_counter(), time.process_time()
        report = ampnb.doctor(model, batch, loss_fn, optimizer=opt, repeat=3, progress=phases)
        seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
        phases.close()
        top = sorted(phases.spent.items(), key=lambda kv: -kv[1])[:3]
        dominant = ", ".join(f"{k} {v:.1f} s" for k, v in top)
        results.append(Result(
            f"doctor on {name} ({what}, {n / 1e6:.1f}M params, {len(report.modes)} runs)",
            f"{seconds:.1f} s wall ({cpu:.1f} s CPU over {torch.get_num_threads()} threads; a "
            f"loaded shared machine inflates wall time); most time: {dominant}; recommended {report.recommended.headline}",
            seconds, f"<= {GOALS[name]:g} s", seconds <= GOALS[name]))
    return results


if __name__ == "__main__":
    for r in run():
        print(r)
