"""GPU figures: demo GPT training step bf16-mixed vs 32-true on CUDA, and --compare vs a hand timing."""

from __future__ import annotations

import torch

from benchmarks._common import Result, interleaved_medians, ms


def _step(demo, mode: str, device: str):
    """One training step of a demo under a mode, written out with plain torch.amp."""
    model, opt, loss_fn, batches = demo
    x, y = (t.to(device) for t in batches[0])
    dtype = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}.get(mode)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=dtype or torch.float32, enabled=dtype is not None):
            loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()

    return step


def run() -> list[Result]:
    if not torch.cuda.is_available():
        return [Result("gpu: bf16-mixed vs 32-true step (CUDA)", "no CUDA device here", None,
                       ">= 2x", None)]
    import ampnb
    from ampnb.models import demo

    device = "cuda"
    d = demo("gpt")
    d.model.to(device)
    hand = interleaved_medians({m: _step(d, m, device) for m in ("32-true", "bf16-mixed")},
                               repeat=20, warmup=5, device=device)
    ratio = hand["32-true"] / hand["bf16-mixed"]
    rows = [Result("gpu: demo GPT step bf16-mixed vs 32-true (hand-written torch.amp)",
                   f"32-true {ms(hand['32-true'])}, bf16-mixed {ms(hand['bf16-mixed'])} "
                   f"on {torch.cuda.get_device_name()}", ratio, ">= 2x", ratio >= 2)]
    tool = ampnb.compare(_step(d, "32-true", device), ("bf16-mixed",), device=device, repeat=20,
                         warmup=5)
    speedup = tool.row("bf16-mixed").speedup
    agree = speedup / ratio
    rows.append(Result("gpu: compare() speedup / hand-measured speedup",
                       f"compare {speedup:.2f}x, hand {ratio:.2f}x", agree, "within 5 %",
                       abs(agree - 1) <= 0.05))
    table = ampnb.device.throughput_table("cuda")
    for r in table.rows:
        rows.append(Result(f"gpu: {r[1]} matmul n={r[2]}", f"{r[3]}, {r[4]} TFLOP/s", None,
                           "measured", None))
    return rows
