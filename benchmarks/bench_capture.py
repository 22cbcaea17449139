"""Capture (summaries of weights, activations, gradients) and the op tracer on a demo training
step, against the same step without them."""

from __future__ import annotations

import itertools

import torch

from benchmarks._common import Result, interleaved_medians, ms, one_thread

DEMOS = ("mlp", "gpt")


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

    class CopiesOnly(ampnb.instruments.Capture):
        """Hooks and the protective copies, but no summaries: the floor under `captured`."""

        def _flush(self) -> None:
            self._pending.clear()

    def copies_only() -> None:
        with CopiesOnly(d.model):
            step()

    def traced() -> None:
        with ampnb.trace_ops():
            step()

    with one_thread(device == "cpu"):
        t = interleaved_medians({"plain": step, "capture": captured, "copies": copies_only,
                                 "trace": traced},
                                repeat=15, warmup=3, device=device)
    where = f"{device}, 1 thread" if device == "cpu" else device
    label = f"demo {name}, {d.n_params} params, {where}"
    cap, tr = t["capture"] / t["plain"], t["trace"] / t["plain"]
    return [
        Result(f"capture overhead ({label})",
               f"with capture {ms(t['capture'])}, plain step {ms(t['plain'])}",
               cap, "<= 1.10x", cap <= 1.10),
        Result(f"capture floor: hooks + copies, no summaries ({label})",
               f"hooks + copies {ms(t['copies'])}, plain step {ms(t['plain'])}",
               t["copies"] / t["plain"], "reported", None),
        Result(f"op tracer overhead ({label})",
               f"with trace_ops {ms(t['trace'])}, plain step {ms(t['plain'])}",
               tr, "reported", None),
    ]


def run() -> list[Result]:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    return [r for name in DEMOS for r in _one(name, device)]
