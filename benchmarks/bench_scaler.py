"""ScalerStepper with full records vs the same loop written by hand: overhead per optimizer step."""

from __future__ import annotations

import itertools

import torch

from benchmarks._common import Result, interleaved_medians, ms

ACCUM, CLIP = 2, 1.0
# mode -> (autocast dtype, whether the plain loop uses a GradScaler): the loops nanoGPT writes.
MODES = {"16-mixed": (torch.float16, True), "bf16-mixed": (torch.bfloat16, False)}


def _setup(device: str):
    """The demo MLP (ampnb.models), built the same way for both loops."""
    from ampnb.models import demo

    d = demo("mlp", seed=0, device=device)
    x, _ = d.batches[0]
    return d, f"demo mlp, {d.n_params} params, batch {x.shape[0]}"


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


def _one(mode: str, device: str) -> Result:
    from ampnb.scaler import ScalerStepper

    dtype, with_scaler = MODES[mode]
    d, name = _setup(device)
    stepper = ScalerStepper(*d, mode=mode, accumulation_steps=ACCUM, clip_norm=CLIP)
    ref, _ = _setup(device)
    scaler = torch.amp.GradScaler(device) if with_scaler else None
    data = itertools.cycle(ref.batches)
    threads = torch.get_num_threads()
    # One thread on CPU: on a shared machine, other work then slows both loops alike.
    torch.set_num_threads(1 if device == "cpu" else threads)
    try:
        times = interleaved_medians({
            "plain": lambda: _plain_step(ref.model, ref.optimizer, ref.loss_fn, data, scaler,
                                         device, dtype),
            "stepper": stepper.step,
        }, repeat=41, warmup=5, device=device)
    finally:
        torch.set_num_threads(threads)
    ratio = times["stepper"] / times["plain"]
    where = f"{device}, 1 thread" if device == "cpu" else device
    return Result(f"scaler stepper overhead ({name}, {mode}, {where}, accum {ACCUM}, clip)",
                  f"stepper {ms(times['stepper'])}, plain loop {ms(times['plain'])} per step",
                  ratio, "<= 1.10x", ratio <= 1.10)


def run() -> list[Result]:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    return [_one(mode, device) for mode in MODES]
