"""A dispatch mode that fills every fresh allocation with -inf, as reused memory often is."""

from __future__ import annotations

import math

from torch.utils._python_dispatch import TorchDispatchMode


class Garbage(TorchDispatchMode):
    """Every allocation comes back full of -inf (leftovers of attention masks, say)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func._schema.name.removeprefix("aten::")
        if name.startswith(("empty", "new_empty")) and out.is_floating_point():
            out.fill_(-math.inf)  # below the hunter: it sees only the allocation's result
        return out
