# %% [markdown]
# # 08 · Block scaling: MXFP8, MXFP4 and NVFP4
#
# FP8 with one scale per tensor (notebook 04) has a weak spot: the scale is set by the largest
# value, so one outlier pushes every small value of the tensor below the format's range. Blackwell
# GPUs carry a finer answer in hardware: **block-scaled formats**, where every short block of
# values along a row shares its own scale.
#
# - **MXFP8** (OCP Microscaling Formats (MX) Specification v1.0): FP8 elements (e4m3 or e5m2),
#   one e8m0 scale (a power of two) per 32 values.
# - **MXFP4** (same spec): e2m1 elements (±0, 0.5, 1, 1.5, 2, 3, 4, 6), one e8m0 scale per 32.
# - **NVFP4** (NVIDIA, Transformer Engine's NVFP4 recipe): e2m1 elements, one e4m3 scale per 16
#   values, and one fp32 scale per tensor.
#
# This notebook, all on the CPU (the casts are emulated, bit for bit as torchao's reference casts):
#
# 1. the formats as records,
# 2. one outlier under tensorwise FP8 and under MXFP8,
# 3. the what-if: one training step of the demo GPT, every layer's weight, input and output
#    gradient in seven formats,
# 4. NVFP4's two-level scale, one block by hand,
# 5. MXFP8 training, emulated, and what GPUs with these units gain (cited, not measured here),
# 6. exercise: the what-if on a model of your own.
#
# Prerequisites: 01 (formats), 04 (FP8 and its scale). About 15 minutes.

# %%
# NBVAL_CHECK_OUTPUT
import torch
from IPython.display import display
from torch import nn

import ampnb
from ampnb.block_formats import block_format_table
from ampnb.cited import cited_table
from ampnb.plots import plot_blocks, plot_what_if
from ampnb.whatif import get_cast

print(block_format_table())

# %% [markdown]
# ## 1. Formats as records
#
# `ampnb.get_format` knows the block-scaled formats too. Each is a frozen record of its element
# format, its scale format and its block size; every figure above is derived from those bits.
# "binades in one block" is the range one scale leaves a block (e4m3's from its smallest
# subnormal to its max; e2m1's far fewer). Values further than that below their block's largest
# are flushed to zero.

# %%
# NBVAL_CHECK_OUTPUT
mx = ampnb.get_format("mxfp8_e4m3")
print(mx.name, "| element:", mx.element.name, "| scale:", mx.scale.name, "| block:", mx.block_size,
      "| along dim", mx.axis)
print("e8m0 scale: 2^-127 .. 2^127, bits:", mx.scale.bits, "| max", mx.scale.max == 2.0**127)

# %% [markdown]
# ## 2. One outlier: a whole tensor in tensorwise FP8, one block in MXFP8
#
# A 4 x 64 tensor of ordinary values (built from integers, so it is the same on every machine)
# and one value of 10 million. Tensorwise FP8 e4m3 scales the tensor so that its amax lands on
# 448: everything else falls below e4m3's smallest subnormal. MXFP8 gives the outlier's block of
# 32 its own scale: only that block loses its small values.

# %%
# NBVAL_CHECK_OUTPUT
x = ((torch.arange(256) * 37 % 101 - 50) / 17).reshape(4, 64)
x[1, 40] = 1e7
for name in ("fp8_e4m3_tensorwise", "mxfp8_e4m3", "mxfp4", "nvfp4"):
    y, _ = get_cast(name)(x)  # the what-if's casts: FP8 scaled to amax, or block-scaled
    flushed = int(((x != 0) & (y == 0)).sum())
    print(f"{name:20s} values flushed to zero: {flushed:3d} of {int((x != 0).sum())}")

# %%
plot_blocks(x, "mxfp8_e4m3")[0].figure

# %% [markdown]
# Above: the histogram of log2|x|, with one band per distinct block scale (the range e4m3 covers
# at that scale). The outlier's block sits many binades above the rest. Below: per block, the
# share of its values flushed to zero. Tensorwise FP8 loses almost everything everywhere; MXFP8
# loses one block. MXFP4 also loses the smallest values of ordinary blocks: e2m1 spans few
# binades.
#
# NVFP4 loses almost everything too, and that is its recipe, not a bug: its fp32 tensor scale
# follows the tensor's amax, so every other block's e4m3 scale would have to be far smaller than
# e4m3 can hold; the reference cast clamps it at e4m3's smallest normal, and those blocks' values
# end below e2m1's smallest. `ampnb.quantize(x, "nvfp4", tensor_scale=1.0)` (one level only)
# keeps them: try it.
#
# The same views for any tensor of a real model's step: the RangeExplorer with `blocks=` gets a
# "block view" picker. Pick a layer, then a block-scaled format.

# %%
ampnb.panels.RangeExplorer(ampnb.models.demo("gpt", seed=0),
                           blocks=("mxfp8_e4m3", "mxfp4", "nvfp4"))

# %% [markdown]
# ## 3. The what-if on a real model
#
# `ampnb.what_if(model, batch, loss_fn)` runs one fp32 training step (forward and backward, no
# update) and, as each Linear or Conv layer's weight, input and output gradient passes, rounds it
# into each format and keeps only statistics: the SQNR in dB (torchao's `compute_error`,
# 20 log10(||x|| / ||x - q(x)||), higher is closer), the share of values flushed to zero, and the
# share past the format's max. The model, its gradients and every random generator are put back.

# %%
demo = ampnb.models.demo("gpt", seed=0)
report = ampnb.what_if(demo.model, demo.batches[0], demo.loss_fn)
display(report)
plot_what_if(report).figure

# %% [markdown]
# Each row of the heat map is a layer, each column a format; a cell is the worst of the layer's
# three tensors. Each mantissa bit is worth about 20 log10(2) ≈ 6 dB of SQNR: fp16 (10 bits) far
# above bf16 (7), then the FP8 variants (3), then MXFP4 and NVFP4 (1). NVFP4's finer blocks and e4m3 scales buy
# it a little over MXFP4. The table's `underflow` view shows where a format's range, not its
# precision, is what costs: the output gradients.

# %%
# NBVAL_CHECK_OUTPUT
worst = {m: min(report.formats, key=lambda f: report.value(m, f)) for m in report.modules}
best = {m: max(report.formats, key=lambda f: report.value(m, f)) for m in report.modules}
print("lowest SQNR, every layer:", sorted(set(worst.values())))
print("highest SQNR, every layer:", sorted(set(best.values())))

# %%
report.table("underflow")

# %% [markdown]
# ## 4. NVFP4's two-level scale, one block by hand
#
# NVFP4 scales twice. One fp32 number per tensor, `amax / (448 * 6)`, brings the tensor's largest
# block scale to e4m3's max; then each block of 16 gets an e4m3 scale `block amax / 6 / tensor
# scale`, rounded to e4m3; then each value, divided by both, is rounded onto e2m1's 8 magnitudes.

# %%
# NBVAL_CHECK_OUTPUT
block = torch.tensor([[12.0, 5.1, -0.6, 0.4, 3.0, -7.5, 0.05, 1.0, 0, 0, 0, 0, 0, 0, 0, 2.2],
                      [0.003, -0.001, 0.002, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0.0005]])
tensor_scale = block.abs().amax() / (448 * 6)
block_scales = (block.abs().amax(-1) / 6 / tensor_scale).to(torch.float8_e4m3fn).float()
print("tensor scale (fp32): amax 12 / 2688 =", f"{tensor_scale.item():.6g}")
print("block scales (e4m3):", block_scales.tolist())
elements = block / (tensor_scale * block_scales[:, None])
print("elements before rounding, row 0:", [f"{v:.2f}" for v in elements[0, :8].tolist()])
q = ampnb.quantize(block, "nvfp4")
print("nvfp4, row 0:", [f"{v:.3g}" for v in q[0, :8].tolist()])
print("nvfp4, row 1:", [f"{v:.3g}" for v in q[1, :3].tolist()], "(its own e4m3 scale: kept)")
seven = torch.zeros(1, 32)
seven[0, 0] = 7.0
print("a block whose amax is 7: mxfp4 gives", f"{ampnb.quantize(seven, 'mxfp4')[0, 0].item():.4g}",
      "| nvfp4 gives", f"{ampnb.quantize(seven, 'nvfp4')[0, 0].item():.4g}")

# %% [markdown]
# The second row's values are thousands of times smaller than the first's, yet they keep their
# digits: their block has its own scale. And the e4m3 block scale is not a power of two, so a
# block's amax lands on e2m1's 6 itself. MXFP4's power-of-two scale (FLOOR, 2^(floor(log2 amax)
# - 2), as torchao's default) is 1 for an amax of 7, and 7 is past e2m1's 6: it saturates.
#
# ## 5. MXFP8 training, emulated, and what the hardware gains
#
# `ampnb.fp8.convert_to_fp8(model, "mxfp8")` swaps every Linear for an `MxLinear`: all three
# GEMMs of training (forward, input gradient, weight gradient) see MXFP8 e4m3 operands blocked
# along their reduction dimension, as torchao's MX training does. It runs torchao's MX path where
# torchao is installed (its emulated kernels on a CPU), ampnb's casts elsewhere; the report
# says which ran. In a cell: `%%amp transformer-engine-mxfp8` (alias `mxfp8`).

# %%
mlp = ampnb.models.demo("mlp", seed=0)
model, fp8_report = ampnb.fp8.convert_to_fp8(mlp.model, "mxfp8")
display(fp8_report)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
for xb, yb in mlp.batches[:3]:
    opt.zero_grad()
    loss = mlp.loss_fn(model(xb), yb)
    loss.backward()
    opt.step()
    print(f"loss {loss.item():.4f}")

# %% [markdown]
# Emulation shows the numerics, never the speed: on this CPU every cast is extra work. What GPUs
# with block-scaled tensor cores gain is published; the figures below are **cited from their
# sources, not measured here**.

# %%
# NBVAL_CHECK_OUTPUT
print(cited_table())

# %% [markdown]
# ## 6. Exercise: the what-if on a model of your own
#
# Build a small convolutional network (two `nn.Conv2d` and a `nn.Linear`), a batch of images and
# targets, and run `ampnb.what_if` on it with `formats=["bf16", "mxfp8_e5m2", "mxfp4", "nvfp4"]`.
# Which tensor kind loses most in MXFP4? Does e5m2's wider range help the output gradients?
# (Convolutions are blocked along their channels.)

# %% jupyter={"source_hidden": true} tags=["solution"]
torch.manual_seed(0)
cnn = nn.Sequential(nn.Conv2d(32, 32, 3, padding=1), nn.ReLU(), nn.Conv2d(32, 32, 3, padding=1),
                    nn.Flatten(), nn.Linear(32 * 8 * 8, 10))
images, labels = torch.randn(8, 32, 8, 8), torch.randint(0, 10, (8,))
mine = ampnb.what_if(cnn, (images, labels), nn.functional.cross_entropy,
                     formats=["bf16", "mxfp8_e5m2", "mxfp4", "nvfp4"])
display(mine)
plot_what_if(mine, tensors=("grad_output",)).figure
