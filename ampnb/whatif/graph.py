"""The backward a what-if needs: the gradients of the layers' outputs, not of the weights.

`torch.autograd.grad(loss, inputs=...)` runs only the part of the graph that leads to its
inputs, and a node computes only the gradients that part needs: with the layers' outputs as
inputs, no weight gradient GEMM runs and no `.grad` is written (a third of a backward's work,
none of it a figure of the what-if). Only the outputs that no other layer's output lies below
are passed: the others are on the way to them, so their gradients are computed (and their
tensor hooks run) as they pass, and none is held until the backward ends.
"""

from __future__ import annotations

import torch
from torch.autograd.graph import GradientEdge

# torch.utils.checkpoint(use_reentrant=True) refuses a backward with inputs (it re-runs its own).
_REENTRANT = "CheckpointFunctionBackward"


def lowest(root: torch.Tensor, edges: list[GradientEdge]) -> list[GradientEdge] | None:
    """The edges with no other of `edges` below them in root's graph (None: a graph that only a
    whole backward can run)."""
    marked = {e.node for e in edges}
    below: dict[torch.autograd.graph.Node, bool] = {}  # node -> a marked node lies under it
    stack = [(root.grad_fn, False)]
    while stack:
        node, done = stack.pop()
        if done:
            below[node] = any(c in marked or below[c] for c, _ in node.next_functions if c is not None)
            continue
        if node in below:
            continue
        if node.name() == _REENTRANT:
            return None
        below[node] = False  # seen (a graph has no cycles: set for real once its children are)
        stack.append((node, True))
        stack.extend((c, False) for c, _ in node.next_functions if c is not None and c not in below)
    return [e for e in edges if e.node in below and not below[e.node]]
