# %% [markdown]
# # 02 · Autocast: what it lowers, what it keeps, and TF32
#
# `torch.autocast` is the engine of every *mixed* mode (`16-mixed`, `bf16-mixed`). It does not
# change your model: while a `with torch.autocast(...)` block is active, it picks a dtype **per
# operation**. This notebook measures those choices instead of listing them from memory:
#
# 1. which operations autocast lowers to 16 bits, which it keeps in fp32, which follow their input,
# 2. autocast is a region of code, not a property of the model — what happens outside `forward`,
# 3. turning autocast off for a numerically sensitive region,
# 4. *true* modes vs *mixed* modes, and creating a model directly in low precision,
# 5. TF32: fp32 matmuls with a 10-bit mantissa, emulated here on any machine,
# 6. fp16 on a CPU as tensor cores compute it, and an 8M-parameter model whose layers overflow
#    fp16, drawn layer by layer against fp16's range,
# 7. speed needs size: a small model is launch-bound; a model sized for the device shows the gain.
#
# Prerequisites: 00 (quickstart); 01 (number formats) helps. About 20 minutes.
# Everything runs on the CPU; the op lists below are **CPU autocast's** — on a GPU they differ (for
# example CUDA keeps `softmax` and `layer_norm` in fp32), and the same cells measure them there.

# %%
# NBVAL_CHECK_OUTPUT
import copy

import torch
import torch.nn.functional as F
from torch import nn

import ampnb
from ampnb.models import demo

DEVICE = "cpu"  # the tables below are CPU autocast's; set "cuda" on a GPU to see its lists
LOW = torch.bfloat16
g = torch.Generator().manual_seed(0)
print("autocast device:", DEVICE, "| low dtype:", LOW)

# %%
# %load_ext ampnb

# %% [markdown]
# ## 1. Three kinds of operations
#
# Autocast sorts operations into three groups:
#
# * **lowered** — run in the low dtype whatever their inputs are (matmuls, convolutions, linear
#   layers: the ops that are fast in 16 bits and accumulate in higher precision inside),
# * **kept in fp32** — upcast to fp32 even when their inputs are 16-bit (ops whose result suffers
#   from rounding: losses, products over many elements, distances),
# * **follow the input** — not on either list: they run in the dtype of their inputs, and with mixed
#   inputs in the *widest* one (normal type promotion).
#
# We call each op once with fp32 inputs and once with bf16 inputs, inside autocast, and sort it
# by what came out:

# %%
# NBVAL_CHECK_OUTPUT
a, b = torch.randn(8, 8, generator=g), torch.randn(8, 8, generator=g)
img, kernel = torch.randn(1, 3, 8, 8, generator=g), torch.randn(4, 3, 3, 3, generator=g)
labels = torch.randint(0, 8, (8,), generator=g)

OPS = {
    "a @ b": lambda a, b: a @ b,
    "F.linear": lambda a, b: F.linear(a, b),
    "F.conv2d": lambda a, b: F.conv2d(img.to(a.dtype), kernel.to(a.dtype)),
    "a + b": lambda a, b: a + b,
    "torch.relu": lambda a, b: torch.relu(a),
    "torch.exp": lambda a, b: torch.exp(a),
    "torch.sum": lambda a, b: torch.sum(a),
    "torch.softmax": lambda a, b: torch.softmax(a, dim=-1),
    "F.layer_norm": lambda a, b: F.layer_norm(a, (8,)),
    "F.cross_entropy": lambda a, b: F.cross_entropy(a, labels),
    "F.mse_loss": lambda a, b: F.mse_loss(a, b),
    "torch.prod": lambda a, b: torch.prod(a),
    "torch.cdist": lambda a, b: torch.cdist(a, b),
}


def kind(from_fp32, from_low):
    """Name the autocast group from the two output dtypes."""
    if from_fp32 == from_low:
        return "lowered" if from_low == LOW else "kept in fp32"
    return "follows the input"


short = lambda dt: str(dt).removeprefix("torch.")  # noqa: E731
print(f"{'op':16} {'fp32 in ->':11} {'bf16 in ->':11} group")
with torch.autocast(DEVICE, dtype=LOW):
    for name, op in OPS.items():
        out32, out16 = op(a, b).dtype, op(a.to(LOW), b.to(LOW)).dtype
        print(f"{name:16} {short(out32):11} {short(out16):11} {kind(out32, out16)}")

# %% [markdown]
# Two consequences worth remembering:
#
# * A lowered op's output is bf16, and the ops that *follow* it stay bf16: after a `Linear`,
#   `relu`, `softmax` (on CPU) and `layer_norm` (on CPU) all compute in bf16. That is where most of
#   the speed and memory saving comes from, and also most of the rounding.
# * Adding a bf16 tensor to an fp32 one gives fp32 (type promotion), so a residual connection
#   `x + f(x)` with an fp32 `x` brings the stream back to fp32:

# %%
# NBVAL_CHECK_OUTPUT
with torch.autocast(DEVICE, dtype=LOW):
    h = F.linear(a, b)                     # lowered
    print("linear          :", h.dtype)
    print("relu(linear)    :", torch.relu(h).dtype)
    print("a + linear (res):", (a + h).dtype)

# %% [markdown]
# ## 2. Autocast is a region of code, not a property of the model
#
# `torch.autocast` affects every op that runs *inside the `with` block* — the model's `forward`,
# but also a loss, a metric or any matmul you write there. It does not stick to the model or to the
# tensors: call the same model outside the block and it computes in fp32. And tensors that leave
# the block keep their dtype: the logits come out as bf16.
#
# That matters for the loss. `F.cross_entropy` is on the *kept in fp32* list, but only inside
# autocast. Outside, it just follows its bf16 input:

# %%
# NBVAL_CHECK_OUTPUT
d = demo("mlp")
x, y = d.batches[0]

with torch.autocast(DEVICE, dtype=LOW):
    logits = d.model(x)
    loss_inside = d.loss_fn(logits, y)     # autocast upcasts cross_entropy to fp32
loss_outside = d.loss_fn(logits, y)        # outside: follows the bf16 logits
loss_fp32 = d.loss_fn(d.model(x), y)       # the model outside autocast: plain fp32

print("logits leaving the block:", logits.dtype)
print("loss inside autocast    :", loss_inside.dtype)
print("loss outside autocast   :", loss_outside.dtype)
print("model called outside    :", loss_fp32.dtype)

# %% [markdown]
# `%%amp --trace` shows the same op by op, from which module it ran: each `Linear`'s fp32 weights
# are cast (`_to_copy`) to bf16 and its `addmm` runs in bf16 (*lowered*); inside
# `CrossEntropyLoss` the bf16 logits are cast back to float32, and `_log_softmax` and `nll_loss`
# run in float32. `%%amp` computes the loss inside the autocast region, like Lightning does:

# %%
# %%amp bf16-mixed --trace
loss = d.loss_fn(d.model(x), y)

# %% [markdown]
# How much does it matter? Compare both against the fp32 loss (measured; values vary a little between CPUs):

# %%
for name, loss in [("inside autocast", loss_inside), ("outside autocast", loss_outside)]:
    err = (loss.double() - loss_fp32.double()).abs().item()
    print(f"loss {name:17}: {loss.item():.6f}   |error vs fp32| = {err:.2e}")

# %% [markdown]
# The rule that follows: compute the loss **inside** the autocast block (as `%%amp` and Lightning
# do), or call `.float()` on the outputs before you leave it.
#
# The backward pass is the other half. Run `loss.backward()` *outside* the block: autograd already
# runs each backward op in the dtype its forward op used, and the gradients of fp32 parameters are
# fp32:

# %%
# NBVAL_CHECK_OUTPUT
d.model.zero_grad()
loss_inside.backward()
print("weight dtype:", d.model.head.weight.dtype, "| its gradient:", d.model.head.weight.grad.dtype)


# %% [markdown]
# ## 3. Turning autocast off for a region
#
# Sometimes an op that autocast lowers must not be lowered. A classic case is squared distances
# written with a matmul, `|a|² + |b|² − 2 a·b`: when the points are far from the origin, the three
# terms are large and nearly cancel, and bf16's 8 significant bits cannot carry the difference.

# %%
def sq_dists(p, q):
    """Pairwise squared distances via one matmul (fast; cancels badly in low precision)."""
    return (p * p).sum(1)[:, None] + (q * q).sum(1)[None, :] - 2 * p @ q.T


points = 10 + torch.randn(64, 16, generator=g)      # far from the origin, close to each other
exact = sq_dists(points.double(), points.double())

with torch.autocast(DEVICE, dtype=LOW):
    lowered = sq_dists(points, points)
print("dtype:", lowered.dtype, "| smallest entry:", lowered.min().item(),
      "(a squared distance below 0 is impossible)")
print(f"max error vs float64: {(lowered.double() - exact).abs().max().item():.3g} "
      f"(typical distance: {exact.mean().item():.3g})")


# %% [markdown]
# Nest `torch.autocast(DEVICE, enabled=False)` around the sensitive part. One detail: tensors that
# were already lowered stay bf16 inside the disabled region, so cast them back with `.float()` —
# without autocast, an op that mixes bf16 and fp32 is simply an error:

# %%
# NBVAL_CHECK_OUTPUT
def sq_dists_fp32(p, q):
    """sq_dists with autocast switched off, on fp32 inputs, wherever it is called from."""
    with torch.autocast(DEVICE, enabled=False):
        return sq_dists(p.float(), q.float())


with torch.autocast(DEVICE, dtype=LOW):
    safe = sq_dists_fp32(points, points)
    with torch.autocast(DEVICE, enabled=False):
        try:
            points.to(LOW) @ points.T                 # bf16 @ fp32, autocast off
        except RuntimeError as err:
            print("bf16 @ fp32 without autocast ->", type(err).__name__)
print("dtype:", safe.dtype)

# %%
err = (safe.double() - exact).abs().max().item()
print(f"smallest entry: {safe.min().item():.3g}; max error vs float64 with autocast off: {err:.3g}")

# %% [markdown]
# The error shrinks by orders of magnitude. What is left is fp32's own rounding: a
# distance of a point to itself can still come out as a tiny negative number, which is why real
# code (like `torch.cdist`, on autocast's fp32 list) also clamps at zero.

# %% [markdown]
# ### Exercise 1
#
# Predict the dtype after each layer of this block under bf16 autocast on the CPU, then check by
# running the layers one at a time. Which layer brings the computation back to fp32, if any?
#
# ```python
# block = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.LayerNorm(16), nn.Linear(16, 4))
# ```

# %% jupyter={"source_hidden": true} tags=["solution"]
# NBVAL_CHECK_OUTPUT
# Solution: Linear lowers to bf16; GELU and LayerNorm follow their bf16 input on CPU autocast
# (CUDA keeps layer_norm in fp32); the last Linear is lowered again. Nothing returns to fp32.
block = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.LayerNorm(16), nn.Linear(16, 4))
h = torch.randn(2, 8, generator=g)
with torch.autocast(DEVICE, dtype=LOW):
    for layer in block:
        h = layer(h)
        print(f"{type(layer).__name__:10} -> {short(h.dtype)}")

# %% [markdown]
# ## 4. True modes vs mixed modes
#
# In a **mixed** mode the parameters stay fp32 and autocast lowers ops on the fly. In a **true**
# mode (`bf16-true`, `16-true`) the whole model is converted: parameters, inputs and every op are
# bf16. `ampnb.get_mode` gives each mode as a small object that says exactly that:

# %%
# NBVAL_CHECK_OUTPUT
print(f"{'mode':11} {'autocast':9} {'params':9} {'GradScaler'}")
for name in ["32-true", "16-mixed", "bf16-mixed", "16-true", "bf16-true"]:
    mode = ampnb.get_mode(name)
    print(f"{mode.name:11} {short(mode.autocast_dtype) if mode.autocast_dtype else '-':9} "
          f"{short(mode.param_dtype):9} {'yes' if mode.uses_scaler else 'no'}")

# %% [markdown]
# Each mode also knows how to convert a module and its inputs and which context the forward pass
# runs in — the same hooks Lightning's precision plugins have. Run one model under three modes:

# %%
# NBVAL_CHECK_OUTPUT
base = demo("mlp").model
for name in ["32-true", "bf16-mixed", "bf16-true"]:
    mode = ampnb.get_mode(name)
    model = mode.convert_module(copy.deepcopy(base))
    with mode.forward_context(DEVICE):
        out = model(mode.convert_input(x))
    n_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    print(f"{name:10}: params {short(next(model.parameters()).dtype):8} ({n_bytes:,} bytes), "
          f"output {short(out.dtype)}")

# %% [markdown]
# `bf16-true` halves the parameter memory, but it pays for it in training. An optimizer step adds
# `lr × gradient` to each weight, usually a tiny fraction of the weight. bf16 has 7 mantissa bits,
# so next to a weight of 1.0 any update smaller than half its spacing `eps / 2` is rounded away —
# every step. The fp32 master weights of a mixed mode keep them:

# %%
# NBVAL_CHECK_OUTPUT
bf16 = ampnb.get_format("bf16")
update = bf16.eps / 4                      # smaller than half of bf16's spacing at 1.0
w32, w16 = torch.tensor(1.0), torch.tensor(1.0, dtype=torch.bfloat16)
for _ in range(100):
    w32 += update
    w16 += update
print(f"bf16 eps = {bf16.eps}; update = {update}")
print("fp32 weight after 100 updates:", w32.item())
print("bf16 weight after 100 updates:", w16.item())

# %% [markdown]
# ### Creating a model directly in low precision
#
# `model.to(torch.bfloat16)` first builds the whole model in fp32 — twice the memory of the bf16
# model — and only then converts it. For a big model, build it in low precision from the start:
# `mode.module_init_context()` makes the mode's dtype the default while modules are created, and
# restores the default afterwards. (`%%amp bf16-true` does the same for a whole cell.)

# %%
# NBVAL_CHECK_OUTPUT
mode = ampnb.get_mode("bf16-true")
with mode.module_init_context():
    layer = nn.Linear(1024, 1024)              # born in bf16: no fp32 copy is ever made
fp32_layer = nn.Linear(1024, 1024)

size = lambda m: sum(p.numel() * p.element_size() for p in m.parameters())  # noqa: E731
print("inside the context:", layer.weight.dtype, f"{size(layer):,} bytes")
print("a normal layer    :", fp32_layer.weight.dtype, f"{size(fp32_layer):,} bytes")
print("default dtype now :", torch.get_default_dtype())

# %% [markdown]
# ### Exercise 2
#
# Build `nn.Linear(256, 256)` directly in fp16 with the `16-true` mode, run it on a batch
# `torch.randn(4, 256)` under that mode's `forward_context` (don't forget `convert_input`), and
# check: the dtype of its output, its parameter bytes against the fp32 layer, and whether
# `16-true` wants a GradScaler.

# %% jupyter={"source_hidden": true} tags=["solution"]
# NBVAL_CHECK_OUTPUT
mode16 = ampnb.get_mode("16-true")
with mode16.module_init_context():
    lin16 = nn.Linear(256, 256)
with mode16.forward_context(DEVICE):
    out16 = lin16(mode16.convert_input(torch.randn(4, 256, generator=g)))
print("output:", out16.dtype)
print("bytes fp16 / fp32:", size(lin16) / size(nn.Linear(256, 256)))
print("GradScaler:", mode16.uses_scaler)  # true modes have none, as in Lightning

# %% [markdown]
# ## 5. TF32: fp32 matmuls with fewer mantissa bits
#
# On NVIDIA GPUs since Ampere, tensor cores can run *fp32* matmuls and convolutions in TF32: the
# inputs keep fp32's 8 exponent bits (same range) but are rounded to a 10-bit mantissa (fp16's
# precision), and the sums stay fp32. Your tensors remain `float32`; only the arithmetic inside the
# matmul changes. ampnb describes it as a format like any other:

# %%
# NBVAL_CHECK_OUTPUT
tf32 = ampnb.get_format("tf32")
print(f"tf32: {tf32.exponent_bits} exponent bits, {tf32.mantissa_bits} mantissa bits, "
      f"eps {tf32.eps}, largest {tf32.max:.4g}")
v = torch.tensor([1 + 2**-12, 1 + 2**-10, 1.0e38])
print("fp32 values     :", v.tolist())
print("rounded to tf32 :", ampnb.quantize(v, "tf32").tolist())
print("rounded to fp16 :", v.half().tolist(), "(same precision as tf32, far less range)")

# %% [markdown]
# It is switched with global flags (`torch.backends.cuda.matmul.allow_tf32`,
# `torch.set_float32_matmul_precision("high")`), which is exactly the kind of state that leaks
# between notebook cells. `ampnb.tf32(True)` is a context manager that sets them and puts them back.
# Where no device has TF32 units (a CPU, a GPU older than Ampere) it also warns that the flags
# change nothing there; on an Ampere or newer GPU it says nothing:

# %% mystnb={"output_stderr": "show"}
print("before:", torch.get_float32_matmul_precision())
with ampnb.tf32(True):
    print("inside:", torch.get_float32_matmul_precision())
print("after :", torch.get_float32_matmul_precision())

# %% [markdown]
# `%%amp --tf32 on` says what TF32 does on the cell's device too.
# `--tf32 emulate` instead rounds the fp32 inputs of every matmul and convolution in the cell to
# TF32's 10-bit mantissa (with `ampnb.quantize`), so you can see TF32's accuracy on any machine:

# %%
# %%amp 32-true --tf32 on
a1, b1 = torch.randn(256, 256, generator=g), torch.randn(256, 256, generator=g)
full = a1 @ b1

# %%
# %%amp 32-true --tf32 emulate
emulated = a1 @ b1

# %%
exact_mm = a1.double() @ b1.double()
rel = lambda c: ((c.double() - exact_mm).abs().max() / exact_mm.abs().max()).item()  # noqa: E731
print(f"fp32 matmul           : relative error {rel(full):.1e}")
print(f"TF32 (emulated) matmul: relative error {rel(emulated):.1e}")

# %% [markdown]
# ### Exercise 3
#
# Which is more accurate on this matmul: TF32 or bf16 autocast? Predict from the mantissa bits
# (`tf32.mantissa_bits` vs `bf16.mantissa_bits`), then measure with `%%amp bf16-mixed`.

# %% jupyter={"source_hidden": true} tags=["solution"]
# %%amp bf16-mixed -q
lowered_mm = a1 @ b1

# %% jupyter={"source_hidden": true} tags=["solution"]
# Solution: TF32 keeps 10 mantissa bits, bf16 7, so TF32 rounds about 2**3 = 8x more finely;
# bf16 autocast also rounds the *output* to bf16, while TF32 keeps fp32 sums and outputs.
print(f"TF32 (emulated): {rel(emulated):.1e}   bf16-mixed: {rel(lowered_mm):.1e}")
print("bits:", tf32.mantissa_bits, "vs", bf16.mantissa_bits)

# %% [markdown]
# ## 6. fp16 on a CPU: products computed as tensor cores compute them
#
# Most CPUs have no fp16 arithmetic units, and torch's fp16 CPU kernels are a slow fallback. Yet
# what makes fp16 interesting — its range and its rounding — needs no fp16 units. A GPU's tensor
# cores multiply fp16 inputs exactly, add the products in fp32 and round the result to fp16 once;
# an fp32 kernel on the fp16 inputs computes exactly that. So on a CPU without fp16 units ampnb
# runs the *products* of `16-mixed` and `16-true` (matmuls, convolutions, attention, LSTMs,
# forward and backward) that way; everything else — autocast's casts, elementwise ops, the
# GradScaler — stays real fp16. Every report says so, with the slowdown measured on this machine:

# %%
print(ampnb.support("16-mixed", "cpu").text)

# %% [markdown]
# Which of the two is closer to a GPU? Both against the exact product rounded to fp16 once (what
# fp32-accumulating tensor cores return, up to the order of the fp32 sums):

# %%
a16 = torch.randn(64, 4096, generator=g).half()
b16 = torch.randn(4096, 64, generator=g).half()
exact = (a16.double() @ b16.double()).half()
native = a16 @ b16                      # torch's own fp16 CPU kernel
with ampnb.emulated_fp16_kernels():
    emulated16 = a16 @ b16              # an fp32 kernel on the fp16 inputs, rounded once
for name, c in [("torch's native fp16 kernel", native), ("ampnb's emulated kernel", emulated16)]:
    print(f"{name:27}: {(c == exact).float().mean().item():.2%} of the results equal the exact "
          f"product rounded once")

# %% [markdown]
# Both accumulate in fp32 and round once, so both agree with the tensor-core result except where
# the order of the fp32 sums moves a value across a rounding boundary: as close to a GPU as each
# other, and the emulation is the one that runs at fp32 speed. `%%amp 16-mixed --fp16-kernels native`
# (or `ampnb.set_fp16_kernels("native")`, or the PrecisionPanel's *fp16 kernels* control) runs
# torch's own kernels instead.
#
# With fp16 at fp32 speed, a model no longer has to be tiny to show fp16's range. This 8M-parameter
# MLP has a few *outlier features* — hidden units whose weights are hundreds of times larger than
# the rest, as large pretrained transformers grow them — and inputs of a realistic scale. Those
# units' outputs pass fp16's largest value, 65504, and turn into inf. `--hunt` finds where:

# %%
torch.manual_seed(0)
big = nn.Sequential(nn.Linear(1024, 4096), nn.ReLU(), nn.Linear(4096, 1024))
with torch.no_grad():
    big[0].weight[:8] *= 400                            # 8 outlier features
features = torch.randn(512, 1024, generator=g) * 100
with torch.no_grad():
    print(f"{sum(p.numel() for p in big.parameters()) / 1e6:.1f}M parameters; largest first-layer "
          f"output in fp32: {big[0](features).abs().max().item():.0f} "
          f"(fp16's max: {ampnb.get_format('fp16').max:.0f})")

# %%
# %%amp 16-mixed --hunt
out16 = big(features)

# %% [markdown]
# Each layer's output against the formats' ranges, captured in fp32 (`ampnb.capture`): a bar runs
# from the smallest nonzero |x| to the largest on a log2 scale, and the solid vertical lines are
# fp16's and bf16's largest values. A bar that passes fp16's line holds values that become inf
# under fp16; bf16 has fp32's range and holds them all:

# %%
with torch.no_grad(), ampnb.capture(big, kinds=("activation",)) as layers:
    big(features)
ampnb.plots.plot_layer_summary(layers, formats=("fp16", "bf16")).figure

# %% [markdown]
# `--compare` shows what the same forward costs in each mode here, and its error (inf in the
# 16-mixed row; bf16 has fp32's range):

# %%
# %%amp --compare 32-true,16-mixed,bf16-mixed -r 3
big(features)

# %% [markdown]
# ## 7. Speed needs size: a small model is launch-bound
#
# Mixed precision is fast where matrix products dominate the step: tensor cores (and a CPU's bf16
# units) multiply bf16 faster than fp32. But every op also pays a fixed cost to launch, and
# bf16-mixed adds casts. On a small model the fixed costs dominate and bf16-mixed gains nothing —
# on a GPU it can even be slower than 32-true (the demo GPT has about a hundred thousand
# parameters). `ampnb.models.demo_for(device)` sizes a demo for the device: on a GPU, a GPT large
# enough for the tensor cores to show; on a CPU, the demo as it is. One training step of each,
# timed by `ampnb.compare` on the device the model is on:

# %%
from ampnb.models import demo_for  # noqa: E402


def train_step_of(d):
    """One plain training step of a demo (forward, loss, backward, optimizer step)."""
    x, y = d.batches[0]

    def step():
        d.optimizer.zero_grad()
        loss = d.loss_fn(d.model(x), y)
        loss.backward()
        d.optimizer.step()
        return loss
    return step


SPEED_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
sized = {"the demo GPT": demo("gpt", device=SPEED_DEVICE)}
if SPEED_DEVICE != "cpu":
    sized[f"demo_for({SPEED_DEVICE!r})"] = demo_for(SPEED_DEVICE)
for label, d in sized.items():
    found = ampnb.compare(train_step_of(d), ("bf16-mixed",), repeat=5, model=d.model)
    n = sum(p.numel() for p in d.model.parameters())
    print(f"{label}, {n / 1e6:.2f}M parameters, on {found.device}: bf16-mixed "
          f"{found.row('bf16-mixed').speedup:.2f}x the speed of 32-true")

# %% [markdown]
# Read the figures above for the machine that ran this notebook. On a GPU, the small demo's
# ratio shows the launch-bound case and the sized one the tensor cores' gain; on a CPU, whether
# bf16-mixed is faster depends on bf16 units (AVX512-BF16 or AMX; the support table in notebook 00
# says, measured) more than on size.

# %% [markdown]
# ## Summary
#
# * Autocast decides per op: matmul-like ops are **lowered**, sensitive ops are **kept in fp32**,
#   the rest **follow their input**. Measure the lists on your device rather than trusting memory.
# * It applies to the code inside the block, not to the model: compute the loss inside, and run
#   `backward()` outside.
# * `torch.autocast(device, enabled=False)` plus `.float()` protects a sensitive region.
# * Mixed modes keep fp32 master weights; true modes halve memory but round away small updates.
#   `mode.module_init_context()` builds a model directly in low precision.
# * TF32 rounds fp32 matmul inputs to 10 mantissa bits on Ampere+ GPUs; `--tf32 emulate` shows
#   the effect anywhere.
# * On a CPU without fp16 units, fp16 products run as fp32 kernels rounded once (tensor-core
#   numerics) at fp32 speed; `--fp16-kernels native` runs torch's slow fallback instead.
# * Speed needs size: a small model is launch-bound, and `demo_for(device)` sizes one that shows
#   what the hardware's bf16 units give.
#
# Next: **03 · GradScaler**, for the one mode that also needs loss scaling: `16-mixed`.
