"""Capture (summaries of weights, activations, gradients) and the op tracer on training steps of
the demo and zoo models, against the same steps without them; RangeExplorer's first view."""

from __future__ import annotations

import itertools
import statistics
import sys
import time
from pathlib import Path

import torch

from benchmarks._common import Result, interleaved_medians, ms, one_thread

DEMOS = ("mlp", "cnn", "gpt")
LOOP, EVERY = 50, 50  # capture attached to training, as Lightning logs: one step in 50
CAPTURE_GOAL, OPEN_GOAL_S = 2.0, 1.0


def _demo(name: str, device: str):
    """(label, model, batch, loss_fn, optimizer, batches) of a demo."""
    from ampnb.models import demo

    d = demo(name, seed=0, device=device)
    return f"demo {name}", d.model, d.batches[0], d.loss_fn, d.optimizer, d.batches


def _zoo(device: str) -> list[tuple]:
    """The zoo's models (tests/zoo, built from transformers configs), or none without it."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "zoo"))
    try:
        from zoo_models import BUILDERS
    except ImportError:
        return []
    finally:
        sys.path.pop(0)
    out = []
    for name, build in BUILDERS.items():
        try:
            c = build()
        except ImportError:  # transformers absent: only the LSTM
            continue
        model = c.model.to(device)
        out.append((f"zoo {name}", model, c.batch, c.loss_fn, c.optimizer(), [c.batch]))
    return out


def _step_fn(model, loss_fn, optimizer, batches, device):
    from ampnb.batch import as_batch, step_loss

    runs = itertools.cycle([as_batch(b, loss_fn).to(device) for b in batches])

    def step() -> None:
        run = next(runs)
        optimizer.zero_grad(set_to_none=True)
        step_loss(run.call(model), run, loss_fn).backward()
        optimizer.step()
    return step


def _open_time(model, batch, loss_fn) -> float:
    """Median wall time of RangeExplorer(...) with its first view rendered as Jupyter would."""
    from IPython.core.interactiveshell import InteractiveShell
    from IPython.utils.capture import capture_output

    from ampnb.panels import RangeExplorer

    InteractiveShell.instance()  # display() then renders the figure's PNG
    times = []
    for _ in range(4):
        with capture_output():
            t0 = time.perf_counter()
            RangeExplorer(model, batch, loss_fn)
            times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])  # the first one pays the imports


def _one(label, model, batch, loss_fn, optimizer, batches, device: str,
         loop: bool) -> list[Result]:
    import ampnb

    step = _step_fn(model, loss_fn, optimizer, batches, device)

    def captured() -> None:
        with ampnb.capture(model) as cap:  # weights, activations, gradients; 4 formats
            step()
        assert cap.records  # summaries are part of the cost

    def traced() -> None:
        with ampnb.trace_ops():
            step()

    def summary() -> None:
        with ampnb.trace_ops(detail="summary"):
            step()

    def steps() -> None:
        for _ in range(LOOP):
            step()

    def steps_captured() -> None:
        with ampnb.capture(model, every=EVERY) as cap:
            steps()
        assert cap.records and cap.forwards == LOOP

    cpu = device == "cpu"
    # Thread CPU time on CPU (one torch thread: autograd runs in this thread too), so other
    # work on a shared machine does not count; wall time with a sync on a GPU.
    clock = time.thread_time if cpu else time.perf_counter
    with one_thread(cpu):
        t = interleaved_medians({"plain": step, "capture": captured, "trace": traced,
                                 "summary": summary}, repeat=21, warmup=2, device=device,
                                clock=clock)
        tl = interleaved_medians({"loop": steps, "loop+capture": steps_captured}, repeat=7,
                                 warmup=1, device=device, clock=clock) if loop else None
        opened = _open_time(model, batch, loss_fn)
    where = f"{device}, 1 thread" if cpu else device
    name = f"{label}, {sum(p.numel() for p in model.parameters()):,} params, {where}"
    cap = t["capture"] / t["plain"]
    rows = [
        Result(f"capture of one whole step, every tensor (every=1) ({name})",
               f"with capture {ms(t['capture'])}, plain step {ms(t['plain'])}",
               cap, f"<= {CAPTURE_GOAL:g}x", cap <= CAPTURE_GOAL),
        Result(f"op tracer overhead, full / summary ({name})",
               f"trace_ops {ms(t['trace'])}, detail='summary' {ms(t['summary'])} "
               f"({t['summary'] / t['plain']:.2f}x), plain {ms(t['plain'])}",
               t["trace"] / t["plain"], "reported", None),
        Result(f"RangeExplorer open: capture + first view rendered ({label}, {device})",
               f"{ms(opened)} median of 3", opened, f"<= {OPEN_GOAL_S:g} s",
               opened <= OPEN_GOAL_S),
    ]
    if tl is not None:
        per = tl["loop+capture"] / tl["loop"]
        rows.insert(0, Result(
            f"capture attached to training, every={EVERY} ({name})",
            f"{LOOP} steps {ms(tl['loop+capture'])} with capture, {ms(tl['loop'])} without",
            per, "<= 1.10x", per <= 1.10))
    return rows


def _larger(device: str) -> list[Result]:
    """Capture every=1 on a 5.3M-parameter GPT-2 from a config: per-tensor fixed costs weigh
    less there than on the tiny demo and zoo models (reported next to them, not judged)."""
    import ampnb
    from benchmarks._common import gpt2_5m

    model, batch, optimizer = gpt2_5m()
    step = _step_fn(model.to(device), None, optimizer, [batch], device)

    def captured() -> None:
        with ampnb.capture(model) as cap:
            step()
        assert cap.records

    cpu = device == "cpu"
    with one_thread(cpu):
        t = interleaved_medians({"plain": step, "capture": captured}, repeat=5, warmup=1,
                                device=device, clock=time.thread_time if cpu else time.perf_counter)
    where = f"{device}, 1 thread" if cpu else device
    return [Result(f"capture of one whole step, every tensor (every=1) (GPT-2 from config, "
                   f"{sum(p.numel() for p in model.parameters()):,} params, {where})",
                   f"with capture {ms(t['capture'])}, plain step {ms(t['plain'])}",
                   t["capture"] / t["plain"], "reported", None)]


def run() -> list[Result]:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    cases = [(*_demo(n, device), True) for n in DEMOS] + [(*c, False) for c in _zoo(device)]
    rows = [r for *case, loop in cases for r in _one(*case, device=device, loop=loop)]
    try:
        rows += _larger(device)
    except ImportError:  # transformers absent
        pass
    return rows
