"""Capture (summaries of weights, activations, gradients) and the op tracer on demo training
steps, against the same steps without them."""

from __future__ import annotations

import itertools
import time

import torch

from benchmarks._common import Result, interleaved_medians, ms, one_thread

DEMOS = ("mlp", "gpt")
LOOP, EVERY = 50, 50  # capture attached to training, as Lightning logs: one step in 50


def _step_fn(d):
    data = itertools.cycle(d.batches)

    def step() -> None:
        x, y = next(data)
        d.optimizer.zero_grad(set_to_none=True)
        d.loss_fn(d.model(x), y).backward()
        d.optimizer.step()
    return step


def _one(name: str, device: str) -> list[Result]:
    import ampnb
    from ampnb.models import demo

    d = demo(name, seed=0, device=device)
    step = _step_fn(d)

    def captured() -> None:
        with ampnb.capture(d.model) as cap:  # weights, activations, gradients; 4 formats
            step()
        assert cap.records  # summaries are part of the cost

    def loop() -> None:
        for _ in range(LOOP):
            step()

    def loop_captured() -> None:
        with ampnb.capture(d.model, every=EVERY) as cap:
            for _ in range(LOOP):
                step()
        assert cap.records and cap.forwards == LOOP

    def traced() -> None:
        with ampnb.trace_ops():
            step()

    cpu = device == "cpu"
    # Thread CPU time on CPU (one torch thread: autograd runs in this thread too), so other
    # work on a shared machine does not count; wall time with a sync on a GPU.
    clock = time.thread_time if cpu else time.perf_counter
    with one_thread(cpu):
        t = interleaved_medians({"plain": step, "capture": captured, "trace": traced},
                                repeat=15, warmup=3, device=device, clock=clock)
        tl = interleaved_medians({"loop": loop, "loop+capture": loop_captured},
                                 repeat=15, warmup=1, device=device, clock=clock)
    where = f"{device}, 1 thread" if cpu else device
    label = f"demo {name}, {d.n_params} params, {where}"
    per = tl["loop+capture"] / tl["loop"]
    return [
        Result(f"capture attached to training, every={EVERY} ({label})",
               f"{LOOP} steps {ms(tl['loop+capture'])} with capture, {ms(tl['loop'])} without",
               per, "<= 1.10x", per <= 1.10),
        Result(f"capture of one whole step, every tensor (every=1) ({label})",
               f"with capture {ms(t['capture'])}, plain step {ms(t['plain'])}",
               t["capture"] / t["plain"], "reported", None),
        Result(f"op tracer overhead ({label})",
               f"with trace_ops {ms(t['trace'])}, plain step {ms(t['plain'])}",
               t["trace"] / t["plain"], "reported", None),
    ]


def run() -> list[Result]:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    return [r for name in DEMOS for r in _one(name, device)]
