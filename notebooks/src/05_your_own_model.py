# %% [markdown]
# # 05 · Your own model: the precision doctor
#
# Which precision mode should *your* model use on *this* machine? Where does it break in fp16, and
# which layers should stay in fp32? `ampnb.doctor` answers by experiment: it runs one training step
# of your model in each mode — on copies, from the same weights, batch and random seed — and
# compares each against the fp32 step, within a time budget (15 plain training steps by default):
#
# 1. a model that breaks in fp16 (activations past 65504, as large pretrained transformers have),
# 2. reading the evidence: per mode, then per layer (end-to-end and local error, headroom),
# 3. applying the recommendation: fp32 islands with `keep_fp32`, and the take-home code,
# 4. why bf16 is (or is not) faster here: the profile,
# 5. the doctor on a bigger model: its time budget and its memory,
# 6. exercise: the doctor on a model of your choice.
#
# Prerequisites: 01 (formats), 02 (autocast), 03 (GradScaler). About 20 minutes. Everything runs
# on the CPU; on a CPU without fp16 units, fp16 matrix products run as fp32 kernels rounded once to
# fp16 (what fp32-accumulating tensor cores compute), and the doctor says so in its tables.

# %%
# NBVAL_CHECK_OUTPUT
import torch
from torch import nn

import ampnb

torch.manual_seed(0)
print("fp16 max:", torch.finfo(torch.float16).max, "| bf16 max:", torch.finfo(torch.bfloat16).max)

# %% [markdown]
# ## 1. A model with outlier features
#
# Large pretrained transformers (OPT, BLOOM, T5 trained in bf16) grow a few *outlier features*:
# channels of the residual stream whose activations reach 10⁵ or more. bf16 has fp32's range, so
# training never noticed; fp16 stops at 65504. Our small stand-in has one such channel, made by
# `block.fc_out`, and a LayerNorm after it that brings the values back to order one:

# %%
# NBVAL_CHECK_OUTPUT
class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc_in = nn.Linear(width, 2 * width)
        self.fc_out = nn.Linear(2 * width, width)
        self.norm = nn.LayerNorm(width)

    def forward(self, x):
        return self.norm(x + self.fc_out(torch.relu(self.fc_in(x))))


class OutlierNet(nn.Module):
    def __init__(self, vocab: int = 64, width: int = 32, classes: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.block = Block(width)
        self.head = nn.Linear(width, classes)
        with torch.no_grad():  # channel 3 becomes an outlier feature, as in pretrained LLMs
            self.block.fc_out.weight[3].mul_(4e5)

    def forward(self, ids):
        return self.head(self.block(self.embed(ids)).mean(dim=1))


model = OutlierNet()
ids = torch.randint(0, 64, (8, 16), generator=torch.Generator().manual_seed(1))
labels = torch.randint(0, 4, (8,), generator=torch.Generator().manual_seed(2))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
loss_fn = nn.functional.cross_entropy

with torch.no_grad():
    outlier = model.block.fc_out(torch.relu(model.block.fc_in(model.embed(ids))))
print(f"largest activation out of block.fc_out: {outlier.abs().max():.3g}")
with torch.autocast("cpu", dtype=torch.float16), torch.no_grad():
    print("16-mixed forward finite?", bool(torch.isfinite(model(ids)).all()))

# %% [markdown]
# ## 2. The doctor
#
# One call. `batch` is what the model takes, in the same forms the Workbench accepts: here
# `(inputs, targets)` with a `loss_fn`. We keep it quick with three modes and one timed step
# (`modes=None` runs every mode this machine has, including TF32 and FP8 emulated). The user's
# model and optimizer are not touched: every run works on a copy. The doctor works to a time
# budget, 15 plain training steps by default (section 5); on a model this small a step takes a
# millisecond, so we give it half a minute instead (`budget=30`, in seconds), which everything fits.

# %%
report = ampnb.doctor(model, (ids, labels), loss_fn, optimizer=optimizer,
                      modes=("32-true", "bf16-mixed", "16-mixed"), repeat=1, budget=30)
report

# %% [markdown]
# The report starts with its verdict, measured on the machine that ran this cell. Where a
# low-precision mode is faster here and stays within tolerance (bf16-mixed on a CPU or GPU with
# native bf16 units, say), that is the recommendation; where none is faster (a CPU without native
# bf16 units), it recommends 32-true and says so, then names the best low-precision choice for
# hardware that has the units. Its evidence is also data: `report.modes` (one row per mode) and
# `report.layers`.
# What broke in 16-mixed, and where?

# %%
# NBVAL_CHECK_OUTPUT
fp16 = report.mode("16-mixed")
print("16-mixed finite?     ", fp16.finite)
print("first inf made in:   ", fp16.nonfinite_module, f"({fp16.nonfinite_phase})")
bf16 = report.mode("bf16-mixed")
print("bf16-mixed finite?   ", bf16.finite)
print("bf16-mixed within tolerance?", bf16.loss_error <= report.tolerance.loss
      and bf16.grad_error <= report.tolerance.grad)

# %% [markdown]
# Per layer, **headroom** is how many binades (factors of 2) lie between a module's largest fp32
# output and the format's max: negative means it overflows. **End-to-end** error is the module's
# output in the mode against fp32, with everything before it also in the mode (how error grows
# through the network); **local** error runs the module *alone* in the mode on the fp32 inputs (is
# this layer itself sensitive?).

# %%
# NBVAL_CHECK_OUTPUT
for row in report.layers:
    if row.leaf:
        print(f"{row.module:14} {row.kind:10} headroom fp16 {row.headroom['fp16']:+6.1f}  "
              f"bf16 {row.headroom['bf16']:+6.1f} binades")

# %%
report.plot()

# %% [markdown]
# ## 3. Applying the recommendation: fp32 islands
#
# For each mode that failed, the doctor chose modules to keep in fp32 — starting from the op whose
# inf/NaN reached the loss or a gradient (for a run that stayed finite, from layers whose local
# error stands out) — **re-ran the step** with them kept, then dropped each one whose removal kept
# the step finite and within tolerance: what is left is the cause, not its bystanders. It reports
# before and after:

# %%
# NBVAL_CHECK_OUTPUT
fixed = [r for r in report.modes if r.keep_fp32]
for r in fixed:
    before = report.mode(r.name)
    print(f"{r.label}: finite {before.finite} -> {r.finite}")

# %% [markdown]
# `ampnb.keep_fp32(model, patterns)` does the same on your own model: matched modules run with
# autocast off and fp32 inputs. A few 16-mixed training steps, with and without it:

# %%
# NBVAL_CHECK_OUTPUT
import contextlib  # noqa: E402
import copy  # noqa: E402


def train(net, steps=3, keep=()):
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    losses = []
    with ampnb.keep_fp32(net, keep) if keep else contextlib.nullcontext():
        for _ in range(steps):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = loss_fn(net(ids), labels)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            losses.append(loss.item())
    return losses


plain = train(copy.deepcopy(model))
kept = train(copy.deepcopy(model), keep=("block.fc_out",))
print("16-mixed              losses finite:", all(map(torch.isfinite, torch.tensor(plain))))
print("16-mixed + fc_out fp32 losses finite:", all(map(torch.isfinite, torch.tensor(kept))))

# %% [markdown]
# The take-home code: plain `torch.amp` with the islands as `autocast(enabled=False)` regions,
# Lightning's `precision=` and Accelerate's `mixed_precision=`:

# %%
print(report.low_precision.code if report.low_precision else report.recommended.code)

# %% [markdown]
# ## 4. Why is bf16 (not) faster here?
#
# `ampnb.diagnosis.profile_step` (and `%%amp --profile` on a cell) runs one step per mode under
# `torch.profiler` and splits the op time by dtype, the share spent in casts, and the matmuls
# whose dimensions are not multiples of 8 (tensor cores want them). On a small model the casts
# and the unaligned shapes eat much of what bf16 could save; on a CPU without bf16 units the bf16
# kernels themselves are slow fallbacks.

# %%
why = ampnb.diagnosis.profile_step(model, (ids, labels), loss_fn, modes=("32-true", "bf16-mixed"))
why

# %% [markdown]
# ## 5. A bigger model: the budget and the memory
#
# On a real model every step costs, so the doctor works to a **budget**: by default 15 plain
# training steps of time (`budget=` also takes seconds, `"40 steps"`, or `math.inf`). It answers
# the question first: the **headline** runs every mode this machine runs natively or slowly as
# plain steps (errors from each mode's first step, speeds from steps timed round-robin). Those
# first steps come before anything else, each stopped only past what is left of the budget, and
# a timed step starts only where it fits at the pace seen so far; what was cut is listed. Then,
# as the budget allows: the emulated modes' accuracy, fp32 islands,
# the true modes with their multi-step check, per-layer errors, the fp64 check, profiles; what did
# not fit is listed. Costs are measured here (each mode's forward on a slice of the batch before
# its first step), never assumed. A true mode (`bf16-true`, `16-true`) is never recommended for
# training without its multi-step check: one step cannot show the updates that a bf16 weight
# loses at every step.
#
# It also works in little memory: your weights and optimizer state wait on disk, the modes that
# keep fp32 weights share one working copy, and each module's output is compared with the fp32 one
# as it streams past (figures kept, tensors dropped). Here a GPT of about ten million parameters (ampnb's demo,
# made wider and deeper); the kernel's peak memory (`ru_maxrss`) is read after a few plain training
# steps and again after the doctor.

# %%
import resource  # noqa: E402
import time  # noqa: E402

from ampnb.models import demo  # noqa: E402


def peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


big = demo("gpt", width=384, depth=6, n_head=6, seq_len=64, batch_size=8)
x, y = big.batches[0]
for _ in range(3):  # plain 32-true AdamW steps; the last one timed
    t0 = time.perf_counter()
    big.optimizer.zero_grad()
    big.loss_fn(big.model(x), y).backward()
    big.optimizer.step()
    plain = time.perf_counter() - t0
training_peak = peak_mib()

t0 = time.perf_counter()
big_report = ampnb.doctor(big.model, (x, y), big.loss_fn, optimizer=big.optimizer)
took = time.perf_counter() - t0
n = sum(p.numel() for p in big.model.parameters())
print(f"{n / 1e6:.1f}M parameters; a plain step {plain:.2f} s; the doctor {took:.1f} s "
      f"= {took / plain:.0f} plain steps")
print(f"kernel peak memory: {training_peak:.0f} MiB after training, {peak_mib():.0f} MiB after "
      f"the doctor")
print(big_report.budget)
print("recommended:", big_report.recommended.headline)
for line in big_report.left_out:
    print("did not fit:", line)

# %% [markdown]
# `make bench` measures the same on GPT-2 configs of 5M and 17M parameters, each in its own
# process against a process that only trains (see `benchmarks/RESULTS.md`).
#
# ## 6. Exercise: your own model
#
# Run the doctor on a model of your choice: one of ampnb's demos (`ampnb.models.demo("cnn")`), a
# `transformers` model built from a config (`GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64))`
# with `{"input_ids": ids, "labels": ids}` as the batch), or your own. Which mode does it
# recommend, which layer has the least fp16 headroom, and is any layer locally sensitive?

# %% jupyter={"source_hidden": true} tags=["solution"]
from ampnb.models import demo  # noqa: E402

d = demo("cnn")
mine = ampnb.doctor(d.model, d.batches[0], d.loss_fn, modes=("32-true", "bf16-mixed"),
                    repeat=1, profile=False, budget=30)  # room for the per-layer details
mine

# %% jupyter={"source_hidden": true} tags=["solution"]
# NBVAL_CHECK_OUTPUT
tight = min((r for r in mine.layers if r.leaf), key=lambda r: r.headroom["bf16"])
print("bf16-mixed finite:", mine.mode("bf16-mixed").finite)
print("least headroom:", tight.module, tight.kind)
