"""TF32 settings for a run: on, off, or emulated by rounding matmul/conv inputs to 10 mantissa bits."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ampnb.formats import quantize

# User spellings -> setting; None leaves the TF32 flags as they are.
TF32_SETTINGS: dict[object, str | None] = {
    None: None, "on": "on", "off": "off", "emulate": "emulate", True: "on", False: "off",
}

aten = torch.ops.aten
# Which arguments of each op are the factors of a product that TF32 tensor cores would
# round (a bias added afterwards is not rounded).
_FACTORS: dict[object, tuple[int, ...]] = {
    aten.mm: (0, 1),
    aten.bmm: (0, 1),
    aten.matmul: (0, 1),
    aten.addmm: (1, 2),
    aten.baddbmm: (1, 2),
    aten.addbmm: (1, 2),
    aten.convolution: (0, 1),
    aten.convolution_backward: (0, 1, 2),
}


def _round(x: object) -> object:
    if isinstance(x, torch.Tensor) and x.dtype == torch.float32:
        return quantize(x, "tf32")
    return x


class TF32Emulation(TorchDispatchMode):
    """Round the fp32 factors of every matmul and convolution to TF32 before it runs."""

    def __init__(self) -> None:
        super().__init__()
        self.rounded_ops = 0

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # torch otherwise wraps __torch_dispatch__ in torch._disable_dynamo, whose first call
        # imports all of torch._dynamo (seconds); nothing here is ever compiled.
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        which = _FACTORS.get(func.overloadpacket)
        if which is not None:
            args = tuple(_round(a) if i in which else a for i, a in enumerate(args))
            self.rounded_ops += 1
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def tf32_context(setting: str | None,
                 device: str | torch.device = "cpu") -> Iterator[TF32Emulation | None]:
    """Apply a TF32 setting ('on', 'off', 'emulate' or None = as is) for the body; restore it.

    Yields the emulation (it counts the ops it rounded) for 'emulate', else None.
    """
    if setting not in TF32_SETTINGS.values():
        allowed = ", ".join(repr(s) for s in TF32_SETTINGS.values())
        raise ValueError(f"unknown TF32 setting {setting!r}; use one of {allowed}")
    if setting is None:
        yield None
        return
    from ampnb.device import tf32

    # Real TF32 under the emulation would round twice, so emulation runs with TF32 off.
    with tf32(setting == "on"):
        if setting == "emulate":
            with TF32Emulation() as emulation:
                yield emulation
        else:
            yield None
