"""ScalerStepper with full records vs the same loop written by hand: overhead per optimizer step."""

from __future__ import annotations

import itertools
import time

import torch

from benchmarks._common import Result, interleaved_medians, ms, one_thread

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
    # On CPU: this thread's CPU time with one torch thread; other processes do not count.
    cpu = device == "cpu"
    with one_thread(cpu):
        times = interleaved_medians(fns, repeat=41, warmup=5, device=device,
                                    clock=time.thread_time if cpu else time.perf_counter)
    clock = "thread CPU time" if cpu else "wall"
    ratio = times["stepper"] / times["plain"]
    return Result(f"scaler stepper overhead ({label}, {mode}, {device}, {clock}, "
                  f"accum {ACCUM}, clip)",
                  f"stepper {ms(times['stepper'])}, plain loop {ms(times['plain'])} per step",
                  ratio, "<= 1.10x", ratio <= 1.10)


def run() -> list[Result]:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    return [_one(name, mode, device) for name, mode in CASES]
