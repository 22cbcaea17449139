"""Reproduce each classic GradScaler mistake on a tiny real model and measure what it does."""

from __future__ import annotations

import warnings

import torch

from ampnb.formats import get_format
from ampnb.putback import generator
from ampnb.scaler.records import format_scale

_LR = 0.1


def _tiny(seed: int = 0, width: int = 16) -> tuple[torch.nn.Module, torch.optim.Optimizer,
                                                  torch.Tensor, torch.Tensor]:
    """A two-layer MLP, its SGD optimizer and one batch; the same every time for a seed."""
    gen = generator(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, width), torch.nn.ReLU(), torch.nn.Linear(width, 4))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    x, y = torch.randn(32, 8, generator=gen), torch.randn(32, 4, generator=gen)
    return model, torch.optim.SGD(model.parameters(), lr=_LR), x, y


def _backward(model, scaler, x, y) -> None:
    with torch.autocast("cpu", dtype=torch.float16):
        loss = torch.nn.functional.mse_loss(model(x), y)
    scaler.scale(loss).backward()


def _norm(model: torch.nn.Module) -> float:
    grads = [p.grad.reshape(-1) for p in model.parameters() if p.grad is not None]
    return torch.linalg.vector_norm(torch.cat(grads)).item()


def unscale_twice() -> tuple[str, dict]:
    model, opt, x, y = _tiny()
    scaler = torch.amp.GradScaler("cpu")
    _backward(model, scaler, x, y)
    scaler.unscale_(opt)
    once = _norm(model)
    try:
        scaler.unscale_(opt)
    except RuntimeError as err:
        return str(err), {"scale": format_scale(scaler.get_scale()), "norm": f"{once:.4g}"}
    raise AssertionError("torch accepted unscale_() twice")  # torch changed: the test will say


def clip_scaled(clip_norm: float = 1.0) -> tuple[str, dict]:
    model, opt, x, y = _tiny()
    scaler = torch.amp.GradScaler("cpu")
    _backward(model, scaler, x, y)
    scaled = _norm(model)
    torch.nn.utils.clip_grad_norm_(model.parameters(), clip_norm)  # the mistake
    scaler.unscale_(opt)
    wrong = _norm(model)
    model2, opt2, _, _ = _tiny()
    scaler2 = torch.amp.GradScaler("cpu")
    _backward(model2, scaler2, x, y)
    scaler2.unscale_(opt2)
    true = _norm(model2)
    torch.nn.utils.clip_grad_norm_(model2.parameters(), clip_norm)  # the right order
    right = _norm(model2)
    return "", {"scale": format_scale(scaler.get_scale()), "scaled": f"{scaled:.4g}",
                "true": f"{true:.4g}", "clip": clip_norm, "wrong": f"{wrong:.4g}",
                "right": f"{right:.4g}", "ratio": f"{right / wrong:.4g}"}


def update_without_step() -> tuple[str, dict]:
    model, opt, x, y = _tiny()
    scaler = torch.amp.GradScaler("cpu")
    _backward(model, scaler, x, y)
    try:
        scaler.update()
        message = ""
    except AssertionError as err:
        message = str(err)
    # The quieter variant: unscale_ then update, no step. torch accepts it.
    before = [p.detach().clone() for p in model.parameters()]
    scaler.unscale_(opt)
    scaler.update()
    same = all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    tracker = scaler.state_dict()["_growth_tracker"]
    return message, {"tracker": tracker, "unchanged": same}


def scheduler_before_step() -> tuple[str, dict]:
    model, opt, x, y = _tiny()
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1)
    # A scale too large for fp16 makes the first step overflow, as 2^16 often does early on.
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**24)
    scale = scaler.get_scale()
    _backward(model, scaler, x, y)
    scaler.unscale_(opt)
    found = bool(sum(v.item() for v in scaler._found_inf_per_device(opt).values()))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        scaler.step(opt)
        scaler.update()
        scheduler.step()
    message = next((str(w.message) for w in caught if "lr_scheduler.step()" in str(w.message)), "")
    return message, {"scale": format_scale(scale), "found_inf": found, "new": format_scale(scaler.get_scale())}


def scale_collapse(steps: int = 20) -> tuple[str, dict]:
    model, opt, x, y = _tiny()
    with torch.no_grad():  # weights as a bf16-trained model may hold them: beyond fp16's reach
        model[0].weight.mul_(2.0e4)
    scaler = torch.amp.GradScaler("cpu")
    skipped, scales = 0, []
    for _ in range(steps):
        _backward(model, scaler, x, y)
        scaler.unscale_(opt)
        skipped += bool(sum(v.item() for v in scaler._found_inf_per_device(opt).values()))
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        scales.append(scaler.get_scale())
    wmax = max(p.detach().abs().max().item() for p in model.parameters())
    return "", {"steps": steps, "skipped": skipped, "first": format_scale(2.0**16),
                "final": format_scale(scales[-1]), "wmax": f"{wmax:.3g}", **format_ranges()}


def format_ranges() -> dict:
    """fp16, bf16 and fp32 limits, derived from their bits, as text for the explanations."""
    fp16, bf16, fp32 = get_format("fp16"), get_format("bf16"), get_format("fp32")
    return {"bf16_exp": bf16.exponent_bits, "fp16_max": f"{fp16.max:g}", "bf16_max": f"{bf16.max:.4g}",
            "fp16_min": f"2^{fp16.min_exponent}", "bf16_min": f"2^{bf16.min_exponent}",
            "fp32_min": f"2^{fp32.min_exponent}", "fp16_sub": f"2^{fp16.min_exponent - fp16.mantissa_bits}"}


def bf16_no_scaler() -> tuple[str, dict]:
    return "", format_ranges()


def fp16_grads() -> tuple[str, dict]:
    model, opt, x, y = _tiny()
    model.half()
    scaler = torch.amp.GradScaler("cpu")
    loss = torch.nn.functional.mse_loss(model(x.half()), y.half())
    scaler.scale(loss).backward()
    message = ""
    try:
        scaler.unscale_(opt)
    except ValueError as err:
        message = str(err)
    fp16 = get_format("fp16")
    # An fp16 weight of 1.0 cannot take an update smaller than half its spacing.
    update = fp16.eps / 4
    one = torch.tensor(1.0, dtype=torch.float16)
    lost = bool((one - update) == one)
    return message, {"eps": f"2^{-fp16.mantissa_bits}", "update": f"{update:.3g}",
                     "lost": lost, "fp32_kept": bool(torch.tensor(1.0) - update != 1.0)}
