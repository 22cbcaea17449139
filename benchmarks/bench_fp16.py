"""fp16 on a CPU: 16-mixed with emulated fp16 kernels vs 32-true, native vs emulated, and the
16-mixed --compare / doctor column on a ~5M-parameter model.

Step times are this thread's CPU time (one torch thread), medians of interleaved runs, so that
other processes on a shared machine do not count; the doctor and compare are wall times.
"""

from __future__ import annotations

import time

import torch

from benchmarks._common import Result, gpt2_5m, interleaved_medians, ms, one_thread

GOAL = 1.5  # 16-mixed step time / 32-true step time


def _demo(name: str):
    from ampnb.models import demo

    d = demo(name, seed=0)
    return d.model, d.optimizer, d.loss_fn, d.batches


def _mlp():
    """The issue's MLP: 512 -> 2048 -> 512, batch 256."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 2048), torch.nn.GELU(), torch.nn.Linear(2048, 512))
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(256, 512, generator=g), torch.randn(256, 512, generator=g))]
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3), torch.nn.functional.mse_loss, batches


def _gpt2():
    model, batch, opt = gpt2_5m()
    return model, opt, None, [batch]


def _benches(build, variants: dict[str, tuple[str, str | None]]):
    from ampnb.workbench import Workbench

    steps = {}
    for key, (mode, kernels) in variants.items():
        model, opt, loss_fn, batches = build()
        wb = Workbench(model, opt, loss_fn, batches, mode=mode)
        if kernels:
            wb.set(fp16_kernels=kernels)
        steps[key] = wb.step
    return steps


def _step_ratios(label: str, build, native: bool, repeat: int) -> list[Result]:
    variants = {"32-true": ("32-true", None), "16-mixed": ("16-mixed", "emulated"),
                "bf16-mixed": ("bf16-mixed", None)}
    if native:
        variants["16-mixed native"] = ("16-mixed", "native")
    with one_thread():
        t = interleaved_medians(_benches(build, variants), repeat=repeat, warmup=1,
                                clock=time.thread_time)
    ratio = t["16-mixed"] / t["32-true"]
    shown = ", ".join(f"{k} {ms(v)}" for k, v in t.items())
    out = [Result(f"16-mixed (fp16 kernels emulated) vs 32-true step, {label}", shown, ratio,
                  f"<= {GOAL}x", ratio <= GOAL)]
    if native:
        slow = t["16-mixed native"] / t["16-mixed"]
        out.append(Result(f"16-mixed native vs emulated fp16 kernels, {label}",
                          f"native {ms(t['16-mixed native'])}, emulated {ms(t['16-mixed'])}",
                          slow, "informational (x faster emulated)", None))
    return out


def _compare_and_doctor() -> list[Result]:
    import ampnb
    from ampnb.batch import as_batch, step_loss

    model, batch, opt = gpt2_5m()
    run = as_batch(batch, None)

    def step():
        opt.zero_grad(set_to_none=True)
        loss = step_loss(run.call(model), run, None)
        loss.backward()
        return loss.detach()

    t0 = time.perf_counter()
    ampnb.compare(step, ["16-mixed"], repeat=3)
    compared = time.perf_counter() - t0
    t0 = time.perf_counter()
    ampnb.doctor(model, batch, optimizer=opt, modes=["16-mixed"], repeat=3)
    doctored = time.perf_counter() - t0
    return [Result("compare(32-true, 16-mixed) on GPT-2 5M, repeat 3", f"{compared:.1f} s wall",
                   compared, "<= 30 s (seconds, not minutes)", compared <= 30),
            Result("doctor with the 16-mixed column only, GPT-2 5M", f"{doctored:.1f} s wall",
                   doctored, "<= 30 s (seconds, not minutes)", doctored <= 30)]


def _tf32_emulated(label: str, build, repeat: int) -> Result:
    """32-true with TF32 emulated (products' factors rounded, the same kernel overrides as the
    fp16 emulation) against plain 32-true: what seeing TF32's effect costs on a CPU."""
    from ampnb.batch import as_batch, step_loss
    from ampnb.device import tf32_context

    model, opt, loss_fn, batches = build()
    run = as_batch(batches[0], loss_fn)

    def plain() -> None:
        opt.zero_grad(set_to_none=True)
        step_loss(run.call(model), run, loss_fn).backward()
        opt.step()

    def emulated() -> None:
        with tf32_context("emulate"):
            plain()

    with one_thread():
        t = interleaved_medians({"32-true": plain, "TF32 emulated": emulated}, repeat=repeat,
                                warmup=1, clock=time.thread_time)
    ratio = t["TF32 emulated"] / t["32-true"]
    return Result(f"32-true with TF32 emulated vs 32-true step, {label}",
                  f"TF32 emulated {ms(t['TF32 emulated'])}, 32-true {ms(t['32-true'])}", ratio,
                  "reported", None)


def run() -> list[Result]:
    from ampnb.cpu import cpu_model

    results = _step_ratios("issue's MLP 512-2048-512, batch 256", _mlp, native=True, repeat=5)
    results += _step_ratios("demo GPT", lambda: _demo("gpt"), native=True, repeat=7)
    results += _step_ratios("GPT-2 from config, 5M params", _gpt2, native=False, repeat=5)
    results.append(_tf32_emulated("demo GPT", lambda: _demo("gpt"), repeat=7))
    results += _compare_and_doctor()
    cpu = cpu_model()
    return [Result(r.name + f" [{cpu}]", r.figure, r.ratio, r.goal, r.ok) for r in results]


if __name__ == "__main__":
    for r in run():
        print(r)
