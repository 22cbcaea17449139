"""ScalerStepper with full records vs the same loop written by hand: overhead per optimizer step."""

from __future__ import annotations

import itertools
import statistics
import time
from collections.abc import Callable

import torch

from benchmarks._common import Result, interleaved_medians, ms

ACCUM, CLIP = 2, 1.0
# mode -> (autocast dtype, whether the plain loop uses a GradScaler): the loops nanoGPT writes.
MODES = {"16-mixed": (torch.float16, True), "bf16-mixed": (torch.bfloat16, False)}
# The smallest demo is the worst case for a fixed per-step cost; the CNN is a more usual one.
CASES = [("mlp", "16-mixed"), ("mlp", "bf16-mixed"), ("cnn", "16-mixed")]


def _setup(name: str, device: str):
    """A demo (ampnb.models), built the same way for both loops."""
    from ampnb.models import demo

    d = demo(name, seed=0, device=device)
    x, _ = d.batches[0]
    return d, f"demo {name}, {d.n_params} params, batch {x.shape[0]}"


def _plain_step(model, opt, loss_fn, data, scaler, device, dtype):
    for _ in range(ACCUM):
        x, y = next(data)
        with torch.autocast(device, dtype=dtype):
            loss = loss_fn(model(x), y) / ACCUM
        (scaler.scale(loss) if scaler else loss).backward()
    if scaler:
        scaler.unscale_(opt)
    torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
    if scaler:
        scaler.step(opt)
        scaler.update()
    else:
        opt.step()
    opt.zero_grad(set_to_none=True)


def _cpu_medians(fns: dict[str, Callable[[], object]], repeat: int, warmup: int
                 ) -> dict[str, float]:
    """Median CPU time of this thread, round-robin: other processes on a shared machine
    do not count (with one torch thread, CPU autograd runs in this thread too)."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeat):
        for k, fn in fns.items():
            t0 = time.thread_time()
            fn()
            times[k].append(time.thread_time() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def _one(name: str, mode: str, device: str) -> Result:
    from ampnb.scaler import ScalerStepper

    dtype, with_scaler = MODES[mode]
    d, label = _setup(name, device)
    stepper = ScalerStepper(*d, mode=mode, accumulation_steps=ACCUM, clip_norm=CLIP)
    ref, _ = _setup(name, device)
    scaler = torch.amp.GradScaler(device) if with_scaler else None
    data = itertools.cycle(ref.batches)
    fns = {"plain": lambda: _plain_step(ref.model, ref.optimizer, ref.loss_fn, data, scaler,
                                        device, dtype),
           "stepper": stepper.step}
    if device == "cuda":
        times, clock = interleaved_medians(fns, repeat=41, warmup=5, device=device), "wall"
    else:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            times, clock = _cpu_medians(fns, repeat=41, warmup=5), "thread CPU time"
        finally:
            torch.set_num_threads(threads)
    ratio = times["stepper"] / times["plain"]
    return Result(f"scaler stepper overhead ({label}, {mode}, {device}, {clock}, "
                  f"accum {ACCUM}, clip)",
                  f"stepper {ms(times['stepper'])}, plain loop {ms(times['plain'])} per step",
                  ratio, "<= 1.10x", ratio <= 1.10)


def run() -> list[Result]:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    return [_one(name, mode, device) for name, mode in CASES]
