"""The reduction simulation against torch's own low-precision arithmetic (no ranks started)."""

from __future__ import annotations

import pytest
import torch

from ampnb.distributed import reduction

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@pytest.fixture(scope="module")
def grads():
    return reduction.rank_gradients(64)


@pytest.mark.parametrize("fmt", DTYPES)
def test_ring_is_torchs_own_sequential_sum(grads, fmt):
    dt = DTYPES[fmt]
    for n in (2, 3, 64):
        acc = grads[0].to(dt)
        for g in grads[1:n]:
            acc = acc + g.to(dt)  # torch adds in fp32 and rounds once
        sim = reduction.simulate_allreduce(grads[:n], fmt, "ring", mean=False)
        assert torch.equal(sim.to(dt), acc)


@pytest.mark.parametrize("fmt", DTYPES)
def test_tree_is_torchs_own_pairwise_sum(grads, fmt):
    dt = DTYPES[fmt]
    for n in (48, 64):
        x = grads[:n].to(dt)
        while len(x) > 1:
            x = torch.cat([x[0:len(x) - 1:2] + x[1::2], x[-1:] if len(x) % 2 else x[:0]])
        assert torch.equal(reduction.simulate_allreduce(grads[:n], fmt, "tree", mean=False).to(dt), x[0])


def test_pre_divide_divides_each_rank_in_the_format_first(grads):
    n, dt = 8, torch.float16
    acc = (grads[0].to(dt) / n).to(dt)
    for g in grads[1:n]:
        acc = acc + (g.to(dt) / n)
    assert torch.equal(reduction.simulate_allreduce(grads[:n], "fp16", pre_divide=True).to(dt), acc)


def test_the_sweep_measures_error_against_the_exact_mean():
    sweep = reduction.reduction_error(max_ranks=64, orders=("ring", "tree"))
    series = sweep.series()
    fp32_ring, bf16_ring = series[("fp32", "ring", False)][1], series[("bf16", "ring", False)][1]
    eps = {f: torch.finfo(DTYPES[f]).eps for f in ("fp32", "bf16")}
    assert all(e < 64 * eps["fp32"] for e in fp32_ring)
    assert all(eps["bf16"] / 8 < e < 64 * eps["bf16"] for e in bf16_ring)
    lost = sweep.ranks_losing(1)
    assert all(v is None or v in series[k][0] for k, v in lost.items())
    assert "N losing 1 bit" in repr(sweep)


def test_bad_input():
    with pytest.raises(ValueError, match="order must be one of ring, tree"):
        reduction.simulate_allreduce(torch.ones(2, 3), "bf16", "butterfly")
    with pytest.raises(ValueError, match="max_ranks must be >= 2"):
        reduction.reduction_error(max_ranks=1)
