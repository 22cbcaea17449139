"""DDP, FSDP2 and the reduction check on 2 gloo ranks, against single-process torch references.

All experiments share one launch (starting ranks is what costs time on a small machine).
"""

from __future__ import annotations

import pytest
import torch

from ampnb.distributed import _demo
from ampnb.distributed.experiments import run_experiments


@pytest.fixture(scope="module")
def results():
    return run_experiments(nproc=2, steps=3)


def test_ddp_32_true_gives_the_weights_of_one_process_on_the_global_batch(results):
    result = results["ddp_vs_single"]
    eps = torch.finfo(torch.float32).eps
    assert result.ranks_identical
    assert result.max_difference <= 4 * eps  # the mean of 2 half-batch means vs one mean
    assert {name for name, _, _ in result.rows} == set(_demo.model().state_dict())


def test_an_inf_on_one_rank_makes_every_rank_skip_and_back_off_alike(results):
    result = results["ddp_scaler"]  # inf in rank 1's input at step 1
    reference = torch.amp.GradScaler("cpu")  # torch's defaults: what one skip does to the scale
    backed_off = reference._init_scale * reference._backoff_factor
    assert result.agree()
    at_inject = [r for r in result.rows if r[0] == 1]
    assert {r[4] for r in at_inject} == {"skipped"} and {r[5] for r in at_inject} == {backed_off}
    assert [r[2] for r in sorted(at_inject, key=lambda r: r[1])] == ["yes", "inf/NaN"]  # local only
    assert {r[4] for r in result.rows if r[0] != 1} == {"stepped"}


def test_ddp_reduces_in_the_parameter_dtype(results):
    rows = {r[0]: r for r in results["ddp_dtypes"].rows}
    assert rows["bf16-mixed"][1:] == ("float32", "bfloat16", "float32", "float32")
    assert rows["bf16-true"][3] == "bfloat16" and rows["16-true"][3] == "float16"


def test_fsdp2_runs_forward_on_unsharded_copies_in_the_policys_dtype(results):
    result = results["fsdp_policy"]  # param_dtype=bf16, reduce_dtype=fp32
    for rank in result.ranks:
        assert rank["sharded"] == "float32" and rank["in_forward"] == "bfloat16"
        assert rank["output"] == "bfloat16" and rank["grad"] == "float32"
        assert rank["reduce"] in ("float32", "not seen")
    total = sum(p.numel() * p.element_size() for p in _demo.model().parameters())
    assert sum(r["params"] for r in result.ranks) == total  # each rank holds half
    assert result.ranks[0]["unsharded_all"] == total // 2  # bf16 copies of every unit


def test_scalers_on_sharded_gradients(results):
    result = results["fsdp_scaler"]  # inf in rank 1's shard
    assert result.agree("ShardedGradScaler, plain local shards")
    assert not result.agree("GradScaler, plain local shards")  # rank 0 never saw the inf
    assert result.agree("GradScaler, DTensor shards (FSDP2)")


def test_the_simulation_is_gloos_all_reduce_bit_for_bit_on_two_ranks(results):
    assert results["gloo"].equal and len(results["gloo"].rows) == 3
