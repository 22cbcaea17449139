"""FP8 training step vs the bf16-mixed step on the demo transformer: emulated here, real on a GPU."""

from __future__ import annotations

import itertools
import time
import warnings

import torch

from benchmarks._common import Result, interleaved_medians, ms, one_thread

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
    cpu = device == "cpu"
    # One torch thread and this thread's CPU time: other work on a shared machine slows neither
    # step; the two steps alternate, so drift hits both alike.
    with one_thread(cpu):
        fns, name = _runs(device, "transformer-engine")
        t = interleaved_medians(fns, repeat=31, warmup=3, device=device,
                                clock=time.thread_time if cpu else time.perf_counter)
    ratio = t["fp8"] / t["bf16-mixed"]
    how = ", 1 torch thread, CPU time, median of 31 interleaved" if cpu else ""
    return Result(f"emulated FP8 step vs bf16-mixed ({name}, {device}{how})",
                  f"fp8 {ms(t['fp8'])}, bf16-mixed {ms(t['bf16-mixed'])} per step",
                  ratio, f"<= {GOAL}x", ratio <= GOAL if cpu else None)


def _saved_memory() -> Result:
    """Bytes saved for backward by one demo-GPT step: the emulated FP8 mode against bf16-mixed."""
    from ampnb.display import format_bytes
    from ampnb.instruments.memory import measure_memory
    from ampnb.models import demo

    d = demo("gpt", seed=0)
    saved = {}
    for mode in ("bf16-mixed", "transformer-engine"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the head layer stays bf16; the report says why
            saved[mode] = measure_memory(d.model, d.batches[0], d.loss_fn, mode=mode).saved_bytes
    ratio = saved["transformer-engine"] / saved["bf16-mixed"]
    return Result("activations saved for backward, emulated FP8 vs bf16-mixed (demo gpt, cpu)",
                  f"fp8 {format_bytes(saved['transformer-engine'])}, bf16-mixed "
                  f"{format_bytes(saved['bf16-mixed'])}", ratio, "<= 1.1x", ratio <= 1.1)


def _backend_runs(backend: str) -> dict:
    """The demo GPT in bf16-mixed, and converted by `backend` (its default recipe) in bf16-mixed."""
    from ampnb.fp8 import convert_to_fp8
    from ampnb.models import demo
    from ampnb.modes import get_mode

    mode, fns = get_mode("bf16-mixed"), {}
    for label in ("bf16-mixed", "fp8"):
        d = demo("gpt", seed=0, device="cuda")
        model = d.model
        if label == "fp8":
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                model, _ = convert_to_fp8(model, backend=backend)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        data = itertools.cycle(d.batches)
        fns[label] = (lambda m=model, o=opt, lf=d.loss_fn, it=data:
                      _step(m, o, lf, it, lambda: mode.forward_context("cuda")))
    return fns


def _real(backend: str) -> Result:
    from ampnb.fp8.backends import status

    label = {"te": "Transformer Engine", "torchao": "torchao"}[backend]
    why = status(backend, torch.device("cuda"), None)
    if why:
        return Result(f"real FP8 ({label}) step vs bf16-mixed", f"skipped: {why}", None,
                      "report", None)
    # TE's layers compute FP8 only inside te.fp8_autocast: the transformer-engine mode enters it.
    fns = _runs("cuda", "transformer-engine")[0] if backend == "te" else _backend_runs(backend)
    t = interleaved_medians(fns, repeat=15, warmup=5, device="cuda")
    ratio = t["fp8"] / t["bf16-mixed"]
    how = "the transformer-engine mode" if backend == "te" else "convert_to_fp8(backend='torchao')"
    return Result(f"real FP8 ({label}, {how}) step vs bf16-mixed (demo gpt, cuda)", f"fp8 {ms(t['fp8'])}, bf16-mixed {ms(t['bf16-mixed'])} "
                  "per step", ratio, "report", None)


def run() -> list[Result]:
    return [_emulated("cpu"), _saved_memory(), _real("te"), _real("torchao")]
