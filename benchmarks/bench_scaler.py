"""ScalerStepper.run(n) with full records vs the same loop written by hand: cost per optimizer step.

Both loops run the same fp16 products (`ampnb.fp16_kernels`: emulated on a CPU without fp16 units,
as ampnb runs every fp16 step there), entered once around the n steps of a timed run, as
`ScalerStepper.run(n)` enters its step context once.
"""

from __future__ import annotations

import contextlib
import itertools
import time

import torch

from benchmarks._common import Result, interleaved_medians, ms, one_thread

ACCUM, CLIP = 2, 1.0
STEPS = 4  # optimizer steps per timed run
# mode -> (autocast dtype, whether the plain loop uses a GradScaler): the loops nanoGPT writes.
MODES = {"16-mixed": (torch.float16, True), "bf16-mixed": (torch.bfloat16, False)}
# The smallest demo is the worst case for a fixed per-step cost; the CNN and the GPT more usual.
CASES = [("mlp", "16-mixed"), ("mlp", "bf16-mixed"), ("cnn", "16-mixed"), ("gpt", "16-mixed")]


def _setup(name: str, device: str):
    """A demo (ampnb.models), built the same way for both loops."""
    from ampnb.models import demo

    d = demo(name, seed=0, device=device)
    x, _ = d.batches[0]
    return d, f"demo {name}, {d.n_params} params, batch {tuple(x.shape)}"


def _kernels(device: str, dtype: torch.dtype) -> contextlib.AbstractContextManager:
    """The fp16 products ampnb runs on this device (the plain loop's only ampnb piece)."""
    from ampnb.fp16_kernels import fp16_kernel_context

    return fp16_kernel_context(device) if dtype == torch.float16 else contextlib.nullcontext()


def _plain_run(model, opt, loss_fn, data, scaler, device, dtype) -> None:
    """nanoGPT's AMP + accumulation loop, STEPS optimizer steps."""
    with _kernels(device, dtype):
        for _ in range(STEPS):
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
    fns = {"plain": lambda: _plain_run(ref.model, ref.optimizer, ref.loss_fn, data, scaler,
                                       device, dtype),
           "stepper": lambda: stepper.run(STEPS)}
    # On CPU: this thread's CPU time with one torch thread; other processes do not count.
    cpu = device == "cpu"
    with one_thread(cpu):
        times = interleaved_medians(fns, repeat=41, warmup=3, device=device,
                                    clock=time.thread_time if cpu else time.perf_counter)
    clock = "thread CPU time" if cpu else "wall"
    ratio = times["stepper"] / times["plain"]
    return Result(f"scaler stepper run({STEPS}) vs hand-written loop ({label}, {mode}, {device}, "
                  f"{clock}, accum {ACCUM}, clip, same fp16 kernels)",
                  f"stepper {ms(times['stepper'] / STEPS)}, plain loop "
                  f"{ms(times['plain'] / STEPS)} per step", ratio, "<= 1.10x", ratio <= 1.10)


def run() -> list[Result]:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    return [_one(name, mode, device) for name, mode in CASES]
