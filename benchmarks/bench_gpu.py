"""GPU figures (CUDA only): the tutorials' models and a 1.31B GPT-2 config under each mode.

Hand-written torch.amp steps (the recipe, no ampnb in the timed loop) give the reference
figures; compare() is checked against them; the doctor's time and memory and the watch's
overhead are measured on the 1.31B model. Without CUDA: one row saying so.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from benchmarks._common import Result, interleaved_medians, ms

DTYPES = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}
# GPT-2 config: 24 layers x 2048 wide, 16 heads, vocabulary 50257 (1.31B parameters), batch 8 x 512.
BIG = dict(n_layer=24, n_embd=2048, n_head=16, vocab=50257, seq=512, batch=8)


def _plain_step(model: torch.nn.Module, opt: Any, loss_fn: Callable, x: Any, y: Any
                ) -> Callable[[], None]:
    """One step with no autocast of its own: what compare() runs under each mode."""
    def step() -> None:
        opt.zero_grad(set_to_none=True)
        loss_fn(model(x), y).backward()
        opt.step()

    return step


def _amp_step(model: torch.nn.Module, opt: Any, loss: Callable[[], torch.Tensor], mode: str
              ) -> Callable[[], None]:
    """One step of the hand-written torch.amp recipe under a mode (TF32: flags on around it)."""
    dtype = DTYPES.get(mode)
    scaler = torch.amp.GradScaler("cuda") if mode == "16-mixed" else None

    def step() -> None:
        tf32 = ampnb_tf32("on" if mode == "tf32" else "off")
        with tf32:
            opt.zero_grad(set_to_none=True)
            with torch.autocast("cuda", dtype=dtype or torch.float32, enabled=dtype is not None):
                value = loss()
            if scaler is None:
                value.backward()
                opt.step()
            else:
                scaler.scale(value).backward()
                scaler.step(opt)
                scaler.update()

    return step


def ampnb_tf32(setting: str) -> contextlib.AbstractContextManager:
    """ampnb's one TF32 setting, restored after (the step's flags, as a user would set them)."""
    from ampnb.device import tf32_context

    return tf32_context(setting, "cuda")


def _demo_rows(d: Any, label: str, goal: str, judge: bool) -> tuple[list[Result], float]:
    model, opt, loss_fn, batches = d
    x, y = batches[0]
    steps = {m: _amp_step(model, opt, lambda: loss_fn(model(x), y), m)
             for m in ("32-true", "bf16-mixed")}
    hand = interleaved_medians(steps, repeat=20, warmup=5, device="cuda")
    ratio = hand["32-true"] / hand["bf16-mixed"]
    return [Result(f"gpu: {label} ({d.n_params / 1e6:.2f}M params) bf16-mixed vs 32-true "
                   "(hand-written torch.amp)",
                   f"32-true {ms(hand['32-true'])}, bf16-mixed {ms(hand['bf16-mixed'])}",
                   ratio, goal, ratio >= 2 if judge else None)], ratio


def _compare_row(d: Any, hand: float) -> Result:
    import ampnb

    model, opt, loss_fn, batches = d
    x, y = batches[0]
    found = ampnb.compare(_plain_step(model, opt, loss_fn, x, y), ("bf16-mixed",), repeat=20,
                          warmup=5, model=model)
    speedup = found.row("bf16-mixed").speedup
    agree = speedup / hand
    return Result("gpu: compare() speedup / hand-measured speedup (demo_for('cuda') GPT)",
                  f"compare {speedup:.2f}x on {found.device}, hand {hand:.2f}x", agree,
                  "within 5 %", abs(agree - 1) <= 0.05)


def _big_gpt2() -> tuple[torch.nn.Module, dict[str, torch.Tensor], torch.optim.Optimizer]:
    """The 1.31B GPT-2 built on the GPU (random init, offline), one batch of ids, fused AdamW."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import GPT2Config, GPT2LMHeadModel

    c = BIG
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = GPT2LMHeadModel(GPT2Config(vocab_size=c["vocab"], n_positions=c["seq"],
                                           n_embd=c["n_embd"], n_layer=c["n_layer"],
                                           n_head=c["n_head"], bos_token_id=0,
                                           eos_token_id=0)).train()
    ids = torch.randint(0, c["vocab"], (c["batch"], c["seq"]), device="cuda",
                        generator=torch.Generator(device="cuda").manual_seed(1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    return model, {"input_ids": ids, "labels": ids}, opt


def _peak(step: Callable[[], None]) -> int:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated()


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB"


def _big_rows() -> list[Result]:
    model, batch, opt = _big_gpt2()
    n = sum(p.numel() for p in model.parameters()) / 1e9
    steps = {m: _amp_step(model, opt, lambda: model(**batch).loss, m)
             for m in ("32-true", "tf32", "bf16-mixed", "16-mixed")}
    times = interleaved_medians(steps, repeat=5, warmup=2, device="cuda")
    peaks = {m: _peak(s) for m, s in steps.items()}
    rows = [Result(f"gpu: GPT-2 {n:.2f}B (24x2048, batch 8x512, fused AdamW) {m} step",
                   f"{ms(times[m])}, peak {_gib(peaks[m])}", times["32-true"] / times[m],
                   ">= 2x over 32-true" if m != "32-true" else "reference",
                   times["32-true"] / times[m] >= 2 if m in DTYPES else None)
                for m in steps]
    said(rows)
    opt.zero_grad(set_to_none=True)
    # The default doctor before the watch loops and the unlimited doctor: a run stopped at its
    # share of time (make gpu-check) still has the figure the doctor's goal is about.
    default, *unlimited = DOCTOR_GOALS
    rows += said(_doctor_rows(model, batch, opt, n, times["32-true"], peaks["32-true"], (default,)))
    rows += said([_watch_row(model, opt, steps["bf16-mixed"])])
    opt.zero_grad(set_to_none=True)
    rows += said(_doctor_rows(model, batch, opt, n, times["32-true"], peaks["32-true"], unlimited))
    return rows


def said(rows: list[Result]) -> list[Result]:
    """The rows, each also printed as soon as it is measured (a stopped run keeps its figures)."""
    for r in rows:
        print(f"bench_gpu: {r.name}: {r.figure} (goal {r.goal})", file=sys.stderr, flush=True)
    return rows


def _watch_row(model: torch.nn.Module, opt: Any, step: Callable[[], None], n: int = 50) -> Result:
    """A bf16-mixed loop of n steps, unwatched and under ampnb.watch(every=n), timed whole (a
    per-step sync would hide the stalls a per-step host read causes)."""
    import ampnb

    def loop(watched: bool) -> float:
        w = ampnb.watch(model, opt, every=n) if watched else contextlib.nullcontext()
        with w:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(n):
                step()
            torch.cuda.synchronize()
            return time.perf_counter() - t0

    plain, watched = [], []  # the best of two rounds each: the first round warms up
    for _ in range(2):
        plain.append(loop(False))
        watched.append(loop(True))
    ratio = min(watched) / min(plain)
    return Result(f"gpu: ampnb.watch(every={n}) on the GPT-2 bf16-mixed loop",
                  f"{ms(min(plain) / n)} -> {ms(min(watched) / n)} per step", ratio, "<= 1.03x",
                  ratio <= 1.03)


# The doctor's goals on the 1.31B config (#36): within 1.2x its default budget of 15 plain steps,
# within 40 with no limit, and a device peak within 1.5x a training-only step's.
DOCTOR_GOALS = ((None, "default budget", 18.0), (math.inf, "budget=math.inf", 40.0))
DOCTOR_MEMORY = 1.5


def _doctor_rows(model: torch.nn.Module, batch: dict, opt: Any, n: float, plain: float,
                 train_peak: int, goals: tuple = DOCTOR_GOALS) -> list[Result]:
    """The default doctor and the unlimited one: time in plain 32-true steps, device peak
    against a training-only step's, the verdict and the speeds it measured."""
    import ampnb

    rows = []
    for budget, label, goal in goals:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        model(**batch).loss.backward()  # the training peak, as the user's process had it
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        try:
            report = ampnb.doctor(model, batch, optimizer=opt, budget=budget)
        except Exception as e:  # noqa: BLE001 - a figure, not a crash: the row says what happened
            rows.append(Result(f"gpu: ampnb.doctor on the GPT-2 {n:.2f}B, {label}",
                               f"failed: {type(e).__name__}: {str(e).splitlines()[0][:160]}",
                               None, "runs", False))
            continue
        seconds = time.perf_counter() - t0
        steps, peak = seconds / plain, torch.cuda.max_memory_allocated()
        speeds = "; ".join(f"{m.label}: {m.speed}" for m in report.modes[1:] if m.ratio is not None)
        rows.append(Result(f"gpu: ampnb.doctor on the GPT-2 {n:.2f}B (dropout 0.1), {label}",
                           f"{seconds:.1f} s = {steps:.1f} plain 32-true steps; recommends "
                           f"{report.recommended.headline}; measured: {speeds or 'no speed'}",
                           steps, f"<= {goal:g} plain steps", steps <= goal))
        rows.append(Result(f"gpu: ampnb.doctor's device peak on the GPT-2 {n:.2f}B, {label}",
                           f"{_gib(peak)} vs {_gib(train_peak)} for a 32-true training step",
                           peak / train_peak, f"<= {DOCTOR_MEMORY:g}x",
                           peak / train_peak <= DOCTOR_MEMORY))
    return rows


def run() -> list[Result]:
    if not torch.cuda.is_available():
        return [Result("gpu: bf16-mixed vs 32-true step (CUDA)", "no CUDA device here", None,
                       ">= 2x", None)]
    from ampnb.models import demo, demo_for

    name = torch.cuda.get_device_name()
    rows, _ = _demo_rows(demo("gpt", device="cuda"), f"tutorial demo GPT, CPU size, on {name}",
                         "launch-bound: no gain expected", judge=False)
    gpt = demo_for("cuda", "gpt")
    found, hand = _demo_rows(gpt, "demo_for('cuda') GPT", ">= 2x", judge=True)
    rows += found
    rows.append(_compare_row(gpt, hand))
    del gpt
    rows += _demo_rows(demo_for("cuda", "mlp"), "demo_for('cuda') MLP", ">= 2x", judge=True)[0]
    said(rows)
    torch.cuda.empty_cache()
    rows += _big_rows()
    return rows
