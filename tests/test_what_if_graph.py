"""what_if's backward: the layers' output gradients only (no weight gradient is computed), the
fewest outputs passed to autograd, and a whole backward where a reentrant checkpoint needs one."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.autograd.graph import get_gradient_edge
from torch.utils.checkpoint import checkpoint

import ampnb
from ampnb.whatif.graph import lowest


class Branches(nn.Module):
    """Two layers side by side on one input, then a third on their sum."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(self.a(x) + self.b(x))


class Checkpointed(nn.Module):
    """A Linear, a block under torch.utils.checkpoint, a Linear."""

    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.out = nn.Linear(8, 16), nn.Linear(16, 4)
        self.block = nn.Sequential(nn.Linear(16, 16), nn.GELU())
        self.reentrant = reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = checkpoint(self.block, self.inp(x), use_reentrant=self.reentrant)
        return self.out(h)


def _outputs(model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    outs: dict[str, torch.Tensor] = {}
    handles = [m.register_forward_hook(lambda m, a, o, n=n: outs.setdefault(n, o))
               for n, m in model.named_children() if isinstance(m, nn.Linear)]
    y = model(x)
    for h in handles:
        h.remove()
    return y.square().sum(), outs


def test_only_the_outputs_no_other_lies_below_are_passed():
    torch.manual_seed(0)
    seq = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8), nn.Linear(8, 4))
    loss, outs = _outputs(seq, torch.randn(3, 8))
    edges = [get_gradient_edge(outs[k]) for k in ("0", "2", "3")]
    assert lowest(loss, edges) == [edges[0]]  # the others lie on the way to the first

    loss, outs = _outputs(Branches(), torch.randn(3, 8))
    edges = [get_gradient_edge(outs[k]) for k in ("a", "b", "c")]
    assert lowest(loss, edges) == edges[:2]  # side by side: neither lies below the other


def test_an_output_the_loss_does_not_use_is_not_passed():
    torch.manual_seed(0)
    a, b = nn.Linear(4, 4), nn.Linear(4, 4)
    x = torch.randn(2, 4)
    used, unused = a(x), b(x)
    loss = used.sum()
    assert lowest(loss, [get_gradient_edge(unused), get_gradient_edge(used)]) == [get_gradient_edge(used)]


def test_no_weight_gradient_is_computed_and_every_output_gradient_is():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 4))
    x, y = torch.randn(8, 16), torch.randn(8, 4)
    weight_grads = []
    handles = [p.register_hook(lambda g: weight_grads.append(g)) for p in model.parameters()]
    result = ampnb.what_if(model, (x, y), nn.functional.mse_loss, formats=["bf16"])
    for h in handles:
        h.remove()
    assert weight_grads == []
    assert {r.module for r in result.rows if r.tensor == "grad_output"} == {"0", "2", "4"}
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("reentrant", [True, False])
def test_a_checkpointed_block_gives_the_rows_of_the_same_model_without_one(reentrant):
    x, y = torch.randn(4, 8, generator=torch.Generator().manual_seed(1)), torch.randn(4, 4)
    with_ckpt = ampnb.what_if(Checkpointed(reentrant), (x, y), nn.functional.mse_loss,
                              formats=["bf16", "mxfp8_e4m3"])
    plain = Checkpointed(reentrant)
    plain.forward = lambda x: plain.out(plain.block(plain.inp(x)))  # the same layers, no checkpoint
    without = ampnb.what_if(plain, (x, y), nn.functional.mse_loss, formats=["bf16", "mxfp8_e4m3"])
    grads = {(r.module, r.format): r for r in with_ckpt.rows if r.tensor == "grad_output"}
    assert grads and {("out", "bf16"), ("inp", "bf16")} <= set(grads)
    for r in without.rows:
        if r.tensor == "grad_output":
            assert grads[(r.module, r.format)].sqnr_db == pytest.approx(r.sqnr_db, abs=1e-9)
