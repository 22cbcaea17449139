"""Shared pieces for benchmarks: a result row and a median timer with warm-up and sync."""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from ampnb.device import sync


@dataclass(frozen=True)
class Result:
    """One benchmark figure, the ratio it is judged by, and its goal."""

    name: str
    figure: str          # what was measured, e.g. "ampnb 41 ms, numpy 390 ms"
    ratio: float | None  # the number the goal is about, e.g. 9.5 (x faster)
    goal: str            # e.g. ">= 5x"
    ok: bool | None      # None where the goal cannot be judged on this machine


@contextlib.contextmanager
def one_thread(on: bool = True) -> Iterator[None]:
    """One intra-op torch thread: on a shared machine other work then slows every variant alike."""
    before = torch.get_num_threads()
    if on:
        torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def median_time(fn: Callable[[], object], repeat: int = 7, warmup: int = 2,
                device: str | torch.device = "cpu") -> float:
    """Median wall time of fn() in seconds, after warm-up, with device sync."""
    for _ in range(warmup):
        fn()
    sync(device)
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def interleaved_medians(fns: dict[str, Callable[[], object]], repeat: int = 7, warmup: int = 2,
                        device: str | torch.device = "cpu",
                        clock: Callable[[], float] = time.perf_counter) -> dict[str, float]:
    """Median times of several functions measured round-robin, so drift hits all alike.

    `clock=time.thread_time` counts only this thread's CPU time (with one torch thread, CPU
    autograd runs here too), so other processes on a shared machine do not count.
    """
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeat):
        for k, fn in fns.items():
            sync(device)
            t0 = clock()
            fn()
            sync(device)
            times[k].append(clock() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms"


def _gpt2(vocab: int, seq: int, width: int, layers: int, heads: int, batch: int
          ) -> tuple[torch.nn.Module, dict[str, torch.Tensor], torch.optim.Optimizer]:
    """A transformers GPT-2 from a config (random init, offline), one batch of ids, AdamW."""
    import os

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=vocab, n_positions=seq, n_embd=width,
                                       n_layer=layers, n_head=heads, bos_token_id=0,
                                       eos_token_id=0)).train()
    ids = torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(1))
    return model, {"input_ids": ids, "labels": ids}, torch.optim.AdamW(model.parameters(), lr=1e-4)


def gpt2_5m() -> tuple[torch.nn.Module, dict[str, torch.Tensor], torch.optim.Optimizer]:
    """A ~5M-parameter GPT-2 (6 x 256, vocab 2048, seq 64, batch 4), a batch, AdamW."""
    return _gpt2(vocab=2048, seq=64, width=256, layers=6, heads=4, batch=4)


def gpt2_17m() -> tuple[torch.nn.Module, dict[str, torch.Tensor], torch.optim.Optimizer]:
    """A ~17M-parameter GPT-2 (6 x 384, vocab 16000, seq 128), a batch, AdamW.

    Batch 2: a plain AdamW step then takes a few tenths of a second on one thread, the size
    issue #25 measured the doctor against.
    """
    return _gpt2(vocab=16000, seq=128, width=384, layers=6, heads=6, batch=2)
