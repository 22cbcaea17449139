"""8-bit Adam (emulated) vs fp32 Adam on the demo GPT: step time, and optimizer-state bytes."""

from __future__ import annotations

import itertools
import time

import torch

from benchmarks._common import Result, interleaved_medians, ms, one_thread

STATE_GOAL = 0.30  # 8-bit state / fp32 state: 2 bytes + absmax per 256 values vs 8 bytes
KNOBS = dict(width=128, depth=2, n_head=4)


def _step(model, opt, loss_fn, data) -> None:
    x, y = next(data)
    loss_fn(model(x), y).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def _runs() -> tuple[dict, dict, str]:
    from ampnb.instruments.memory import measure_memory
    from ampnb.lowbit import Adam8bit
    from ampnb.models import demo

    fns, sizes = {}, {}
    for label, make in (("adam", torch.optim.Adam), ("adam8bit", Adam8bit)):
        d = demo("gpt", seed=0, **KNOBS)  # wider than shipped: most state in 8-bit blocks
        opt = make(d.model.parameters(), lr=1e-3)
        sizes[label] = measure_memory(d.model, d.batches[0], d.loss_fn, optimizer=opt).optimizer_bytes
        data = itertools.cycle(d.batches)
        fns[label] = lambda m=d.model, o=opt, lf=d.loss_fn, it=data: _step(m, o, lf, it)
    return fns, sizes, f"demo gpt, {d.n_params:,} params"


def _shipped() -> Result:
    """The same share on the demo GPT as shipped (what `lowbit.compare_optimizers("gpt")`
    trains): its small tensors (under 4096 values) keep fp32 state, so the share is larger."""
    from ampnb.instruments.memory import measure_memory
    from ampnb.lowbit import Adam8bit
    from ampnb.models import demo

    sizes = {}
    for label, make in (("adam", torch.optim.Adam), ("adam8bit", Adam8bit)):
        d = demo("gpt", seed=0)
        opt = make(d.model.parameters(), lr=1e-3)
        sizes[label] = measure_memory(d.model, d.batches[0], d.loss_fn, optimizer=opt).optimizer_bytes
    share = sizes["adam8bit"] / sizes["adam"]
    return Result(f"Adam8bit optimizer state vs Adam (demo gpt as shipped, {d.n_params:,} params)",
                  f"{sizes['adam8bit']:,} B vs {sizes['adam']:,} B (ampnb memory meter)",
                  share, "report", None)


def run() -> list[Result]:
    with one_thread():
        fns, sizes, name = _runs()
        t = interleaved_medians(fns, repeat=9, warmup=2, clock=time.thread_time)
    state = sizes["adam8bit"] / sizes["adam"]
    return [_shipped(),
        Result(f"Adam8bit optimizer state vs Adam ({name})",
               f"{sizes['adam8bit']:,} B vs {sizes['adam']:,} B (ampnb memory meter)",
               state, f"<= {STATE_GOAL}", state <= STATE_GOAL),
        Result(f"emulated Adam8bit training step vs Adam ({name}, cpu)",
               f"adam8bit {ms(t['adam8bit'])}, adam {ms(t['adam'])} per step",
               t["adam8bit"] / t["adam"], "report", None),
    ]
