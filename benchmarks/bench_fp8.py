"""FP8 training step vs the bf16-mixed step on the demo transformer: emulated here, real with TE."""

from __future__ import annotations

import itertools
import warnings

import torch

from benchmarks._common import Result, interleaved_medians, ms

GOAL = 2.5  # emulated FP8 step time / bf16-mixed step time, on the CPU


def _step(model, opt, loss_fn, data, context) -> None:
    x, y = next(data)
    with context():
        loss = loss_fn(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def _runs(device: str, fp8_mode: str) -> tuple[dict, str]:
    """Two copies of the demo GPT: one under bf16-mixed, one under an FP8 mode."""
    from ampnb.models import demo
    from ampnb.modes import get_mode

    bf16, fp8 = get_mode("bf16-mixed"), get_mode(fp8_mode)
    fns = {}
    for label, mode in (("bf16-mixed", bf16), ("fp8", fp8)):
        d = demo("gpt", seed=0, device=device)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the head layer stays bf16; the report says why
            model = mode.convert_module(d.model)
        # Built after conversion, so the optimizer holds the parameters that train.
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        data = itertools.cycle([mode.convert_input(b) for b in d.batches])
        fns[label] = (lambda m=model, o=opt, lf=d.loss_fn, it=data, md=mode:
                      _step(m, o, lf, it, lambda: md.forward_context(device)))
    x, _ = d.batches[0]
    return fns, f"demo gpt, {d.n_params:,} params, batch {tuple(x.shape)}"


def _emulated(device: str) -> Result:
    fns, name = _runs(device, "transformer-engine")
    t = interleaved_medians(fns, repeat=15, warmup=3, device=device)
    ratio = t["fp8"] / t["bf16-mixed"]
    return Result(f"emulated FP8 step vs bf16-mixed ({name}, {device})",
                  f"fp8 {ms(t['fp8'])}, bf16-mixed {ms(t['bf16-mixed'])} per step",
                  ratio, f"<= {GOAL}x", ratio <= GOAL if device == "cpu" else None)


def _real() -> Result:
    from ampnb.fp8 import te_status

    status = te_status("cuda")
    if not status.ok:
        return Result("real FP8 (Transformer Engine) step vs bf16-mixed", f"skipped: {status.reason}",
                      None, "report", None)
    fns, name = _runs("cuda", "transformer-engine")  # the mode picks TE where it runs
    t = interleaved_medians(fns, repeat=15, warmup=3, device="cuda")
    ratio = t["fp8"] / t["bf16-mixed"]
    return Result(f"real FP8 (Transformer Engine) step vs bf16-mixed ({name}, cuda)",
                  f"fp8 {ms(t['fp8'])}, bf16-mixed {ms(t['bf16-mixed'])} per step",
                  ratio, "report", None)


def run() -> list[Result]:
    return [_emulated("cpu"), _real()]
