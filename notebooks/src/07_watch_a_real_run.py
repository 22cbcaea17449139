# %% [markdown]
# # 07 · Watch a real training run
#
# The earlier notebooks ran steps that ampnb drove. Real runs live in a `Trainer`: when the fp16
# loss scale collapses there, or the loss turns into `nan`, the logs say little more than "the
# loss went `nan`". This notebook attaches ampnb's instruments to runs it does not drive:
#
# 1. a Lightning run in `16-mixed` whose loss scale will collapse, because one layer overflows
#    from a known step on,
# 2. the run watched live with `PrecisionMonitor`: scale, skipped steps, the module, headroom,
# 3. the first skipped step, kept on disk and replayed: the hunter names the op,
# 4. the doctor on that step, and the fp32 island it proposes,
# 5. the same run again with the island: clean,
# 6. the Hugging Face `Trainer` on a tiny GPT-2 built from a config: what `fp16=True` does on a
#    CPU, and what an overflow does when no GradScaler is there to skip the step,
# 7. exercise: `ampnb.watch` on a plain `torch.amp` loop of your own.
#
# Prerequisites: 03 (GradScaler), 05 (the doctor and `keep_fp32`). About 20 minutes. Everything
# runs on the CPU, with Lightning, transformers and accelerate installed.
#
# The watch only observes, through hooks: the run trains exactly as it would without it (ampnb's
# tests check that the weights come out bit-identical), and every hook is removed when the run
# ends.

# %%
# NBVAL_CHECK_OUTPUT
import logging
import math
import os
import tempfile
import warnings

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the GPT-2 below is built from a config, offline

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
from IPython.display import display  # noqa: E402
from lightning.pytorch.plugins import MixedPrecision  # noqa: E402
from torch import nn  # noqa: E402

import ampnb  # noqa: E402
from ampnb.integrations.lightning import PrecisionMonitor  # noqa: E402
from ampnb.watchlog.table import layers_table  # noqa: E402

fp16_max = ampnb.get_format("fp16").max
scratch = tempfile.TemporaryDirectory()  # logs and the kept step: nothing lands in notebooks/
print("fp16 max:", fp16_max)

# %% [markdown]
# ## 1. A run whose loss scale will collapse
#
# A small regressor: an input layer, one residual block with a LayerNorm, a head. Like the
# stand-in of notebook 05, its `block.fc_out` makes one *outlier feature*: one output channel
# far larger than the rest, as large pretrained transformers grow. fp32 and bf16 never notice;
# fp16 stops at 65504.
#
# The data are 16 batches. From batch `SHIFT` on, the loader serves a new shard whose features
# were not normalized: they are `RAW` times larger. The outlier channel grows with them:

# %%
# NBVAL_CHECK_OUTPUT
STEPS, SHIFT, RAW, BATCH = 16, 8, 50.0, 8


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc_in = nn.Linear(width, 2 * width)
        self.fc_out = nn.Linear(2 * width, width)
        self.norm = nn.LayerNorm(width)

    def forward(self, x):
        return self.norm(x + self.fc_out(torch.relu(self.fc_in(x))))


class Regressor(pl.LightningModule):
    def __init__(self, features: int = 16, width: int = 32) -> None:
        super().__init__()
        self.inp = nn.Linear(features, width)
        self.block = Block(width)
        self.head = nn.Linear(width, 1)
        with torch.no_grad():  # channel 3 becomes an outlier feature
            self.block.fc_out.weight[3].mul_(2e4)

    def forward(self, x):
        return self.head(self.block(self.inp(x)))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self(x).float(), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


g = torch.Generator().manual_seed(0)
x = torch.randn(BATCH * STEPS, 16, generator=g)
y = x[:, :4].sum(1, keepdim=True)
x[BATCH * SHIFT:] *= RAW  # the unnormalized shard
data = torch.utils.data.TensorDataset(x, y)


def fresh() -> Regressor:
    torch.manual_seed(0)
    return Regressor()


model = fresh()
with torch.no_grad():
    for k in (0, SHIFT):
        xb = x[BATCH * k:BATCH * (k + 1)]
        out = model.block.fc_out(torch.relu(model.block.fc_in(model.inp(xb))))
        amax = out.abs().max().item()
        print(f"batch {k:2}: largest fp32 output of block.fc_out {amax:.2g}, "
              f"{amax / fp16_max:.2g}x fp16's max")

# %% [markdown]
# The Trainer is Lightning's own, in `16-mixed`. On a CPU, Lightning turns
# `precision="16-mixed"` into bf16; real fp16 with a GradScaler takes the plugin, given
# explicitly. The scaler starts at 2^10 rather than torch's 2^16, so that the first steps are not
# spent finding a scale that fits the gradients (ampnb keeps only the *first* skipped step, and
# that should be the one we are after):

# %%
logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)  # no "GPU available" lines


def fit(net: pl.LightningModule, callbacks: list) -> pl.Trainer:
    pl.seed_everything(0, verbose=False)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    trainer = pl.Trainer(max_steps=STEPS, accelerator="cpu", deterministic=True,
                         plugins=[MixedPrecision("16-mixed", "cpu", scaler)],
                         callbacks=callbacks, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         default_root_dir=scratch.name)
    loader = torch.utils.data.DataLoader(data, batch_size=BATCH)  # in order: SHIFT is known
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Lightning's notes on dataloader workers
        trainer.fit(net, loader)
    return trainer

# %% [markdown]
# ## 2. Watching it live
#
# `PrecisionMonitor` is a Lightning `Callback`. It finds the precision plugin's GradScaler and
# records every optimizer step: the loss, the scale, whether the step was skipped, the first
# module whose output or gradient went non-finite, and per layer the largest activation,
# activation gradient and parameter gradient (unscaled) with their headroom to fp16, bf16 and
# FP8. Its scalars also go to the Trainer's loggers (TensorBoard, CSV, W&B) as `ampnb/*`.
# `keep_overflow=` saves the first skipped step: its batch, the RNG states, the model and
# optimizer as they were before it.
#
# The panel below is the watch's own view, and it redraws while `fit` runs (the small callback
# shows it as soon as the monitor has attached). Afterwards it stays: switch its plot to
# "headroom" and pick a format.

# %%
class ShowPanel(pl.Callback):
    """Display the monitor's live panel when training starts (after the monitor attached)."""

    def __init__(self, monitor: PrecisionMonitor) -> None:
        self.monitor = monitor

    def on_train_start(self, trainer, pl_module):
        display(self.monitor.watch.panel())


monitor = PrecisionMonitor(keep_overflow=os.path.join(scratch.name, "kept"))
trainer = fit(model, [monitor, ShowPanel(monitor)])
monitor.watch.table()

# %% [markdown]
# What the records say, step by step (the loss is left out here, as its last digits may depend
# on the CPU's fp16 kernels; the table above has it):

# %%
# NBVAL_CHECK_OUTPUT
records = monitor.records
for r in records:
    where = f"first non-finite: {r.first_module} ({r.first_phase})" if r.nonfinite else ""
    print(f"step {r.step:2}  scale 2^{int(math.log2(r.scale)):<3} "
          f"{'skipped' if r.skipped else 'stepped'}  {where}".rstrip())
end = trainer.precision_plugin.scaler.get_scale()
print("skipped:", sum(r.skipped for r in records), "of", len(records), "steps; the scaler's scale",
      f"at the end: 2^{int(math.log2(end))}")

# %% [markdown]
# From step `SHIFT` on, every step overflows in the *forward* pass, in `block.fc_out`: every
# step is skipped, and every skip halves the scale. A GradScaler cannot help here — the scale
# multiplies the loss after the forward, so no scale makes the forward finite — and the run stops
# learning while the scale sinks towards zero. The plot:

# %%
monitor.watch.plot().figure

# %% [markdown]
# Was it visible before it broke? The per-layer statistics of the last clean step: headroom is
# the number of binades (factors of 2) between a layer's largest value and the format's max.
# `block.fc_out` ran with far less fp16 headroom than every other layer:

# %%
layers_table(records, step=SHIFT - 1)

# %%
# NBVAL_CHECK_OUTPUT
for la in layers_table(records, step=SHIFT - 1).layers:
    print(f"{la.module:13} fp16 headroom of its activations: {la.headroom('act', 'fp16'):5.1f}")

# %% [markdown]
# ## 3. The skipped step, replayed
#
# `ampnb.diagnosis.replay(path, model=fresh())` loads the step the monitor kept into a fresh
# instance of the model: its state as it was before that step, its batch, the RNG states, the
# autocast that was on and the scale. The file is data only (it loads with
# `torch.load(weights_only=True)`, so a file from someone else runs no code); only for a file you
# trust does `trust_pickled_model=True` unpickle the model it also holds. The replay reruns the
# forward and backward under ampnb's non-finite hunter, which names the first op that made an
# inf or NaN out of finite inputs:

# %%
replay = ampnb.diagnosis.replay(monitor.watch.overflow_file, model=fresh())
replay

# %%
# NBVAL_CHECK_OUTPUT
found = replay.nonfinite
print("replayed step:", replay.step, "| scale:", replay.scale)
print("its batch is the data's batch", SHIFT, ":",
      torch.equal(replay.batches[0].args[0], x[BATCH * SHIFT:BATCH * (SHIFT + 1)]))
print("first non-finite op:", found.op, "in", found.module, f"({found.phase})")

# %% [markdown]
# ## 4. The doctor on that step
#
# The replay hands over the model as it was before the step (`replay.model`). The doctor runs one
# step of it in each mode on the step's batch and, for a mode that fails, proposes modules to keep
# in fp32 and re-runs the step with them (`replay.report` runs the doctor with every mode; here
# two modes keep it quick, and half a minute of budget, `budget=30`, in place of the default 15
# plain steps, which on a model this small would be its floor of a second):

# %%
xk, yk = x[BATCH * SHIFT:BATCH * (SHIFT + 1)], y[BATCH * SHIFT:BATCH * (SHIFT + 1)]
report = ampnb.doctor(replay.model, (xk, yk), nn.functional.mse_loss,
                      modes=("32-true", "16-mixed"), repeat=1, profile=False, budget=30)
report

# %%
# NBVAL_CHECK_OUTPUT
broken = report.mode("16-mixed")
print("16-mixed finite?", broken.finite, "| first inf in:", broken.nonfinite_module,
      f"({broken.nonfinite_phase})")
island = next(r for r in report.modes if r.name == "16-mixed" and r.keep_fp32)
print("islands:", island.keep_fp32, "| finite with them?", island.finite)

# %% [markdown]
# ## 5. The run again, with the island
#
# `ampnb.keep_fp32(model, patterns)` runs the matched modules with autocast off and fp32
# inputs; everything else stays in fp16. Same model, same data, same seed, same Trainer:

# %%
model_kept = fresh()
monitor_kept = PrecisionMonitor()
with ampnb.keep_fp32(model_kept, island.keep_fp32):
    trainer_kept = fit(model_kept, [monitor_kept])
monitor_kept.watch.table()

# %%
# NBVAL_CHECK_OUTPUT
clean = monitor_kept.records
print("steps:", len(clean), "| skipped:", sum(r.skipped for r in clean),
      "| non-finite:", sum(r.nonfinite for r in clean))
end = trainer_kept.precision_plugin.scaler.get_scale()
print(f"scale at the start: 2^{int(math.log2(clean[0].scale))}, at the end: 2^{int(math.log2(end))}")
print("weights finite:", all(bool(torch.isfinite(p).all()) for p in model_kept.parameters()))
fc_out = {la.module: la for la in clean[-1].layers}["block.fc_out"]
print("block.fc_out's fp16 headroom at the last step:", f"{fc_out.headroom('act', 'fp16'):.1f}",
      "(negative: past fp16's max, held in fp32)")

# %%
monitor_kept.watch.plot().figure

# %% [markdown]
# The island is a workaround: the real fix is upstream, in the data (normalize the new shard) or
# in the model. But the run now tells you where to look, at the step where it happened.
#
# ## 6. The Hugging Face Trainer
#
# `PrecisionMonitorCallback(trainer)` is the same watch as a `TrainerCallback` (a callback is not
# handed its Trainer, so it takes it at construction). The model: a one-layer GPT-2 built from a
# config, random weights, nothing downloaded. First, what `fp16=True` does on this CPU — measured,
# with a hook that notes the dtype of an MLP output and whether autocast was on:

# %%
from transformers import (  # noqa: E402
    GPT2Config,
    GPT2LMHeadModel,
    PrinterCallback,
    Trainer,
    TrainingArguments,
)
from transformers.utils import logging as hf_logging  # noqa: E402

from ampnb.integrations.transformers import PrecisionMonitorCallback  # noqa: E402

hf_logging.set_verbosity_error()
HF_STEPS, HF_K = 8, 4


class Tokens(torch.utils.data.Dataset):
    def __len__(self):
        return 4 * HF_STEPS

    def __getitem__(self, i):
        ids = torch.randint(0, 64, (16,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids}


def gpt2() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64,
                                      n_positions=32, bos_token_id=0, eos_token_id=0))


def hf_trainer(net, cls=Trainer) -> Trainer:
    args = TrainingArguments(output_dir=os.path.join(scratch.name, "hf"), fp16=True, use_cpu=True,
                             max_steps=HF_STEPS, per_device_train_batch_size=4, seed=0,
                             report_to="none", save_strategy="no", logging_steps=1,
                             disable_tqdm=True, dataloader_num_workers=0)
    trainer = cls(model=net, args=args, train_dataset=Tokens())
    trainer.remove_callback(PrinterCallback)  # the Trainer's own printout of every log
    return trainer

# %%
gpt = gpt2()
seen = set()
gpt.transformer.h[0].mlp.c_fc.register_forward_hook(
    lambda m, a, out: seen.add((out.dtype, torch.is_autocast_enabled("cpu"))))
trainer = hf_trainer(gpt)
trainer.add_callback(hf_monitor := PrecisionMonitorCallback(trainer))
with warnings.catch_warnings(record=True) as said:
    warnings.simplefilter("always")
    trainer.train()
print("(dtype, autocast on) seen in the MLP:", sorted(seen, key=str))
print("the monitor said:", *{str(w.message) for w in said if "Accelerate" in str(w.message)})
hf_monitor.watch.table()

# %%
# NBVAL_CHECK_OUTPUT
print("fp16=True; Accelerate's mixed precision:", trainer.accelerator.mixed_precision)
print("GradScaler:", trainer.accelerator.scaler)

# %% [markdown]
# `fp16=True` on a CPU gets no GradScaler from Accelerate. Whether it gets fp16 autocast depends
# on the transformers and Accelerate versions: with the ones this notebook was written with
# (transformers 5.24, accelerate 1.15) it gets none either, so the model trains in fp32, and the
# monitor warns; the dtype line printed above shows what yours do. On a CUDA GPU, Accelerate
# makes fp16 autocast *and* a GradScaler (not run in this CPU notebook); the last cell of this
# section hands the Trainer such a scaler by hand, to show what the monitor records then.
#
# To see fp16 on the CPU we enter fp16 autocast through the Trainer's own hook for it,
# `autocast_smart_context_manager`; Accelerate still makes no GradScaler. And we plant an
# overflow at a known step: `Spike` multiplies the MLP's activation past fp16's max on training
# forward number `HF_K` only (a stand-in for an activation outlier):

# %%
class Fp16AutocastTrainer(Trainer):
    """fp16 autocast on the CPU through the Trainer's own hook (Accelerate enters none here)."""

    def autocast_smart_context_manager(self, cache_enabled=True):
        return torch.autocast("cpu", dtype=torch.float16, cache_enabled=cache_enabled)


class Spike(nn.Module):
    """Wraps a module; multiplies its output past fp16's max on one training forward only."""

    def __init__(self, inner: nn.Module, at: int) -> None:
        super().__init__()
        self.inner, self.at, self.calls = inner, at, 0

    def forward(self, h):
        out = self.inner(h)
        if self.training and torch.is_grad_enabled():
            self.calls += 1
            if self.calls - 1 == self.at:
                out = out * (4 * fp16_max)
        return out


gpt = gpt2()
mlp = gpt.transformer.h[0].mlp
mlp.act = Spike(mlp.act, HF_K)
trainer = hf_trainer(gpt, Fp16AutocastTrainer)
trainer.add_callback(hf_monitor := PrecisionMonitorCallback(trainer))
trainer.train()
hf_monitor.watch.table()

# %%
# NBVAL_CHECK_OUTPUT
print("GradScaler:", trainer.accelerator.scaler)
for r in hf_monitor.records:
    state = f"non-finite, first in {r.first_module} ({r.first_phase})" if r.nonfinite else "finite"
    print(f"step {r.step}  loss {'nan' if math.isnan(r.loss) else 'finite'}  {state}")
print("weights finite after training:",
      all(bool(torch.isfinite(p).all()) for p in gpt.parameters()))

# %% [markdown]
# With no GradScaler, nothing skips the bad step: its NaN gradients go into AdamW, the weights
# become NaN, and every later step is NaN too. The monitor names where it started (step `HF_K`,
# the planted module, forward); the table's note says that no scaler was there to skip it.
#
# Give the Trainer a GradScaler, as Accelerate makes one for fp16 on a GPU, and the same overflow
# costs one skipped step and half the scale:

# %%
# NBVAL_CHECK_OUTPUT
gpt = gpt2()
mlp = gpt.transformer.h[0].mlp
mlp.act = Spike(mlp.act, HF_K)
trainer = hf_trainer(gpt, Fp16AutocastTrainer)
trainer.accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
trainer.add_callback(hf_monitor := PrecisionMonitorCallback(trainer))
trainer.train()
print("skipped steps:", [r.step for r in hf_monitor.records if r.skipped],
      "| named:", {r.first_module for r in hf_monitor.records if r.skipped})
print("scale before and after the skip:", hf_monitor.records[HF_K].scale,
      hf_monitor.records[HF_K + 1].scale)
print("weights finite after training:",
      all(bool(torch.isfinite(p).all()) for p in gpt.parameters()))

# %% [markdown]
# ## 7. Exercise: a plain loop of your own
#
# `ampnb.watch(model, optimizer, scaler)` is what both callbacks use, and it attaches to any
# loop: a step ends at `scaler.update()`. Write the plain `torch.amp` loop (nanoGPT's order:
# autocast forward and loss, `scaler.scale(loss).backward()`, `scaler.step`, `scaler.update`,
# `zero_grad`) over the same 16 batches with a fresh `Regressor`, inside
# `with ampnb.watch(model, opt, scaler, every=4) as w:`. Which step is skipped first, and which
# module does the watch name? Then start the scaler at torch's default 2^16: what do the first
# steps show, and why?

# %% jupyter={"source_hidden": true} tags=["solution"]
def plain_run(init_scale: float) -> ampnb.watcher.Watch:
    net = fresh()
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale)
    with ampnb.watch(net, opt, scaler, every=4) as w:
        for xb, yb in torch.utils.data.DataLoader(data, batch_size=BATCH):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = nn.functional.mse_loss(net(xb).float(), yb)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)
    return w


w = plain_run(2.0**10)
w16 = plain_run(2.0**16)
display(w.table(), w16.table())

# %% jupyter={"source_hidden": true} tags=["solution"]
# NBVAL_CHECK_OUTPUT
first = next(r for r in w.records if r.skipped)
print("first skipped step:", first.step, "| named:", first.first_module, f"({first.first_phase})")
early = [r for r in w16.records[:SHIFT] if r.skipped]
print("at 2^16, steps skipped before the shard?", bool(early), "| named on statistics steps:",
      sorted({f"{r.first_module} ({r.first_phase})" for r in early if r.first_module}))
# At 2^16 the scaled gradients overflow in backward: the scaler backs off until they fit, then
# runs clean until the shard's forward overflow. A skip on a statistics step (every=4) names the
# layer whose backward overflowed first (the head, where backward starts); a skip between them
# is counted, not named: the watch does no per-module work there.
