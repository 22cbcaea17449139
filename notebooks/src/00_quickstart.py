# %% [markdown]
# # 00 · Quickstart: mixed precision in five minutes
#
# Mixed precision makes a model compute in a 16-bit format (bf16 or fp16) where that is safe and
# keeps fp32 where it is not. This tour shows the whole toolkit on a tiny model:
#
# 1. `%load_ext ampnb` and `%amp` — what this machine supports,
# 2. `%%amp bf16-mixed` — run any cell under a precision mode and see the dtypes it produced,
# 3. `%%amp --compare` — time and check one cell under several modes,
# 4. `--show-code` — the plain PyTorch (and Lightning / Accelerate) code to take home,
# 5. the **PrecisionPanel** — flip the mode while a real model trains.
#
# Everything runs on a laptop CPU in a few seconds. Run the cells from top to bottom
# (*Run → Run All Cells* works too).

# %%
# %load_ext ampnb

# %% [markdown]
# ## What can this machine do?
#
# `%amp` on its own line shows the defaults of `%%amp`, each precision mode and format, whether this
# machine runs it natively, slowly, emulated or not at all, and a matmul throughput **measured** here
# (a short micro-benchmark, run once and cached). Your numbers will differ from your neighbour's.

# %%
# %amp

# %% [markdown]
# ## A tiny model
#
# `ampnb.models.demo` builds small, seeded models with their optimizer, loss and batches. The MLP
# classifies points of three interleaved spirals. We put it on the GPU if there is one, else the
# CPU (`%%amp` runs where the cell's model and tensors are). `demo_for` sizes the demo for the
# device: on a GPU it is made large enough for tensor cores to show in the comparison below (a
# tiny model there is launch-bound, notebook 02 shows it); on a CPU it is the demo as it is.

# %%
# NBVAL_CHECK_OUTPUT
import torch

import ampnb
from ampnb.models import demo, demo_for

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
d = demo_for(DEVICE, "mlp")
x, y = d.batches[0]
d

# %% [markdown]
# ## Run a cell under `bf16-mixed`
#
# Put `%%amp MODE` on the first line of a cell. In a *mixed* mode the cell runs under
# `torch.autocast`: operations that are fast and safe in 16 bits (matrix multiplications, linear
# layers) compute in bf16, while precision-sensitive ones (such as losses) are computed in fp32;
# notebook 02 measures which op goes where. The report
# lists every tensor the cell created and its dtype.

# %%
# %%amp bf16-mixed
logits = d.model(x)
loss = d.loss_fn(logits, y)
loss

# %% [markdown]
# The variables the cell made are ordinary Python variables. Look at them after the cell: the logits
# came out of a `Linear` layer in bf16, the loss was computed in fp32, and the weights were never
# touched — they are still fp32. That is what *mixed* means. Autocast is also switched off again:
# nothing `%%amp` does outlives its cell.

# %%
# NBVAL_CHECK_OUTPUT
print("logits :", logits.dtype)
print("loss   :", loss.dtype)
print("weights:", next(d.model.parameters()).dtype)
print("autocast still on after the cell?", torch.is_autocast_enabled(DEVICE))

# %% [markdown]
# ## Compare modes side by side
#
# `--compare` runs the same cell once per mode from the same saved state (models, optimizers and
# random state restored after every run, seed 0) and measures: the median time after a warm-up, the
# speedup against `32-true`, the activation memory kept for backward, and how far the result is
# from the fp32 result.
#
# Most CPUs have no fp16 arithmetic units, and torch's own fp16 kernels there are a slow fallback
# (the support table above says how many times slower, measured). So on such a CPU ampnb runs the
# matrix products of `16-mixed` as fp32 kernels on the fp16 inputs, rounded to fp16 once — what a
# GPU's tensor cores compute — and the row says so. Whether bf16 is faster than fp32 on a CPU
# depends on the CPU too: see the support table above.

# %%
# %%amp --compare 32-true,16-mixed,bf16-mixed
d.model(x)

# %% [markdown]
# The cell's result is the logits. Their error against fp32 is not noise: bf16 keeps only 7
# mantissa bits, so every number it stores is rounded to about 2–3 significant decimal digits.
# Compare the *rel err* column with bf16's rounding step, which `ampnb.get_format` derives from
# the bits:

# %%
# NBVAL_CHECK_OUTPUT
bf16 = ampnb.get_format("bf16")
print(f"bf16: {bf16.exponent_bits} exponent bits, {bf16.mantissa_bits} mantissa bits")
print(f"relative rounding step (eps) = 2**-{bf16.mantissa_bits} = {bf16.eps}")
print(f"largest value = {bf16.max:.4g} (fp32's range, so no overflow and no GradScaler needed)")

# %% [markdown]
# ## Take the code home
#
# `--show-code` prints the plain `torch.amp` code equivalent to what ran, and the matching
# Lightning `precision=` and Hugging Face Accelerate `mixed_precision=` settings.

# %%
# %%amp bf16-mixed --show-code
loss = d.loss_fn(d.model(x), y)

# %% [markdown]
# ## Flip the mode while a model trains
#
# The **PrecisionPanel** wraps a `Workbench`: a real model, optimizer, loss and batches that can be
# switched between modes, devices and TF32 *live*. An fp32 master copy of the weights is kept, so
# switching never silently degrades the model.
#
# Try it: press **Step** a few times, choose `bf16-mixed` in the *mode* list, press **Run N**, then
# switch back to `32-true`. The loss curve is coloured by mode; the side shows the step time, the
# speedup against `32-true`, the parameter dtype and the activation memory. **Reset** returns the
# model to where it started.

# %%
from ampnb.panels import PrecisionPanel

workbench = ampnb.Workbench(*demo("mlp"))
PrecisionPanel(workbench)

# %% [markdown]
# ## Exercise
#
# `bf16-true` is *not* mixed: the whole model is stored and computed in bf16. Under a true mode,
# `%%amp` makes bf16 the default dtype while the cell runs, so modules and tensors created in the
# cell are born in bf16.
#
# Build a fresh `demo("mlp").model` and a batch `torch.randn(4, 2)` inside a `%%amp bf16-true` cell
# and run the model on it. What dtype do the weights, the input and the output have? And what is
# `torch.get_default_dtype()` after the cell?
#
# *(The solution is in the next cell; in JupyterLab click its collapsed bar to open it.)*

# %% jupyter={"source_hidden": true} tags=["solution"]
# %%amp bf16-true
small = demo("mlp", device=DEVICE).model
xb = torch.randn(4, 2, device=DEVICE)
out = small(xb)

# %% jupyter={"source_hidden": true} tags=["solution"]
# NBVAL_CHECK_OUTPUT
print("weights:", next(small.parameters()).dtype)  # born in bf16: no fp32 master copy at all
print("input  :", xb.dtype)
print("output :", out.dtype)
print("default dtype after the cell:", torch.get_default_dtype())  # restored to float32

# %% [markdown]
# ## Where next
#
# * **01 · Number formats** — what fp16, bf16 and fp8 can and cannot represent.
# * **02 · Autocast** — which operations autocast lowers, which it keeps in fp32, and TF32.
# * **03 · GradScaler** — why fp16 training needs loss scaling, one stage at a time.
# * **04 · FP8 and low bit** — scaling into tiny formats.
#
# `%%amp?` shows every option of the magic. See `notebooks/README.md` for the full path.
