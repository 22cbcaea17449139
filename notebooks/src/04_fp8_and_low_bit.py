# %% [markdown]
# # 04 · FP8 and low-bit precision, on any CPU
#
# Real FP8 training needs an NVIDIA GPU of compute capability 8.9 or newer (Ada, Hopper) and
# NVIDIA Transformer Engine; real 4-bit weights need bitsandbytes on CUDA. Most of us have neither.
# `ampnb.fp8` **emulates** both in plain PyTorch, with the same knobs the real libraries have, so
# you can see on a laptop what they do to a model:
#
# 1. the two FP8 formats, and what happens past their largest value,
# 2. why FP8 needs a **scale** per tensor, and how a *recipe* picks it (amax history, margin),
# 3. an FP8 linear layer, and a whole transformer converted to FP8,
# 4. the same model trained in fp32, bf16-mixed and FP8, side by side,
# 5. 4-bit NormalFloat (NF4) and friends: Lightning's six bitsandbytes modes, with block-wise scales,
# 6. LLM.int8(): int8 matmuls that send outlier features to 16 bits,
# 7. 8-bit Adam: the optimizer's state in 8 bits.
#
# Every number is measured here or derived from the formats' bits. The whole notebook runs in well
# under a minute on a small CPU.

# %% [markdown]
# Tiny models train faster on one CPU thread: splitting a 32-wide matmul between threads costs more
# than it saves, and on a shared machine (Binder) it can cost a lot. This is a choice for this
# notebook, not something ampnb does to your session.

# %%
import torch

import ampnb
from ampnb import fp8, lowbit, plots

torch.set_num_threads(1)

# %% [markdown]
# ## 1 · Two FP8 formats
#
# FP8 comes in two flavours (the OCP FP8 spec, torch's `float8_e4m3fn` and `float8_e5m2`):
#
# * **e4m3** — 4 exponent bits, 3 mantissa bits: more precision, small range. Used for activations
#   and weights in the forward pass.
# * **e5m2** — 5 exponent bits, 2 mantissa bits: fp16's range with much less precision. Used for
#   gradients, whose magnitudes spread much wider.
#
# The table is computed from the bit layout of each format (and checked against `torch.finfo`):

# %%
# NBVAL_CHECK_OUTPUT
from ampnb.formats import format_table

print(format_table(("fp16", "bf16", "fp8_e4m3", "fp8_e5m2")))

# %% [markdown]
# Notice the last column. e4m3**fn** ("finite") has no infinity: torch's cast **saturates** to ±448.
# e5m2 has an infinity, and a value past its max becomes `inf`, as in fp16. `ampnb.quantize`
# rounds exactly like torch's casts (round to nearest, ties to even):

# %%
# NBVAL_CHECK_OUTPUT
x = torch.tensor([0.3, 1.0, 300.0, 500.0, 1e6])
for name, dtype in [("fp8_e4m3", torch.float8_e4m3fn), ("fp8_e5m2", torch.float8_e5m2)]:
    q = ampnb.quantize(x, name)
    print(f"{name}: {q.tolist()}   same as torch's cast: {torch.equal(q, x.to(dtype).float())}")

# %% [markdown]
# ## 2 · Why FP8 needs a scale
#
# With only 3 mantissa bits and 15 binades, e4m3 can hold either big or small numbers, not both.
# Gradients and many activations are small: most of them round to **zero** when cast as they are.
# FP8 recipes therefore multiply each tensor by a **scale** before the cast (and divide it back out
# after the matmul), chosen so that the tensor's largest magnitude, its **amax**, lands near the
# format's max:
#
# $$\text{scale} = \frac{\text{fp8\_max}}{\text{amax}} \cdot 2^{-\text{margin}}$$
#
# Here is a gradient-like tensor before and after scaling, against e4m3's range (the histogram of
# $\log_2|x|$ from notebook 01's range plots):

# %%
g = torch.randn(20_000, generator=torch.Generator().manual_seed(0)) * 1e-3
scale = fp8.amax_to_scale(g.abs().amax(), "fp8_e4m3")
unscaled = ampnb.quantize(g, "fp8_e4m3")
scaled = fp8.scaled_quantize(g, "fp8_e4m3", scale) / scale
print(f"scale = {scale.item():.4g}")
print(f"cast as is:    {(unscaled == 0).float().mean():.1%} of values became 0, "
      f"SQNR {fp8.sqnr(g, unscaled):.1f} dB")
print(f"scaled first:  {(scaled == 0).float().mean():.1%} of values became 0, "
      f"SQNR {fp8.sqnr(g, scaled):.1f} dB")

# %%
ax = plots.plot_tensor_histogram(g, formats=["fp8_e4m3"], title="gradient as is")
ax.figure

# %%
ax = plots.plot_tensor_histogram(g * scale, formats=["fp8_e4m3"], title="gradient × scale")
ax.figure

# %% [markdown]
# SQNR (signal-to-quantization-noise ratio, in dB) measures how much of the tensor survived: every
# 6 dB is about one more correct bit.
#
# ## 3 · A recipe: delayed scaling with an amax history
#
# Computing amax right before each cast costs an extra pass over the tensor. NVIDIA Transformer
# Engine's default recipe, `DelayedScaling`, instead uses the amaxes of **earlier** steps:
#
# * every cast records its tensor's amax in a history of the last `amax_history_len` steps,
# * the next step's scale comes from that history: its `max`, or only its `most_recent` value,
# * `margin` keeps `2**margin` of headroom below the format's max,
# * `fp8_format="HYBRID"` uses e4m3 forward and e5m2 for the gradients (`"E4M3"`: e4m3 everywhere).
#
# `ampnb.fp8.DelayedScaling` has the same field names and defaults as Transformer Engine's:

# %%
# NBVAL_CHECK_OUTPUT
recipe = fp8.DelayedScaling()
print(recipe.describe())
print("scale for amax 3.5, margin 1:", fp8.amax_to_scale(torch.tensor(3.5), "fp8_e4m3", margin=1).item())

# %% [markdown]
# Let's watch one emulated FP8 linear layer with a short history (4 steps). Its inputs are multiplied
# by 16 at step 3, then shrink again. `Fp8Stats` records every cast: the amax, the scale that was used,
# where the largest value landed (amax × scale), and which fraction saturated or flushed to zero.

# %%
torch.manual_seed(0)
layer = fp8.Fp8Linear(64, 64, recipe=fp8.DelayedScaling(amax_history_len=4))
sizes = [1, 1, 1, 16, 16, 1, 1, 1, 1, 1]
with fp8.Fp8Stats(torch.nn.Sequential(layer)) as stats:
    for size in sizes:
        layer(torch.randn(32, 64) * size).sum().backward()
stats.steps_table("0", "input")

# %%
ax = plots.plot_fp8_scaling(stats, "0", "input")
ax.figure

# %% [markdown]
# Read the table from the top:
#
# * **step 0** uses Transformer Engine's initial scale of 1, which wastes most of e4m3's range.
# * From step 1 the scale comes from the history, and amax × scale lands near 448. When a step's
#   amax is a little larger than the earlier ones, a few values already saturate: that is what
#   `margin` (headroom) is for.
# * At **step 3** the inputs jump, but the scale was chosen from the *earlier* amaxes: most values
#   saturate (they are clamped to ±448) for one step. That is the price of delayed scaling.
# * With `amax_compute_algo="max"` the spike stays in the 4-step history, so when the inputs shrink
#   again (step 5) the scale stays small and they use only a small part of e4m3's range, until the
#   spike has left the window (step 9).
#
# ### Exercise 1
#
# Build the same layer with `amax_compute_algo="most_recent"` and `margin=1`, and run the same
# sizes. Before you run it, predict: does the saturation at step 3 go away? How soon does the scale
# recover after the inputs shrink at step 5?

# %%
# your code here

# %% jupyter={"source_hidden": true} tags=["solution"]
torch.manual_seed(0)
layer = fp8.Fp8Linear(64, 64, recipe=fp8.DelayedScaling(
    amax_history_len=4, amax_compute_algo="most_recent", margin=1))
with fp8.Fp8Stats(torch.nn.Sequential(layer)) as stats2:
    for size in sizes:
        layer(torch.randn(32, 64) * size).sum().backward()
# Step 3 still saturates: a 16x jump is far more than margin=1's 2x headroom,
# but the small overshoot at step 2 no longer saturates.
# The scale recovers one step after the inputs shrink (step 6): most_recent forgets the
# spike at once, while "max" waited for it to leave the 4-step window (step 9).
stats2.steps_table("0", "input")

# %% [markdown]
# ## 4 · A whole model in FP8
#
# `fp8.convert_to_fp8` swaps every `nn.Linear` for an emulated `Fp8Linear` (on a copy, unless you
# pass `inplace=True`). Real FP8 matmuls need aligned shapes: like Lightning's Transformer Engine
# plugin, layers whose `in_features` is not a multiple of 8 or `out_features` not a multiple of 16
# stay in higher precision — and the report says which and why. Here is ampnb's tiny character
# GPT (the same one as in the other notebooks, made smaller):

# %%
# NBVAL_CHECK_OUTPUT
from ampnb.models import demo

KNOBS = dict(width=32, depth=1, n_head=2, batch_size=8, seq_len=32, n_batches=8)
gpt = demo("gpt", seed=0, **KNOBS)
print(fp8.plan(gpt.model))

# %% [markdown]
# The output layer has one unit per character of the vocabulary, which is not a multiple of 16:
# it stays in bf16. (Padding the vocabulary to a multiple of 16 would let it run in FP8.)
#
# The RangeExplorer panel from notebook 01 takes an FP8 model too. Pick a layer and compare its
# weights, activations and gradients with the e4m3 and e5m2 bands: these are the tensors *before*
# scaling, so you can see how far each one has to be moved by its scale.

# %%
from ampnb.panels import RangeExplorer

fp8_gpt, report = fp8.convert_to_fp8(gpt.model)
RangeExplorer(fp8_gpt, gpt.batches[0], gpt.loss_fn,
              formats=["fp8_e4m3", "fp8_e5m2", "bf16"], shown=["fp8_e4m3", "fp8_e5m2"])

# %% [markdown]
# The precision modes know FP8 too. Lightning's `"transformer-engine"` mode runs the real thing when
# Transformer Engine and an FP8-capable GPU are there, and ampnb's emulation everywhere else:

# %%
mode = ampnb.get_mode("transformer-engine")
print(mode.availability("cpu").reason)

# %% [markdown]
# ## 5 · Training side by side
#
# `fp8.side_by_side` trains identical copies of the demo (same seed, same batches) under 32-true,
# bf16-mixed and emulated FP8 (bf16 autocast for the non-matmul ops, as Lightning's FP8 mode does),
# and records every FP8 cast of the last run.

# %%
result = fp8.side_by_side("gpt", steps=150, **KNOBS)
result

# %%
ax = plots.plot_side_by_side(result)
ax.figure

# %% [markdown]
# The curves lie on top of each other: with good scales, FP8 matmuls cost this model almost no
# accuracy. Per layer, the SQNR of each FP8 layer's output against the same layer computed in fp32
# (latest step), and the latest cast of each tensor:

# %%
result.stats.table()

# %% [markdown]
# ## 6 · Low-bit weights: Lightning's bitsandbytes modes
#
# For inference and fine-tuning (QLoRA), weights can be stored in 4 or 8 bits while the compute
# stays in 16 bits. Lightning's `BitsandbytesPrecision(mode, dtype, ignore_modules)` offers six
# modes, and `lowbit.quantize_model(model, mode, dtype=..., ignore_modules=...)` takes the same
# arguments. The 4-bit weights are cut into **blocks** of 64 values; each block is divided by its
# absmax, so every value lies in [-1, 1], and then rounded to the nearest of 16 **code values**.
#
# **NF4** (4-bit NormalFloat) places its 16 codes at quantiles of the normal distribution, because
# trained weights are roughly normal: each code then gets about the same share of the weights.
# `ampnb` derives the code book from `torch.special.ndtri` (the inverse normal CDF) exactly as
# bitsandbytes does, and it matches the published table bit for bit:

# %%
# NBVAL_CHECK_OUTPUT
book = lowbit.nf4_codebook()
print([round(v, 4) for v in book.tolist()])

# %% [markdown]
# bitsandbytes' **FP4** is an e2m1 float, the OCP grid but for one value: its smallest non-zero
# magnitude is 0.0625/12 instead of 0.5/6. Both code books, side by side with the OCP e2m1 grid
# (from `ampnb.formats`):

# %%
# NBVAL_CHECK_OUTPUT
e2m1 = ampnb.get_format("fp4_e2m1")
ocp = sorted({abs(v) for v in (ampnb.quantize(torch.linspace(0, e2m1.max, 1001), e2m1) / e2m1.max).tolist()})
print("bitsandbytes fp4:", [round(v, 4) for v in sorted(set(lowbit.fp4_codebook().abs().tolist()))])
print("OCP e2m1 / max:  ", [round(v, 4) for v in ocp])

# %%
w = gpt.model.blocks[0].mlp[0].weight
ax = plots.plot_lowbit_grid(w, "nf4")
ax.figure

# %% [markdown]
# The scales cost memory too: one fp32 absmax per 64 weights is 32/64 = 0.5 extra bits per weight.
# **Double quantization** (`-dq`, QLoRA) subtracts their mean and stores them in bitsandbytes'
# *dynamic 8-bit map* (a decimal exponent and a linear fraction, so small scales keep their
# relative precision), with one fp32 absmax per 256 of them. Derived from the block sizes:

# %%
# NBVAL_CHECK_OUTPUT
saving = lowbit.double_quant_saving()
print(f"saving = 32/64 - (8/64 + 32/(64*256)) = {saving:.4f} bits per parameter")
print(f"for a 65B-parameter model: {65e9 * saving / 8 / 1e9:.2f} GB "
      f"(Lightning's docs: ~0.37 bits per parameter, about 3 GB)")
for name, f in lowbit.LOWBIT_FORMATS.items():
    print(f"{name:14s} {f.bits_per_param((4096, 4096)):7.4f} bits/param   {f.description}")

# %% [markdown]
# What does each mode do to our model? `quantize_model` replaces every Linear (and GPT-2's Conv1D)
# with an emulated bitsandbytes layer (on a copy) and measures, per layer, the error of the weight
# the matmul really uses and of the layer's output for a batch. One table for the six modes —
# bits per parameter and memory of the quantized weights, mean weight SQNR, and the loss:

# %%
from ampnb.display import Table, format_bytes

x, y = gpt.batches[0]
with torch.no_grad():
    fp32_loss = gpt.loss_fn(gpt.model(x), y).item()
rows = []
for name in lowbit.LOWBIT_FORMATS:
    q_model, r = lowbit.quantize_model(gpt.model, name, inputs=x)
    n = sum(e.shape[0] * e.shape[1] for e in r.layers)
    with torch.no_grad():
        loss = gpt.loss_fn(q_model(x), y).item()
    rows.append((name, f"{8 * r.quantized_bytes / n:.3f}", format_bytes(r.quantized_bytes),
                 format_bytes(r.fp32_bytes), f"{sum(e.weight_sqnr_db for e in r.layers) / len(r.layers):.1f}",
                 f"{loss:.4f}", f"{fp32_loss:.4f}"))
Table(("mode", "bits/param", "weights", "in fp32", "weight SQNR dB", "loss", "fp32 loss"), rows,
      caption="the demo GPT's Linear layers in each bitsandbytes mode (emulated)")

# %% [markdown]
# Lightning's other two arguments: `dtype` is the compute dtype (bfloat16 by default for the 4-bit
# modes; the int8 modes need float16, as in Lightning), and `ignore_modules` keeps layers whose
# name starts with one of its strings as they are. A model that already holds low-bit layers is
# not replaced again — only the compute dtype is set:

# %%
nf4_model, report = lowbit.quantize_model(gpt.model, "nf4-dq", dtype=torch.float16, inputs=x,
                                          ignore_modules={"head"})
again, report_again = lowbit.quantize_model(nf4_model, "int8")
print(nf4_model.blocks[0].mlp[0], "| head:", type(nf4_model.head).__name__)
print(next(n for n in report_again.table().notes if "none replaced" in n))
report

# %% [markdown]
# ## 7 · LLM.int8(): outlier features in 16 bits
#
# `int8` stores the weights in int8 (one scale per output row); `int8-training` keeps 16-bit
# weights and quantizes them each forward. Both multiply **int8 activations** by int8 weights —
# except for *outlier features*: a feature (input column) in which any value reaches the threshold
# (6.0) goes a 16-bit path instead, because one huge value would otherwise flatten the int8 scale of
# its whole row. Large language models grow a few such features; here is one made by hand:

# %%
g = torch.Generator().manual_seed(0)
acts = torch.randn(16, 64, generator=g)
acts[:, 7] *= 30
lowbit.int8_split(acts, torch.randn(32, 64, generator=g) * 0.05)

# %% [markdown]
# And the activations entering our GPT's first MLP layer (small model, no outliers yet):

# %%
feats = {}
hook = gpt.model.blocks[0].mlp[0].register_forward_pre_hook(lambda m, i: feats.update(x=i[0]))
with torch.no_grad():
    gpt.model(x)
hook.remove()
lowbit.int8_split(feats["x"].reshape(-1, feats["x"].shape[-1]), gpt.model.blocks[0].mlp[0].weight)

# %% [markdown]
# The `int8` report on a batch names, per layer, the input features that went the fp16 path:

# %%
lowbit.quantize_model(gpt.model, "int8", inputs=x)[1]

# %% [markdown]
# ### Exercise 2
#
# Lower the threshold of `int8_split` on the GPT's activations until some features go the 16-bit
# path. How does the output SQNR change, and why is 16 bits for *every* feature not the answer?

# %%
# your code here

# %% jupyter={"source_hidden": true} tags=["solution"]
for t in (6.0, 4.0, 3.0, 2.0):
    split = lowbit.int8_split(feats["x"].reshape(-1, feats["x"].shape[-1]),
                              gpt.model.blocks[0].mlp[0].weight, threshold=t)
    print(f"threshold {t}: {len(split.outlier_features)} of {split.features} features in fp16, "
          f"SQNR {split.sqnr_decomposed_db:.1f} dB")
# Each feature moved to fp16 makes the int8 scales finer, but the fp16 path is the slow one:
# LLM.int8() wins only because very few features (~0.1% in large models) need it.

# %% [markdown]
# ## 8 · 8-bit optimizer state
#
# Lightning's page suggests `bitsandbytes.optim.Adam8bit` for more memory savings: Adam keeps two
# fp32 moments per parameter (8 bytes), 8-bit Adam stores each in the dynamic 8-bit map with one
# fp32 absmax per block of 256 (about 2 bytes). Tensors under 4096 values keep fp32 state, and the
# page advises keeping **embeddings'** state in 32 bits (bitsandbytes' `register_module_override`);
# in ampnb: `lowbit.Adam8bit(lowbit.param_groups(model, (nn.Embedding,)))`. Three runs from the
# same start on a wider GPT; the state is measured by ampnb's memory meter:

# %%
opt_runs = lowbit.compare_optimizers("gpt", steps=80, width=96, depth=1, n_head=4, batch_size=8,
                                     seq_len=32)
opt_runs

# %%
ax = plots.plot_optimizer_losses(opt_runs)
ax.figure

# %% [markdown]
# The curves stay together while the state shrinks to little more than a quarter
# (8-bit codes instead of 32-bit floats, plus block scales): the dynamic map keeps the
# small second moments' relative precision, and block-wise scales keep one large gradient from
# flattening the others.

# %% [markdown]
# ## What runs for real
#
# * With Transformer Engine on a GPU of compute capability ≥ 8.9, the `"transformer-engine"`
#   modes swap in TE's `Linear` / `LayerNorm` and run under `te.fp8_autocast` with the matching
#   `DelayedScaling` recipe; `fp8.te_status()` says whether that is the case here.
# * On CUDA with bitsandbytes installed, `lowbit.quantize_model` puts bitsandbytes' own
#   `Linear4bit` / `Linear8bitLt` in place (the report says so), and `lowbit.roundtrip` uses its
#   quantize/dequantize; everywhere else the emulation, which follows the same arithmetic.
# * The emulation does the casts exactly (bit for bit like torch's float8 dtypes) and the matmul
#   in fp32, so it shows the *accuracy* of FP8 and of low-bit weights, not their speed.
