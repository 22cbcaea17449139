# %% [markdown]
# # 06 · Past one machine: mixed precision under DDP and FSDP2
#
# Spread training over many GPUs and mixed precision changes again: gradients are all-reduced in
# some dtype, FSDP keeps sharded fp32 parameters but computes on unsharded bf16 copies, the
# GradScaler's decision to skip a step must agree on every rank, and summing gradients in bf16
# over hundreds of ranks loses bits. This notebook shows all of it on a 2-core CPU — real
# `torch.distributed` processes on this machine, gloo instead of NCCL — and simulates the rest:
#
# 1. a cell on 2 local ranks: `%%amp bf16-mixed --nproc 2`,
# 2. DDP under each mode: the all-reduce dtype, the GradScaler across ranks, 32-true = one process,
# 3. FSDP2: `MixedPrecisionPolicy`, memory per rank, and which scaler FSDP needs,
# 4. reduction precision at thousands of ranks, by simulation (checked against gloo),
# 5. the take-home code, and an exercise.
#
# Prerequisites: 02 (autocast), 03 (GradScaler). About 20 minutes. Each launch of ranks takes a
# few seconds: the processes are started by torch's own elastic launcher and all end with the cell.

# %%
# NBVAL_CHECK_OUTPUT
import torch
from torch import nn

import ampnb
from ampnb.distributed import run_experiments

print("gloo available:", torch.distributed.is_gloo_available())

# %%
# %load_ext ampnb

# %% [markdown]
# ## 1. A cell on 2 ranks
#
# `--nproc 2` runs the cell in 2 processes started by `torch.distributed`'s elastic launcher on
# 127.0.0.1 (gloo on CPU, NCCL on CUDA). The cell gets `rank`, `world_size`, `device` and `mode`,
# and the notebook's names it uses (`torch`, `nn` here; tensors, models, your own functions and
# classes are sent too). Each rank runs the cell under the mode — bf16 autocast here — and what it
# prints comes back labelled by rank:

# %%
# %%amp bf16-mixed --nproc 2 -o run
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

torch.manual_seed(0)  # the same weights on every rank (DDP also broadcasts rank 0's)
net = DDP(nn.Linear(8, 2))
x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))  # noqa: F821 - given by --nproc
loss = net(x).float().square().mean()
loss.backward()  # DDP all-reduces (averages) the gradients of every rank here
grads = [torch.empty_like(net.module.weight.grad) for _ in range(world_size)]  # noqa: F821
dist.all_gather(grads, net.module.weight.grad)
print(f"output {net(x).dtype}, gradient {net.module.weight.grad.dtype}, "
      f"same gradient on every rank: {all(torch.equal(g, grads[0]) for g in grads)}")
rank * 10  # noqa: F821 - each rank's value comes back to the notebook

# %% [markdown]
# `-o run` kept the result: each rank's output, value and status, and the process ids, all
# ended now:

# %%
# NBVAL_CHECK_OUTPUT
run = globals()["run"]  # set by -o run
print(run.output(), end="")
print(run)
print("values:", run.values, "| processes still running:",
      [p for p in run.pids if ampnb.distributed._procs.alive(p)])

# %% [markdown]
# When a rank fails, its traceback comes back and the launcher ends every process (the other
# rank was waiting in a collective). From Python, `ampnb.run_distributed(fn_or_source, nproc)`
# does the same as the magic and raises `RankFailed`, which holds every rank's result:

# %%
# NBVAL_CHECK_OUTPUT
broken = """
import torch.distributed as dist
if rank == 1:
    raise ValueError("rank 1 broke")
dist.barrier()
"""
try:
    ampnb.run_distributed(broken, 2)
except ampnb.distributed.RankFailed as e:
    failed = e.run.ranks[1]
    print(f"rank 1 {failed.status}:", failed.error.strip().splitlines()[-1])
    print("processes still running:", [p for p in e.run.pids if ampnb.distributed._procs.alive(p)])

# %% [markdown]
# ## 2. DDP, FSDP2 and the all-reduce on real ranks
#
# Starting ranks is the slow part, so `run_experiments` runs every experiment of this section
# and the next in one launch of 2 ranks (each is also a function of its own:
# `ampnb.distributed.ddp_dtypes()`, `ddp_scaler()`, `ddp_vs_single()`, `fsdp_policy()`,
# `fsdp_scaler()`, `check_against_gloo()`). The model is a small MLP, the same on every rank;
# each rank trains on its half of a global batch.

# %%
results = run_experiments(nproc=2)

# %% [markdown]
# **Which dtype does DDP all-reduce in?** A comm hook records the bucket DDP hands to the
# all-reduce. Under the mixed modes the parameters stay fp32, so the gradients are fp32 and so is
# the reduction — autocast changes the forward, not what is reduced. The true modes reduce in
# their own 16 bits:

# %%
# NBVAL_CHECK_OUTPUT
print(results["ddp_dtypes"])

# %% [markdown]
# **The GradScaler across ranks.** Under 16-mixed each rank has its own `torch.amp.GradScaler`.
# We put an inf into rank 1's input at step 1 only. Rank 0's loss is finite — but the all-reduce
# sums rank 1's inf into every rank's gradients, so every scaler finds it: all ranks skip the same
# step and back off to the same scale. The ranks never disagree about the weights:

# %%
# NBVAL_CHECK_OUTPUT
print(results["ddp_scaler"])

# %% [markdown]
# **32-true DDP is one process on the global batch.** DDP averages the gradients of equal
# slices: the mean of the per-rank means is the global mean, up to fp32 rounding.

# %%
# NBVAL_CHECK_OUTPUT
same = results["ddp_vs_single"]
print("every rank holds the same weights:", same.ranks_identical)
print("max |DDP - one process| <= 4 fp32 eps:", same.max_difference <= 4 * torch.finfo(torch.float32).eps)

# %%
same

# %% [markdown]
# ## 3. FSDP2: `MixedPrecisionPolicy`
#
# `fully_shard(module, mp_policy=MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32))`:
# each rank keeps a *shard* of every parameter in fp32 (what the optimizer updates). Before a
# unit's forward, FSDP all-gathers the shards and casts them to `param_dtype`; the unsharded bf16
# copies are freed again after the unit. Gradients come back in bf16, are cast to `reduce_dtype`
# for the reduce-scatter (recorded here by a custom reduce-scatter), and land as fp32 shards:

# %%
# NBVAL_CHECK_OUTPUT
policy = results["fsdp_policy"]
print(policy)

# %% [markdown]
# Memory per rank, measured on each rank's local shards — and projected: shards shrink as 1/N,
# the unsharded copy of the unit being computed does not. With thousands of ranks the unsharded
# units are all that is left, which is why their dtype (`param_dtype`) matters at scale:

# %%
# NBVAL_CHECK_OUTPUT
print(policy.memory())

# %%
# NBVAL_CHECK_OUTPUT
print(policy.projected())

# %% [markdown]
# **Which scaler does FSDP need?** With 16-bit fp16 compute a GradScaler is still needed, but now
# each rank holds only its shard of the gradients: an overflow can land in one rank's shard only.
# Here an inf is put into rank 1's gradient shard. A scaler that checks only its own shard lets
# rank 0 step while rank 1 skips: the ranks' weights and scales diverge. `ShardedGradScaler`
# (made for FSDP1's flat shards) all-reduces `found_inf`; FSDP2's gradients are DTensors, whose
# `unscale_` reduces `found_inf` across the ranks, so the plain `torch.amp.GradScaler` agrees:

# %%
# NBVAL_CHECK_OUTPUT
print(results["fsdp_scaler"])

# %% [markdown]
# ## 4. Reduction precision at scale, by simulation
#
# DDP with bf16 gradients (bf16-true, or a bf16 compression hook) sums N ranks' gradients in
# bf16. Users report bf16 reductions becoming unstable at 48×8 GPUs. We cannot run 16,384 ranks
# here, but we can add their gradients in the same order with the same rounding:
# `ampnb.quantize` after every addition (add in fp32, round once — what a collective does with
# two bf16 values). "ring" adds rank after rank (how a ring all-reduce accumulates a chunk);
# "tree" adds pairs, level by level. First, the check: for 2 ranks the simulation and gloo's real
# `all_reduce` agree bit for bit:

# %%
# NBVAL_CHECK_OUTPUT
print(results["gloo"])

# %% [markdown]
# Each rank's gradient is the demo MLP's first-layer gradient on a sample of its own. The error
# is that of the reduced mean against the exact mean (in fp64); "bits lost" compares it with
# rounding the exact mean once into the same format:

# %%
from ampnb.distributed import reduction_error
from ampnb.plots import plot_reduction_error

sweep = reduction_error(max_ranks=2048)
plot_reduction_error(sweep).figure

# %%
sweep

# %%
series = sweep.series()
for key in (("fp32", "ring", False), ("bf16", "ring", False), ("bf16", "tree", False)):
    ns, errs = series[key]
    print(f"{key[0]} {key[1]:4}: relative error {errs[0]:.1e} at N={ns[0]}, {errs[-1]:.1e} at N={ns[-1]:,}")

# %% [markdown]
# Read it as: a ring adds each rank's gradient to a running sum, and every addition rounds at
# the sum's magnitude, so the error grows with N; a tree keeps the two operands of each addition
# alike in size, and its error grows only with log N. bf16 starts 2¹⁶ times coarser than fp32,
# so the same growth costs it most of its 8 bits. fp16 has 3 more bits than bf16 but 5 fewer
# exponent bits: dividing by N before the sum (what `fp16_compress_hook` does) keeps the sum in
# range, at the price of pushing small gradients toward fp16's subnormals.
# `reduction_error()` with its default `max_ranks=16384` goes to 16,384 ranks (about a minute).

# %% [markdown]
# ## 5. The take-home code
#
# What ran above, as a plain torch script (`torchrun --nproc-per-node N train.py`) and as
# Lightning's `strategy=` + `precision=`:

# %%
# NBVAL_CHECK_OUTPUT
print(ampnb.distributed.take_home("ddp", "16-mixed"))

# %%
# NBVAL_CHECK_OUTPUT
print(ampnb.distributed.take_home("fsdp", "bf16-mixed"))

# %% [markdown]
# ## Exercise: how many ranks can fp16 take?
#
# From `sweep`, find the number of ranks at which an fp16 ring reduction has lost 2 bits, with
# and without the divide-by-N first. Then use `ampnb.distributed.simulate_allreduce` on
# `ampnb.distributed.reduction.rank_gradients(256) * 2**16` (256 ranks' gradients still
# multiplied by the GradScaler's initial scale) to see what happens to an fp16 sum without it.

# %% jupyter={"source_hidden": true} tags=["solution"]
lost = sweep.ranks_losing(2)
print("fp16 ring, divide after:", lost[("fp16", "ring", False)])
print("fp16 ring, divide first:", lost[("fp16", "ring", True)])

# %% jupyter={"source_hidden": true} tags=["solution"]
# NBVAL_CHECK_OUTPUT
from ampnb.distributed import simulate_allreduce
from ampnb.distributed.reduction import rank_gradients

scaled = rank_gradients(256) * 2**16
after = simulate_allreduce(scaled, "fp16", "ring")
first = simulate_allreduce(scaled, "fp16", "ring", pre_divide=True)
print("divide after the sum, any inf:", bool(torch.isinf(after).any()))
print("divide first,         any inf:", bool(torch.isinf(first).any()))
