"""The backward a what-if needs: the gradients of the layers' outputs, not of the weights.

`torch.autograd.grad(loss, inputs=...)` runs only the part of the graph that leads to its
inputs, and a node computes only the gradients that part needs: with the layers' outputs as
inputs, no weight gradient GEMM runs and no `.grad` is written (a third of a backward's work,
none of it a figure of the what-if). Only the outputs that no other layer's output lies below
are passed: the others are on the way to them, so their gradients are computed (and their
tensor hooks run) as they pass, and none is held until the backward ends.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.autograd.graph import GradientEdge

# torch.utils.checkpoint(use_reentrant=True) refuses a backward with inputs (it re-runs its own).
_REENTRANT = "CheckpointFunctionBackward"


def lowest(root: torch.Tensor, edges: list[GradientEdge]) -> list[GradientEdge] | None:
    """The edges with no other of `edges` below them in root's graph (None: a graph that only a
    whole backward can run)."""
    marked = {e.node for e in edges}
    children: dict[Any, list] = {}  # the nodes seen, with the nodes their gradients flow to
    below: dict[Any, bool] = {}  # node -> a marked node lies under it (once its children have it)
    stack = [root.grad_fn]
    while stack:  # depth first; a node is done after its children (a graph has no cycles)
        node = stack[-1]
        if node not in children:
            if type(node).__name__ == _REENTRANT:
                return None
            kids = children[node] = [c for c, _ in node.next_functions if c is not None]
            stack.extend(c for c in kids if c not in children)
        else:
            stack.pop()
            if node not in below:
                below[node] = any(c in marked or below[c] for c in children[node])
    return [e for e in edges if e.node in below and not below[e.node]]
