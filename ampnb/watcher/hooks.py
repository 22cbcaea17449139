"""The watch's module and tensor hooks, and what one optimizer step collects through them.

Modules are hooked on statistics steps only (one in `every`): a forward hook on every module
would cost a few percent of a small model's step. Between them a step keeps only references to
its backward roots (its losses), on their device: nothing is read back to the host until the
next statistics step, `close()` or `records` (a read would make a GPU wait), and a non-finite
step there is recorded without naming its module (nothing the user computes is run again to find
it: `keep_overflow` and `ampnb.diagnosis.replay` name the op). On statistics steps a module's
forward hook keeps a detached reference to its output, for the current micro-batch; when that
micro-batch's backward ends, one probe of its loss says whether anything is to be looked for,
and only then are the kept outputs probed, in the order the modules finished, to name the first
non-finite one. In backward, the module named is the one whose backward first made a non-finite
gradient of its input; else the last module in forward order whose own parameter gradients hold
inf/NaN. Ranges (amax) are taken as 0-dim tensors turned into floats once at the step's end.
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ampnb._tree import tensors
from ampnb.formats import get_format
from ampnb.putback import Rng

# |x| at or below half fp16's smallest subnormal rounds to 0 (the tie goes to even: 0)
FP16_FLUSH = get_format("fp16").smallest_subnormal / 2


class Gone:
    """What a watch hook becomes when its module is pickled or deep-copied: does nothing."""

    def __call__(self, *args: Any, **kwargs: Any) -> None:
        return None


class Hook(functools.partial):
    """A hook that pickles and deep-copies as `Gone` (a saved or copied model takes no watch
    along) and never raises into the user's step: a failure goes to its owner's `failed`
    (a watch's or a step's: one warning, the record marked incomplete)."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().__call__(*args, **kwargs)
        except Exception as e:  # an instrument never raises into training
            report = getattr(getattr(self.func, "__self__", None), "failed", None)
            if report is None:
                warnings.warn(f"ampnb.watch: a hook failed ({type(e).__name__}: {e})",
                              RuntimeWarning, stacklevel=2)
            else:
                report(e)
            return None

    def __reduce__(self) -> tuple:
        return (Gone, ())


def strip_gone(model: nn.Module) -> None:
    """Drop the `Gone` hooks a pickled watched model brought along."""
    for m in model.modules():
        for hooks in (m._forward_hooks, m._forward_pre_hooks):
            for k in [k for k, h in hooks.items() if isinstance(h, Gone)]:
                del hooks[k]


def exact_probe(t: torch.Tensor) -> torch.Tensor:
    """A 0-dim tensor that is finite exactly when every element of t is: its sum, accumulated
    where no sum of finite values can overflow (fp16 in fp32, wider formats in fp64). One
    reduction, several times cheaper than `isfinite(t).all()` on CPU."""
    return t.sum(dtype=torch.float32 if t.dtype == torch.float16 else torch.float64)


def fast_probe(t: torch.Tensor) -> torch.Tensor:
    """t's sum in fp32: inf/NaN when t holds any, and (only for finite values within a factor
    numel of fp32's max) when the sum overflows; `first_nonfinite` confirms. ~10x cheaper than
    a sum in fp64 on CPU."""
    return t.sum(dtype=torch.float32)


def finite(probes: list[torch.Tensor]) -> list[bool]:
    """Which probes are finite (one stack and one sync per dtype)."""
    ok = [True] * len(probes)
    by_dtype: dict[torch.dtype, list[int]] = {}
    for k, p in enumerate(probes):
        by_dtype.setdefault(p.dtype, []).append(k)
    for ks in by_dtype.values():
        for k, v in zip(ks, torch.stack([probes[k] for k in ks]).isfinite().tolist()):
            ok[k] = v
    return ok


def first_nonfinite(ts: list[torch.Tensor]) -> int | None:
    """Index of the first tensor holding inf/NaN (None: all finite): fast probes, one sync, and
    an exact check of those the probes flag."""
    if not ts:
        return None
    for k, ok in enumerate(finite([fast_probe(t) for t in ts])):
        if not ok and not bool(torch.isfinite(ts[k]).all()):
            return k
    return None


def finite_amax(t: torch.Tensor) -> torch.Tensor:
    """Largest finite |t| as a 0-dim float32 tensor (0 when none); no sync. nan_to_num, not
    where(isfinite): several times faster on CPU."""
    return t.abs().nan_to_num(0.0, 0.0).amax().float()


def flush_counts(g: torch.Tensor, divisor: float) -> torch.Tensor:
    """[nonzero values of g / divisor that fp16 rounds to 0, nonzero values] (int64, no sync)."""
    a = g.abs()
    nonzero = torch.count_nonzero(a)
    at_most = torch.count_nonzero(a <= FP16_FLUSH * divisor)  # zeros included
    return torch.stack([at_most - (a.numel() - nonzero), nonzero])


def float_outputs(out: Any) -> list[torch.Tensor]:
    """The floating tensors a module returned (a tensor, or inside any container)."""
    found = [out] if isinstance(out, torch.Tensor) else tensors(out)
    return [t for t in found if t.is_floating_point() and t.numel()]


def module_names(model: nn.Module) -> tuple[list[nn.Module], list[str], list[int]]:
    """Every module, its name (the root: its class name, as the hunter says it) and the indices
    of those that get statistics: leaves and modules with parameters of their own."""
    mods, names, stats = [], [], []
    for i, (n, m) in enumerate(model.named_modules()):
        mods.append(m)
        names.append(n or type(m).__name__)
        if next(m.children(), None) is None or next(m.parameters(recurse=False), None) is not None:
            stats.append(i)
    return mods, names, stats


def _maxed(d: dict[int, torch.Tensor], i: int, v: torch.Tensor) -> None:
    d[i] = v if i not in d else torch.maximum(d[i], v)


class StepState:
    """What one optimizer step collected: tensors until its end, then floats."""

    def __init__(self, stats: bool, scale: float | None = None) -> None:
        self.stats = stats
        self.scale = scale             # the GradScaler's scale this step runs at (None: none)
        self.t0 = math.nan
        self.seconds = math.nan
        self.time = math.nan
        self.micro_batches = 0
        self.roots: list[torch.Tensor] = []                # scalar backward roots (losses), as run
        self.explicit: list[float | torch.Tensor] = []     # losses given to log_loss()
        self.outputs: list[tuple[int, torch.Tensor]] = []  # this micro-batch's, finish order
        self.first: tuple[int | None, str] | None = None   # first non-finite (module, phase)
        self.backward: list[tuple[int, torch.Tensor]] = []  # stats steps: input grad probes
        self.act: dict[int, torch.Tensor] = {}
        self.act_grad: dict[int, torch.Tensor] = {}        # scaled where the loss was
        self.grad: dict[int, torch.Tensor] = {}   # amax of the grads as read (/ divisor)
        self.flush: dict[int, torch.Tensor] = {}  # [flushed, nonzero]
        self.divisor = 1.0
        self.grads_read = False
        self.found_inf: torch.Tensor | None = None    # a fused step's, from its GradScaler
        self.grads_first: int | None = None  # stats steps: first module with non-finite grads
        self.grads_probe: torch.Tensor | None = None  # no scaler: finite iff every grad was
        self.skipped = False
        self.inputs: list[tuple[tuple, dict]] = []        # keep_overflow: this step's batches
        self.entries: list[str] = []                       # ... and the module each entered
        self.out_grads: list[list[torch.Tensor | None]] = []  # ... and its outputs' gradients
        self.rng: Rng | None = None  # keep_overflow: every generator at its first forward
        self.scaler_state: dict[str, Any] | None = None  # ... and the scaler's, at its start
        self.autocast: list[tuple[str, torch.dtype]] = []
        self.before: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | None = None
        self.lost: float | None = None
        self.layers: tuple = ()
        self.incomplete = False  # a hook failed: some figures are missing
        self.report: Callable[[Exception], None] | None = None  # the watch's warning

    def failed(self, e: Exception) -> None:
        """One of this step's hooks failed: the record is incomplete; the watch warns."""
        self.incomplete = True
        if self.report is not None:
            self.report(e)

    # ----- hooks ---------------------------------------------------------------------------

    def on_output(self, i: int, stats: bool, args: Any, out: Any) -> None:
        """A module's forward ended: keep its outputs until the backward; on stats steps, its
        output ranges and hooks on the gradients of its output and inputs."""
        for t in float_outputs(out):
            d = t.detach()
            self.outputs.append((i, d))
            if stats:
                _maxed(self.act, i, finite_amax(d))
                if t.requires_grad:
                    t.register_hook(Hook(self.on_grad, i))
        if self.stats:  # healthy steps skip backward hooks: cheaper
            for t in float_outputs(args):
                if t.requires_grad:
                    t.register_hook(Hook(self.on_input_grad, i))

    def on_grad(self, i: int, g: torch.Tensor) -> None:
        """The gradient of a module's output (stats steps): its range."""
        _maxed(self.act_grad, i, finite_amax(g))

    def on_input_grad(self, i: int, g: torch.Tensor) -> None:
        """The gradient of a module's input, which its backward made (stats steps): a probe."""
        self.backward.append((i, exact_probe(g)))

    def after_backward(self, roots: list[torch.Tensor]) -> None:
        """A micro-batch's backward ended: its scalar roots are its losses, kept where they are.
        On statistics steps one probe (a read) says whether a root is non-finite; if so, the
        first non-finite module output names where (none: the loss itself). Outputs dropped."""
        outputs, self.outputs = self.outputs, []
        self.roots.extend(r.reshape(()) for r in roots if r.numel() == 1)  # [] and [1] alike
        if not self.stats or self.first is not None or not roots:
            return
        if first_nonfinite(roots) is None:
            return
        bad = first_nonfinite([t for _, t in outputs])
        self.first = (outputs[bad][0] if bad is not None else None, "forward")

    def read_grads(self, modules: list[nn.Module], stats: list[int], divisor: float) -> None:
        """Parameter-gradient amax and fp16 flush counts per stats module (grads / divisor)."""
        self.grads_read = True
        if not self.stats:
            return
        self.divisor = divisor
        for i in stats:
            gs = [p.grad.detach() for p in modules[i].parameters(recurse=False)
                  if p.grad is not None]
            if gs:
                self.grad[i] = torch.stack([finite_amax(g) for g in gs]).amax()
                self.flush[i] = torch.stack([flush_counts(g, divisor) for g in gs]).sum(0)

    def loss(self) -> float:
        """The step's loss: the sum of its micro-batches' unscaled losses as the loop's backward
        started from them (a loop dividing by their number: their undivided mean), or the mean
        of the undivided losses given to log_loss; nan when none was seen. A read: called when
        the record is made, not between statistics steps."""
        if self.explicit:
            return float(sum(torch.as_tensor(v, dtype=torch.float64).cpu()
                             for v in self.explicit)) / len(self.explicit)
        if not self.roots:
            return math.nan
        total = torch.stack([r.double() for r in self.roots]).sum().item()
        return total / self.scale if self.scale else total

    def first_backward(self) -> int | None:
        """Stats steps: the module whose backward first made a non-finite input gradient."""
        if not self.backward:
            return None
        ok = finite([f for _, f in self.backward])
        bad = next((k for k, v in enumerate(ok) if not v), None)
        return self.backward[bad][0] if bad is not None else None
