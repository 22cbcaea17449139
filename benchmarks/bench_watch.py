"""ampnb.watch's cost: the same training loop with and without a watch, at every=1 / 10 / 50.

Two copies of a model (same weights) train side by side, one watched for the whole run; their
steps are timed alternately (which goes first alternates too), so drift hits both alike. The
ratio is of mean step times: the statistics steps (one in `every`) are part of the cost, and a
median would hide them; the medians are shown beside it. At every=50 on a CPU a reported row
splits the watched step's extra time by phase (forward + loss, backward, optimizer step, update).
"""

from __future__ import annotations

import itertools
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from benchmarks._common import Result, gpt2_5m, ms, one_thread

STEPS = 100   # timed optimizer steps per variant
WARMUP = 3
EVERY = (1, 10, 50)
GOAL = 1.03   # at every=50 (#27)


def _demo_gpt(device: str) -> tuple[Any, Callable[[Any], torch.Tensor], str, torch.dtype]:
    """The demo GPT in 16-mixed (GradScaler, ampnb's fp16 products on a CPU without fp16)."""
    from ampnb.models import demo

    d = demo("gpt", seed=0, device=device)
    data = itertools.cycle(d.batches)

    def loss(model: Any) -> torch.Tensor:
        x, y = next(data)
        return d.loss_fn(model(x), y)
    return (d.model, d.optimizer), loss, f"demo gpt, {d.n_params} params", torch.float16


def _zoo_gpt2(device: str) -> tuple[Any, Callable[[Any], torch.Tensor], str, torch.dtype]:
    """transformers GPT-2 (~5M parameters) in bf16-mixed, its own loss."""
    model, batch, opt = gpt2_5m()
    model.to(device)
    batch = {k: v.to(device) for k, v in batch.items()}
    n = sum(p.numel() for p in model.parameters())
    return (model, opt), lambda m: m(**batch).loss, f"zoo GPT-2, {n} params", torch.bfloat16


def _world(make: Callable, device: str):
    (model, opt), loss, label, dtype = make(device)
    scaler = torch.amp.GradScaler(device) if dtype == torch.float16 else None
    return model, opt, loss, scaler, label, dtype


PHASES = ("forward + loss", "backward", "optimizer step", "update + zero_grad")


def _step(world: tuple, device: str, clock: Callable[[], float], phases: list) -> None:
    """One step of nanoGPT's loop: autocast forward + loss, (scaled) backward, step, update;
    the time of each phase appended to `phases` (one thread on a CPU: each runs here)."""
    model, opt, loss_of, scaler, _, dtype = world
    t = [clock()]
    with torch.autocast(device, dtype=dtype):
        loss = loss_of(model)
    t.append(clock())
    (scaler.scale(loss) if scaler else loss).backward()
    t.append(clock())
    if scaler:
        scaler.step(opt)
    else:
        opt.step()
    t.append(clock())
    if scaler:
        scaler.update()
    opt.zero_grad(set_to_none=True)
    t.append(clock())
    phases.append([b - a for a, b in zip(t, t[1:])])


def _where(phases: dict[str, list], label: str) -> Result:
    """Where the watched step's extra time goes: each phase's median, watched minus plain."""
    extra = [statistics.median(p[k] for p in phases["watch"])
             - statistics.median(p[k] for p in phases["plain"]) for k in range(len(PHASES))]
    plain = sum(statistics.median(p[k] for p in phases["plain"]) for k in range(len(PHASES)))
    return Result(f"  where the watch's extra time goes at every=50 ({label}; phase medians)",
                  ", ".join(f"{n} {'+' if e >= 0 else '-'}{abs(e) * 1e6:.0f} µs"
                            for n, e in zip(PHASES, extra)),
                  sum(extra) / plain, "reported", None)


def _kernels(device: str, dtype: torch.dtype) -> Any:
    import contextlib

    from ampnb.fp16_kernels import fp16_kernel_context

    return fp16_kernel_context(device) if dtype == torch.float16 else contextlib.nullcontext()


def _one(make: Callable, every: int, device: str) -> list[Result]:
    import ampnb

    plain, watched = _world(make, device), _world(make, device)
    clock = time.thread_time if device == "cpu" else time.perf_counter
    times: dict[str, list[float]] = {"plain": [], "watch": []}
    phases: dict[str, list] = {"plain": [], "watch": []}
    with one_thread(device == "cpu"), _kernels(device, plain[5]), \
            ampnb.watch(watched[0], watched[1], watched[3], every=every) as w:
        for _ in range(WARMUP):
            _step(plain, device, clock, [])
            _step(watched, device, clock, [])
        for k in range(STEPS):
            order = ("plain", "watch") if k % 2 else ("watch", "plain")
            for name in order:
                world = plain if name == "plain" else watched
                t0 = clock()
                _step(world, device, clock, phases[name])
                if device != "cpu":
                    torch.cuda.synchronize()
                times[name].append(clock() - t0)
    assert len(w.records) == WARMUP + STEPS
    mean = {k: statistics.fmean(v) for k, v in times.items()}
    med = {k: statistics.median(v) for k, v in times.items()}
    ratio = mean["watch"] / mean["plain"]
    goal = every == 50
    what = "thread CPU time, 1 thread" if device == "cpu" else "wall"
    rows = [Result(f"watch every={every} vs no watch ({plain[4]}, "
                   f"{'16-mixed' if plain[3] else 'bf16-mixed'}, {device}, {what}, "
                   f"{STEPS} steps each, interleaved)",
                   f"mean step: watch {ms(mean['watch'])}, plain {ms(mean['plain'])}; median "
                   f"{ms(med['watch'])} vs {ms(med['plain'])}", ratio,
                   f"<= {GOAL:.2f}x" if goal else "-", ratio <= GOAL if goal else None)]
    if goal and device == "cpu":  # phases of an asynchronous GPU step are not its time
        rows.append(_where(phases, plain[4].split(",")[0]))
    return rows


def run() -> list[Result]:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    return [row for make in (_demo_gpt, _zoo_gpt2) for every in EVERY
            for row in _one(make, every, device)]
