# %% [markdown]
# # 01 · Number formats: where do your tensors' values fall?
#
# Mixed precision stores and computes numbers in formats narrower than fp32. Every binary float
# format is a sign bit, some **exponent bits** and some **mantissa bits**:
#
# * the exponent bits decide the **range**: how many powers of two ("binades") fit between the
#   smallest and the largest number;
# * the mantissa bits decide the **precision**: how finely each binade is divided.
#
# A value outside the range is lost (it *overflows* to inf, or *underflows* to zero); a value
# inside it is *rounded* to the nearest representable number. In this notebook you will
#
# 1. see the formats as data, and their ranges side by side (the *format ladder*);
# 2. round a few numbers and watch what each format does to them;
# 3. place a real model's weights, activations and gradients against FP16, BF16 and FP8;
# 4. see why small fp16 gradients vanish without loss scaling, and how a scale rescues them;
# 5. trace which ops autocast really runs in lower precision;
# 6. explore any layer interactively with the `RangeExplorer` panel, then try an exercise.
#
# Every number printed here is measured or derived from the format's bits, never typed in.

# %%
import math

import torch

import ampnb
from ampnb.formats import format_table
from ampnb.instruments import coverage_table
from ampnb.models import demo
from ampnb.plots import (
    plot_format_ladder,
    plot_layer_summary,
    plot_loss_scale_effect,
    plot_tensor_histogram,
)

# %% [markdown]
# ## 1. The formats as data
#
# `ampnb.get_format(name)` returns a `FloatFormat`: its bit fields, and every other figure derived
# from them. `max` is the largest finite value, `smallest normal` the smallest number with full
# precision, `smallest subnormal` the smallest nonzero number at all (subnormals trade precision
# for a little extra range), and `eps` the gap between 1 and the next number.

# %%
# NBVAL_CHECK_OUTPUT
print(format_table(("fp32", "tf32", "bf16", "fp16", "fp8_e5m2", "fp8_e4m3")))

# %% [markdown]
# These are derived, so check them against what PyTorch itself says (`torch.finfo`). tf32 is left
# out: it is a mode of the GPU's tensor cores inside fp32 matmuls, not a dtype you can store.

# %%
# NBVAL_CHECK_OUTPUT
for name in ("fp32", "bf16", "fp16", "fp8_e5m2", "fp8_e4m3"):
    f = ampnb.get_format(name)
    fi = torch.finfo(f.torch_dtype)
    print(f"{name:9} max {f.max == fi.max}   smallest normal {f.smallest_normal == fi.tiny}"
          f"   eps {f.eps == fi.eps}")

# %% [markdown]
# ### The format ladder
#
# Each row is one format on a log2 axis: the solid bar is its normal range, the hatched bar its
# subnormals. bf16 keeps fp32's 8 exponent bits, so it has (almost) the same range with far less
# precision; fp16 spends its bits on precision and its normal numbers cover only 30 binades (the
# `binades` column above) against bf16's 254; the two FP8 formats trade one for the other: e5m2
# has range, e4m3 has precision.

# %%
plot_format_ladder().figure

# %% [markdown]
# ## 2. Rounding: quantize a few numbers
#
# `ampnb.quantize(x, fmt)` rounds every element to the nearest value of the format (ties to
# even) and returns it in `x`'s dtype, so you can look at the result. Where torch has the dtype,
# the result is bit-for-bit what torch's own cast gives.

# %%
# NBVAL_CHECK_OUTPUT
x = torch.tensor([1.0, 0.1, 1 / 3, 1000.1, 300.0, 65519.0, 65520.0, 1e-5, 1e-8])
fmts = ["bf16", "fp16", "fp8_e4m3", "fp8_e5m2"]
print(f"{'x (fp32)':>12}" + "".join(f"{f:>13}" for f in fmts))
for i, v in enumerate(x.tolist()):
    print(f"{v:>12.6g}" + "".join(f"{ampnb.quantize(x, f)[i].item():>13.6g}" for f in fmts))

# %%
# NBVAL_CHECK_OUTPUT
for f in fmts:
    same = torch.equal(ampnb.quantize(x, f), x.to(ampnb.get_format(f).torch_dtype).float())
    print(f"quantize(x, {f!r}) equals torch's cast to {ampnb.get_format(f).torch_dtype}: {same}")

# %% [markdown]
# What to notice:
#
# * **precision**: 0.1 and 1/3 keep about three significant digits in bf16 and fp16 (fp16 a
#   little more), one or two in FP8. The relative error is at most half of `eps` (below).
# * **overflow differs by format**: 65519 still rounds to fp16's max 65504, but 65520 is past
#   the half-way point and becomes `inf`. e5m2 overflows to `inf` too, while e4m3 (which has no
#   inf) *saturates* to 448 — the same cast, two behaviours. FP8 recipes scale values into range
#   first, so neither happens.
# * **underflow**: 1e-8 is below fp16's smallest subnormal (2^-24) and becomes 0; 1e-5 survives
#   in fp16 only as a subnormal (below 2^-14), with fewer digits. bf16 holds both, as normal
#   numbers.

# %%
# NBVAL_CHECK_OUTPUT
tenth = torch.tensor([0.1])
for f in fmts:
    err = abs(ampnb.quantize(tenth, f).item() - 0.1) / 0.1
    print(f"{f:9} relative error of 0.1: {err:.2e}   eps/2 = {ampnb.get_format(f).eps / 2:.2e}")

# %% [markdown]
# ## 3. A real model's tensors against the formats
#
# `ampnb.capture(model)` attaches hooks to every module, records a small summary of every weight,
# activation (module output) and parameter gradient, and removes all of its hooks when the
# `with` block ends (also if your code raises). The statistics are computed on the tensor's own
# device; only a few numbers come back. Here we run one training step of the MLP demo.

# %%
# NBVAL_CHECK_OUTPUT
d = demo("mlp")
print(d)
with ampnb.capture(d.model) as cap:
    x, y = d.batches[0]
    d.loss_fn(d.model(x), y).backward()
d.optimizer.zero_grad()  # we only looked; nothing was trained

# %% [markdown]
# The weights come straight from the seeded initialisation, so this table is the same on every
# machine. `coverage` gives, for each tensor, the fraction of its elements that would overflow,
# underflow to zero, or land among the subnormals once rounded into fp8 e4m3:

# %%
# NBVAL_CHECK_OUTPUT
weights = cap.select("weight")
print(coverage_table([w.coverage("fp8_e4m3") for w in weights], [w.name for w in weights],
                     caption="the MLP's weights in fp8_e4m3"))

# %% [markdown]
# Activations and gradients depend on the machine's matmul kernels in their last bits, so their
# table is shown, not checked. Against fp16:

# %%
cap.table("fp16")

# %% [markdown]
# One row per captured tensor, from its smallest nonzero magnitude to its largest, coloured by
# the first of the listed formats (narrowest first) that holds *all* of it — no overflow and no
# underflow. The formats that hold it are named beside each row.

# %%
plot_layer_summary(cap, ("fp8_e4m3", "fp8_e5m2", "fp16", "bf16")).figure

# %% [markdown]
# Read the colours: bf16 and fp16 hold every tensor of this small model. e4m3, whose smallest
# subnormal is 2^-9, cuts off the small end of most of them; e5m2 reaches further down, but the
# gradients reach further still. That is why FP8 training uses e5m2 for gradients and scales
# every tensor before casting it. One tensor in detail — each lane is one format's range, and
# says what share of the elements would overflow, underflow or go subnormal:

# %%
plot_tensor_histogram(cap.get("body.2.weight", "gradient"),
                      ("fp16", "bf16", "fp8_e4m3", "fp8_e5m2")).figure

# %% [markdown]
# ### Watching a model while it trains
#
# Capturing every tensor of every step costs more than a small model's whole step on a
# CPU. To keep watching during training, leave capture attached with `every=N`: one forward call
# in N is captured (with the backward that follows it), and in between only one counting hook
# stays on the model, so training runs at nearly full speed. `.records` then show the last
# captured call; `calls` says how many were captured.

# %%
# NBVAL_CHECK_OUTPUT
d = demo("mlp")
with ampnb.capture(d.model, kinds=("gradient",), every=50) as watch:
    for step in range(120):
        x, y = d.batches[step % len(d.batches)]
        d.optimizer.zero_grad()
        d.loss_fn(d.model(x), y).backward()
        d.optimizer.step()
print(watch.forwards, "forward calls,", watch.records[0].calls, "captured (calls 0, 50 and 100)")

# %%
watch.table("fp16")

# %% [markdown]
# ## 4. Why small fp16 gradients vanish without loss scaling
#
# In deeper networks gradients spread over many binades, and the small ones fall below fp16's
# smallest subnormal, 2^-24. Under `16-mixed` the backward pass computes in fp16, so they become
# exactly zero and those weights stop learning. Build gradient-like values whose magnitudes spread
# evenly from 2^-34 to 2^-6 (exactly: a mantissa in [1, 2) times a power of two):

# %%
# NBVAL_CHECK_OUTPUT
g = torch.Generator().manual_seed(0)
n = 100_000
mantissa = 1 + torch.rand(n, generator=g)
sign = torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0)
grads = sign * torch.ldexp(mantissa, torch.randint(-34, -6, (n,), generator=g))
print(f"fp16 underflow, from ampnb.coverage: {ampnb.coverage(grads, 'fp16').underflow:.2%}")
print(f"fp16 underflow, by casting:          {((grads.half() == 0).float().mean()):.2%}")

# %% [markdown]
# A **loss scale** multiplies the loss (and so, by the chain rule, every gradient) by a large
# factor before the backward pass, and divides it out again in fp32 before the optimizer step.
# Multiplying by a power of two only shifts the exponent, so nothing is rounded: the whole
# histogram slides right, into fp16's range.

# %%
plot_loss_scale_effect(grads, scale=2.0**16, fmt="fp16").figure

# %% [markdown]
# Too small a scale leaves gradients underflowing; too large a scale makes the largest ones
# overflow to `inf`. Sweep it:

# %%
# NBVAL_CHECK_OUTPUT
for k in (0, 8, 16, 24, 32):
    c = ampnb.coverage(grads * 2.0**k, "fp16")
    print(f"scale 2^{k:<2}  underflow {c.underflow:7.2%}   subnormal {c.subnormal:7.2%}"
          f"   overflow {c.overflow:7.2%}")
print(f"bf16, no scale: underflow {ampnb.coverage(grads, 'bf16').underflow:.2%}")

# %% [markdown]
# `torch.amp.GradScaler` finds the scale as it trains: it starts at 2^16, and when a step's
# gradients hold inf or NaN it skips that step and halves the scale; after 2000 clean steps it
# doubles it. Notebook 03 walks that loop one stage at a time. bf16 has fp32's exponent range,
# so it needs no scaler at all (last line above).

# %% [markdown]
# ## 5. Which ops does autocast lower?
#
# `torch.autocast` does not run everything in the low-precision dtype. Matmuls and convolutions
# are lowered; ops that need range or accuracy (losses such as cross-entropy, with the `log_softmax`
# inside it) are kept in or
# promoted to fp32 — which ones differs by device: on CUDA softmax and layer norm run in fp32, on
# a CPU they follow their input's dtype. `ampnb.trace_ops()` records every op that ran, in which dtype, and in which module:

# %%
d = demo("mlp")
x, y = d.batches[0]
with ampnb.trace_ops() as trace:
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = d.loss_fn(d.model(x), y)
    loss.backward()
print(trace.summary())
trace.table()

# %% [markdown]
# The Linear layers' `addmm` run in bfloat16 after `_to_copy` casts of their fp32 weights, the
# GELUs follow in bfloat16, and the loss (`_log_softmax`, `nll_loss`) goes back to float32.
# In the backward pass the matmuls (`mm`) are bfloat16 too, and the gradients are cast back to
# float32 to match the fp32 weights they belong to. Notebook 02 measures autocast's choices op
# by op, and shows how to switch it off for a sensitive region.

# %% [markdown]
# ## 6. Explore: the RangeExplorer panel
#
# Pick a tensor kind, a layer (or *all layers*) and the formats to compare. The plot and the
# coverage table below it update in place. *Capture again* reruns the batch, e.g. after you have
# trained the model for a few steps. It works on your own model too:
# `RangeExplorer(model, batch, loss_fn=None)` with a batch in any form (a tensor, a keyword dict,
# `(inputs, targets)` with a `loss_fn`); it shows gradients whenever there is a loss, the model's
# own included. It leaves the model's weights, buffers (BatchNorm statistics), `.grad` and the
# random state bit-identical.

# %%
explorer = ampnb.panels.RangeExplorer(demo("cnn"))
explorer

# %% [markdown]
# ## Exercise
#
# FP8 training casts gradients to **e5m2** after multiplying them by a scale. Take one backward
# step of the CNN demo and find the **smallest power-of-two scale 2^k** for which *no* gradient
# element underflows to zero in `fp8_e5m2`. Then check how many binades of headroom remain
# before the largest gradient would overflow.
#
# Hints: `ampnb.capture(model, kinds=("gradient",), keep=True)` keeps the tensors (`r.tensor`);
# `ampnb.coverage(t, "fp8_e5m2").n_underflow` counts elements that round to zero;
# `ampnb.get_format("fp8_e5m2").max` is the largest finite value.

# %%
# your answer here

# %% [markdown]
# ### Solution
#
# Try k = 0, 1, 2, … until nothing underflows, then compare the scaled maximum with e5m2's max.
# The same answer follows from the smallest magnitude alone: it must lie above half of the
# smallest subnormal.

# %% jupyter={"source_hidden": true} tags=["solution"]
# Solution
cnn = demo("cnn")
with ampnb.capture(cnn.model, kinds=("gradient",), keep=True) as grads_cap:
    x, y = cnn.batches[0]
    cnn.loss_fn(cnn.model(x), y).backward()
e5m2 = ampnb.get_format("fp8_e5m2")
tensors = [r.tensor for r in grads_cap.records]
k = next(k for k in range(64)
         if all(ampnb.coverage(t * 2.0**k, e5m2).n_underflow == 0 for t in tensors))
smallest = min(r.min_nonzero for r in grads_cap.records)
largest = max(r.amax for r in grads_cap.records)
print(f"smallest scale: 2^{k}")
print(f"from the smallest gradient {smallest:.3g}: 2^{math.floor(math.log2(e5m2.underflow_threshold / smallest)) + 1}")
print(f"headroom: the largest gradient becomes {largest * 2.0**k:.3g}, "
      f"{math.log2(e5m2.max / (largest * 2.0**k)):.1f} binades below e5m2's max {e5m2.max:g}")
print(f"the gradients span {math.log2(largest / smallest):.1f} binades; e5m2 holds "
      f"{e5m2.binades_with_subnormals} (normal and subnormal)")

# %% [markdown]
# The gradients of this small CNN span fewer binades than e5m2 holds, so one scale fits them
# all. Real FP8 recipes go further and give each tensor its own scale, computed from its recent
# `amax`, because a large model's gradients together span more than any 8-bit format.
