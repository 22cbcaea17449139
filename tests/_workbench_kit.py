"""Shared pieces of the Workbench tests: a tiny model, bit-exact comparisons, hand loops."""

from __future__ import annotations

import contextlib
import copy
import math
import os
import signal
import sys

import pytest
import torch

import ampnb.workbench
from ampnb import _interrupt

CPU_MODES = ["32-true", "16-mixed", "bf16-mixed", "16-true", "bf16-true", "64-true"]
WORKBENCH_DIR = os.path.dirname(ampnb.workbench.__file__)
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def make(seed: int = 0, n_batches: int = 3, huge: tuple[int, ...] = ()):
    """A tiny MLP, Adam and regression batches; batch i in `huge` overflows fp16."""
    gen = torch.Generator().manual_seed(seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(),
                                    torch.nn.Linear(16, 4))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    batches = [(torch.randn(16, 8, generator=gen) * (1e6 if i in huge else 1.0),
                torch.randn(16, 4, generator=gen)) for i in range(n_batches)]
    return model, opt, torch.nn.functional.mse_loss, batches


def weights(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bit patterns (so NaN == NaN when the bits agree)."""
    return t.view(_INT_OF_SIZE[t.element_size()]) if t.is_floating_point() else t


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    """Bit-identical, dtype included."""
    return a.keys() == b.keys() and all(a[k].dtype == b[k].dtype
                                        and torch.equal(bits(a[k]), bits(b[k])) for k in a)


def same_floats(a: list[float], b: list[float]) -> bool:
    """Equal lists of Python floats, where NaN matches NaN."""
    return len(a) == len(b) and all(x == y or (math.isnan(x) and math.isnan(y))
                                    for x, y in zip(a, b))


def opt_state(opt) -> dict:
    return copy.deepcopy(opt.state_dict())


def same_opt(a: dict, b: dict) -> bool:
    return a["param_groups"] == b["param_groups"] and a["state"].keys() == b["state"].keys() and all(
        a["state"][i].keys() == b["state"][i].keys()
        and all(torch.equal(bits(a["state"][i][k]), bits(b["state"][i][k]))
                and a["state"][i][k].dtype == b["state"][i][k].dtype for k in a["state"][i])
        for i in a["state"])


def _autocast(dtype):
    return lambda: torch.autocast("cpu", dtype=dtype)


@contextlib.contextmanager
def _default_dtype(dtype):
    """Written out, not ampnb.modes.default_dtype: the reference loop uses plain torch only."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


# mode -> (module dtype, input dtype, forward context) as Lightning Fabric's plugins do it.
HAND = {
    "32-true": (torch.float32, torch.float32, contextlib.nullcontext),
    "bf16-mixed": (torch.float32, torch.bfloat16, _autocast(torch.bfloat16)),
    "16-mixed": (torch.float32, torch.float16, _autocast(torch.float16)),
    "bf16-true": (torch.bfloat16, torch.bfloat16, lambda: _default_dtype(torch.bfloat16)),
    "16-true": (torch.float16, torch.float16, lambda: _default_dtype(torch.float16)),
    "64-true": (torch.float64, torch.float64, lambda: _default_dtype(torch.float64)),
}


def hand_loop(mode: str, steps: int, huge=(), kernels: str | None = None):
    """The training loop written out with plain torch: losses, skips and final weights.

    fp16 modes run their products as ampnb.fp16_kernels decides for `kernels` on this CPU
    (the Workbench's default), the whole step inside the emulation where it applies.
    """
    from ampnb.fp16_kernels import emulated_fp16_kernels, emulates_fp16

    model, _, loss_fn, batches = make(huge=huge)
    p_dtype, x_dtype, ctx = HAND[mode]
    model.to(p_dtype)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu") if mode == "16-mixed" else None
    losses, skipped, out_dtypes = [], [], []
    emulate = mode in ("16-mixed", "16-true") and emulates_fp16("cpu", kernels)
    with emulated_fp16_kernels(emulate):
        _steps(model, opt, scaler, loss_fn, batches, ctx, x_dtype, steps, losses, skipped, out_dtypes)
    return losses, skipped, out_dtypes, weights(model)


def _steps(model, opt, scaler, loss_fn, batches, ctx, x_dtype, steps, losses, skipped, out_dtypes):
    for i in range(steps):
        x, y = batches[i % len(batches)]
        opt.zero_grad(set_to_none=True)
        with ctx():
            out = model(x.to(x_dtype))
        out_dtypes.append(out.dtype)
        loss = loss_fn(out.float(), y)
        if scaler:
            scale = scaler.get_scale()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            skipped.append(scaler.get_scale() < scale)
        else:
            loss.backward()
            opt.step()
            skipped.append(False)
        losses.append(loss.item())


class InterruptAt:
    """Raise KeyboardInterrupt at the n-th line run in ampnb/workbench, as Jupyter's interrupt would.

    While ampnb holds SIGINT back (`_interrupt.deferred`), a real signal would be held, not
    raised: then `_hold` is called instead, exactly as the signal handler would be.
    """

    def __init__(self, n: int) -> None:
        self.n, self.lines, self.fired = n, 0, False

    def _global(self, frame, event, arg):
        return self._local if frame.f_code.co_filename.startswith(WORKBENCH_DIR) else None

    def _local(self, frame, event, arg):
        if event == "line" and not self.fired:
            self.lines += 1
            if self.lines == self.n:
                self.fired = True
                if signal.getsignal(signal.SIGINT) is _interrupt._hold:
                    _interrupt._hold(signal.SIGINT, frame)
                else:
                    raise KeyboardInterrupt
        return self._local

    def __enter__(self) -> InterruptAt:
        sys.settrace(self._global)
        return self

    def __exit__(self, *exc: object) -> None:
        sys.settrace(None)


def consistent(wb) -> bool:
    """Mode name matches the weights' dtype; the optimizer holds exactly the live parameters."""
    held = [id(p) for g in wb.optimizer.param_groups for p in g["params"]]
    dtype_ok = wb.param_dtype == wb.mode.param_dtype
    return dtype_ok and sorted(held) == sorted(id(p) for p in wb.model.parameters())
