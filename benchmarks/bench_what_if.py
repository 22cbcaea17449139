"""`ampnb.what_if` on the demo GPT (7 default formats) against one plain training step.

Time: thread CPU time on one torch thread (interleaved medians), or wall time on a GPU.
Memory: on a GPU, the CUDA allocator's peak above the start; on a CPU, each figure in a fresh
process (`python -m benchmarks.bench_what_if plain|what_if`) as the peak RSS above the RSS
before a second call (the first one warms up), with glibc mmap-ing every allocation of 64 KiB or more so that freed tensors
leave the resident set (a process-wide peak would be mostly Python and torch themselves).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import torch

from benchmarks._common import Result, interleaved_medians, ms, one_thread

TIME_GOAL, MEMORY_GOAL = 3.0, 1.5
MARK = "RESULT "


def _demo(device: str = "cpu"):
    from ampnb.models import demo

    d = demo("gpt", seed=0, device=device)
    return d.model, d.batches[0], d.loss_fn, d.optimizer


def _runners(device: str):
    import ampnb
    from ampnb.batch import as_batch
    from ampnb.step import train_step

    model, batch, loss_fn, optimizer = _demo(device)
    p, data = ampnb.Precision.of("32-true", model=model, device=device), as_batch(batch, loss_fn)
    return {"plain": lambda: train_step(p, model, optimizer, data, loss_fn),
            "what_if": lambda: ampnb.what_if(model, batch, loss_fn)}


def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field))


def child(kind: str) -> dict[str, float]:
    """Peak RSS above the start of a second call of `kind` (call it in a fresh process)."""
    torch.set_num_threads(1)
    fn = _runners("cpu")[kind]
    fn()  # warm: imports, kernels' first-call caches, AdamW's state are not the call's memory
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM (the peak) to the current RSS
    before = _rss_kib("VmRSS:")
    fn()
    return {"peak_kib": _rss_kib("VmHWM:") - before}


def _cpu_memory() -> dict[str, float]:
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    out = {}
    for kind in ("plain", "what_if"):
        done = subprocess.run([sys.executable, "-m", "benchmarks.bench_what_if", kind],
                              capture_output=True, text=True, env=env, timeout=600, check=True)
        line = next(x for x in done.stdout.splitlines() if x.startswith(MARK))
        out[kind] = json.loads(line.removeprefix(MARK))["peak_kib"] * 1024
    return out


def _cuda_memory(runners) -> dict[str, float]:
    out = {}
    for kind, fn in runners.items():
        torch.cuda.synchronize()
        start = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        fn()
        torch.cuda.synchronize()
        out[kind] = torch.cuda.max_memory_allocated() - start
    return out


def run() -> list[Result]:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    cpu = device == "cpu"
    runners = _runners(device)
    with one_thread(cpu):
        t = interleaved_medians(runners, repeat=7, warmup=1, device=device,
                                clock=time.thread_time if cpu else time.perf_counter)
    mem = _cpu_memory() if cpu else _cuda_memory(runners)
    where = f"demo GPT, {device}" + (", 1 thread" if cpu else "")
    ratio, mratio = t["what_if"] / t["plain"], mem["what_if"] / max(mem["plain"], 1)
    how = "peak RSS above the start, fresh processes" if cpu else "CUDA peak above the start"
    return [
        Result(f"what_if, 7 formats x weight/input/grad_output, vs one plain step ({where})",
               f"what_if {ms(t['what_if'])}, plain step {ms(t['plain'])}", ratio,
               f"<= {TIME_GOAL:g}x", ratio <= TIME_GOAL),
        Result(f"what_if memory vs one plain step ({where}; {how})",
               f"what_if {mem['what_if'] / 2**20:.2f} MiB, plain step {mem['plain'] / 2**20:.2f} MiB",
               mratio, f"<= {MEMORY_GOAL:g}x", mratio <= MEMORY_GOAL),
    ]


if __name__ == "__main__":
    print(MARK + json.dumps(child(sys.argv[1])))
