# %% [markdown]
# # 03 · GradScaler and gradient accumulation, step by step
#
# In `16-mixed` training the forward and backward passes compute in fp16 under autocast. fp16 has
# only 5 exponent bits, so small gradients **underflow** to zero, and large ones overflow to `inf`.
# `torch.amp.GradScaler` deals with both:
#
# * it multiplies the loss by a large **scale** before `backward()`, so the gradients come out
#   scaled up, away from the underflow region;
# * it divides them by the same scale again (`unscale_`) before the optimizer sees them;
# * if any gradient came out `inf`/`NaN`, it **skips** the optimizer step and cuts the scale
#   (× `backoff_factor`);
# * after `growth_interval` clean steps in a row, it **grows** the scale (× `growth_factor`).
#
# This notebook walks that loop one stage at a time with `ampnb.ScalerStepper`. The stepper drives
# a real `torch.amp.GradScaler` and only *records* what it sees: nothing is re-implemented.

# %%

import torch

import ampnb
from ampnb.models import demo
from ampnb.plots import plot_scale_history, plot_step_gradients
from ampnb.scaler import ScalerStepper, diagnose, explain, explain_error

fp16 = ampnb.get_format("fp16")
print(f"fp16: largest {fp16.max:g}, smallest normal {fp16.smallest_normal:.4g}, "
      f"smallest subnormal {fp16.smallest_subnormal:.4g}")

# %% [markdown]
# ## Why scale at all?
#
# A gradient smaller than fp16's smallest subnormal becomes exactly 0 when it is stored in fp16.
# Multiplied by a scale of 2^16 first, the same value is representable, and dividing by the
# scale later (in fp32) gives it back. Too much scale overflows instead:

# %%
# NBVAL_CHECK_OUTPUT
scale = 2.0**16
tiny = torch.tensor(fp16.smallest_subnormal / 4)      # a small, perfectly ordinary fp32 gradient
print("tiny gradient in fp16:           ", tiny.half().item())
print("scaled, in fp16, then unscaled:  ", ((tiny * scale).half().float() / scale).item(),
      "== original:", ((tiny * scale).half().float() / scale).item() == tiny.item())
print("a gradient of 2 scaled, in fp16: ", (torch.tensor(2.0) * scale).half().item())


# %% [markdown]
# ## The model
#
# We train the demo MLP from `ampnb.models` (spirals classification). Most CPUs have no fp16
# arithmetic units, and torch's own fp16 kernels there are a slow fallback; so on such a CPU ampnb
# runs the matrix products of `16-mixed` as fp32 kernels on the fp16 inputs, rounded to fp16 once
# — what a GPU's tensor cores compute (notebook 02, section 6). The support table says which runs
# here, with the native kernels' slowdown measured on this machine:

# %%
print(ampnb.support("16-mixed", "cpu").text)

# %% [markdown]
# The numerics the GradScaler deals with — fp16's range and rounding — are the same either way.
# On a GPU the same code runs with `device="cuda"`. `setup()` builds the same model, optimizer,
# loss and batches every time it is called with the same seed.

# %%
def setup(seed=0):
    return demo("mlp", seed=seed, width=16, batch_size=32)

stepper = ScalerStepper(*setup(), mode="16-mixed", accumulation_steps=2, clip_norm=1.0)
stepper

# %% [markdown]
# ## The loop, one stage at a time
#
# This is the order of nanoGPT's `train.py` and of the PyTorch AMP recipe. The stepper shows the
# code it runs; with `accumulation_steps=2` the first lines repeat once per micro-step, and the
# gradients of both micro-steps add up before the optimizer step.

# %%
# NBVAL_CHECK_OUTPUT
for stage, line in stepper.listing():
    print(f"{stage or '':>10} | {line}")

# %% [markdown]
# `next_stage()` runs exactly one stage and returns its record. Watch the loss: it is divided by
# `accumulation_steps` (so the summed gradients are a mean), then multiplied by the scale in
# `scaler.scale(loss)`, so the gradients come out scale times too large, on purpose.

# %%
for _ in range(3):
    print(stepper.next_stage())

# %%
# NBVAL_CHECK_OUTPUT
# The same three stages again for the second micro-step.
records = [stepper.next_stage() for _ in range(3)]
print([r.stage for r in records], [r.micro_step for r in records])

# %% [markdown]
# Now the once-per-step stages. `unscale_` divides the gradients by the scale and checks them for
# `inf`/`NaN` (`found_inf`); only then may we clip, because clipping must see the *true* gradient
# norm. `step` is skipped when `found_inf` is set; `update` adjusts the scale; `zero_grad` clears
# the gradients for the next step.

# %%
for _ in range(5):
    print(stepper.next_stage())

# %%
# NBVAL_CHECK_OUTPUT
r = stepper.history[-1]
print("scale used:", r.scale, "| new scale:", r.new_scale, "| growth tracker:", r.growth_tracker,
      "| found_inf:", r.found_inf, "| skipped:", r.skipped, "| micro-step losses:", len(r.losses))

# %% [markdown]
# The scale is a power of two, so scaling and unscaling only change the exponent of each
# gradient: the scaled and unscaled gradient norms differ by exactly the scale.

# %%
ratio = r.grad_norm_scaled / r.grad_norm_unscaled
print(f"scaled |g| = {r.grad_norm_scaled:.6g}, unscaled |g| = {r.grad_norm_unscaled:.6g}, "
      f"ratio = {ratio:g}")
assert ratio == r.scale

# %% [markdown]
# ## Unscale before you clip
#
# A classic mistake is to clip the gradients while they are still scaled. torch cannot notice, so
# it says nothing. `explain` reproduces the mistake on a tiny model and measures what it does:

# %%
explain("clip_scaled")

# %% [markdown]
# ## An overflow and its backoff
#
# `inject("inf")` makes the next micro-step's gradients `inf`. The scaler finds them in
# `unscale_`, `scaler.step` skips `optimizer.step()`, and `update` multiplies the scale by
# `backoff_factor`. The parameters (and Adam's moment estimates) are left **bit for bit** as they
# were.

# %%
# NBVAL_CHECK_OUTPUT
before = [p.detach().clone() for p in stepper.model.parameters()]
stepper.inject("inf")
r = stepper.step()
same = all(torch.equal(a, p) for a, p in zip(before, stepper.model.parameters()))
print("found_inf:", r.found_inf, "| skipped:", r.skipped, "| scale:", r.scale, "->", r.new_scale,
      "| parameters unchanged:", same)
assert same and r.new_scale == r.scale * stepper.settings.backoff_factor

# %% [markdown]
# One bad layer is enough: `layer=` picks one of `stepper.layers`, and the whole step is still
# skipped, because a step that updated only the healthy layers would leave the model inconsistent.

# %%
# NBVAL_CHECK_OUTPUT
print(stepper.layers)
stepper.inject("nan", layer="head")
r = stepper.step()
print("injected:", r.injected, "| skipped:", r.skipped, "| scale:", r.scale, "->", r.new_scale)

# %% [markdown]
# Overflows also happen on their own. Here batch 2 gets inputs 10^5 times larger: they are beyond
# fp16's largest value, so the fp16 forward pass overflows, the loss is not finite, and the step
# is skipped the same way.

# %%
# NBVAL_CHECK_OUTPUT
model, optimizer, loss_fn, batches = setup()
x, y = batches[2]
batches = [*batches[:2], (x * 1e5, y), *batches[3:]]
natural = ScalerStepper(model, optimizer, loss_fn, batches, mode="16-mixed")
for r in natural.run(4):
    finite = torch.isfinite(torch.tensor(r.loss)).item()
    print(f"step {r.step}: loss {'finite' if finite else 'inf/nan'}, skipped {r.skipped}, "
          f"scale {r.scale:g} -> {r.new_scale:g}")

# %% [markdown]
# ## Growth after `growth_interval` clean steps
#
# The default `growth_interval` is 2000 steps; to see growth here we set it to 3. The growth
# tracker counts clean steps; when it reaches 3, the scale grows and the tracker starts again from
# 0. An overflow also resets the tracker.

# %%
# NBVAL_CHECK_OUTPUT
grow = ScalerStepper(*setup(), init_scale=2.0**8, growth_interval=3)
grow.run(5)
grow.inject("nan")
grow.run(6)
for r in grow.history:
    print(f"step {r.step:2d}  scale {r.scale:6g} -> {r.new_scale:6g}  tracker {r.growth_tracker}"
          f"  skipped {r.skipped}")

# %% [markdown]
# The sawtooth: the scale (blue, log axis) climbs by `growth_factor` every `growth_interval`
# clean steps (the grey tracker reaching the dashed line) and drops on a skipped step (red cross).

# %%
plot_scale_history(grow).figure

# %%
grow.table()

# %% [markdown]
# ## Gradients before and after scaling, against fp16's range
#
# `plot_step_gradients` takes the last step's true gradients (after `unscale_`) and draws them
# in grey, and the same gradients times the loss scale that step used in orange, as a histogram
# of log2|g| against fp16's range (the shaded band; hatched: subnormals). The texts in the
# corner count how many values would overflow, underflow to zero or land among the imprecise
# subnormals if they were stored in fp16. A power-of-two scale moves every value by exactly
# log2(scale) binades, which is why unscaling gives back the true gradients bit for bit.

# %%
plot_step_gradients(grow).figure

# %% [markdown]
# ## The classic mistakes, in torch's words and in plain words
#
# Each case runs the mistake for real on a tiny model, keeps torch's own message (if torch says
# anything), and explains it with figures measured on the spot.

# %%
# NBVAL_CHECK_OUTPUT
for case in ["unscale_twice", "update_without_step", "scheduler_before_step", "scale_collapse"]:
    print(explain(case), end="\n\n")

# %% [markdown]
# When your own loop raises, `explain_error` recognises torch's message. Here we call `unscale_`
# twice on purpose:

# %%
# NBVAL_CHECK_OUTPUT
model, optimizer, loss_fn, batches = setup()
scaler = torch.amp.GradScaler("cpu")
x, y = batches[0]
with torch.autocast("cpu", dtype=torch.float16):
    loss = loss_fn(model(x), y)
scaler.scale(loss).backward()
scaler.unscale_(optimizer)
try:
    scaler.unscale_(optimizer)  # the mistake
except RuntimeError as err:
    print(explain_error(err))

# %% [markdown]
# ## bf16-mixed and 16-true
#
# bf16 has fp32's exponent range, so its gradients do not underflow and no scaler is needed: the
# stepper runs with `GradScaler(enabled=False)`, and `diagnose` says why. In `16-true` the
# parameters themselves are fp16, and torch refuses to unscale fp16 gradients; the answer is fp32
# *master weights*, which is what `16-mixed` gives you.

# %%
# NBVAL_CHECK_OUTPUT
bf16 = ScalerStepper(*setup(), mode="bf16-mixed")
bf16.run(2)
print("scaler enabled:", bf16.enabled, "| scale:", bf16.scale)
for g in diagnose(bf16):
    print(g)

# %%
# NBVAL_CHECK_OUTPUT
print(explain("fp16_grads"))

# %% [markdown]
# `ScalerStepper(mode="16-true")` converts your model to fp16 **in place**, as Lightning does:
# the fp32 weights you started from are gone, so build a fresh model (here: `setup()`) when you
# want to compare modes.

# %% [markdown]
# ## Before native AMP: APEX O2 and its master weights
#
# Lightning 1.x offered a second road to fp16: `Trainer(gpus=1, precision=16, amp_backend="apex",
# amp_level="O2")`. NVIDIA APEX's O2 kept the *model* in fp16 (batch norm excepted) and gave the
# *optimizer* fp32 copies of the weights, the master weights: after backward the fp16 gradients
# were copied to fp32 and unscaled, the optimizer stepped the masters, and the masters were rounded
# back into the fp16 model. APEX is gone from Lightning 2.0; ampnb keeps its levels runnable as
# legacy modes `apex-O0` ... `apex-O3`, emulated with native torch (`get_mode`, `%%amp`, the
# Workbench), and reads the old spellings:

# %%
# NBVAL_CHECK_OUTPUT
old = ampnb.explain_precision(gpus=1, precision=16, amp_backend="apex", amp_level="O2")
print(old.call, "\n  today:", old.today, "\n  ampnb runs it as:", old.mode)
print(ampnb.get_mode(old.mode).table())

# %% [markdown]
# Why keep a second, fp32 copy at all? Adding an update smaller than half an fp16 *ulp* (the gap
# to the next fp16 number) to an fp16 weight rounds straight back to the same weight. Below, one
# weight gets eight SGD updates of a quarter ulp each: in pure fp16 (`apex-O3`) every one of them
# is lost; O2's fp32 master keeps them all, and its fp16 copy moves once they add up.

# %%
# NBVAL_CHECK_OUTPUT
from ampnb.apex import lost_update

print(lost_update(weight=1.5, steps=8))

# %% [markdown]
# Native AMP (`16-mixed`) replaced all of this: the weights themselves stay fp32 (they *are* the
# masters) and autocast casts them to fp16 op by op, so there is no second copy to keep in step
# and no copy-back; `GradScaler` does the dynamic loss scaling APEX did (same defaults: 2^16, ×2
# after 2000 clean steps, ×0.5 on overflow). The last row above is that road.

# %% [markdown]
# ## Checkpoints
#
# `state_dict()` captures the model, the optimizer, the scaler (scale and growth tracker) and the
# stepper's position in the batches; a fresh stepper that loads it continues exactly where the
# first one was.

# %%
# NBVAL_CHECK_OUTPUT
saved = grow.state_dict()
model, optimizer, loss_fn, _ = setup(seed=1)   # other weights: all comes from `saved`...
resumed = ScalerStepper(model, optimizer, loss_fn, grow.batches)  # ...but the data is ours
resumed.load_state_dict(saved)
a, b = grow.run(3), resumed.run(3)
print("same scales:", [r.new_scale for r in a] == [r.new_scale for r in b])
print("same parameters:", all(torch.equal(p, q) for p, q in
                              zip(grow.model.parameters(), resumed.model.parameters())))

# %% [markdown]
# ## The panel
#
# Click **Next stage** to walk the loop (the highlighted line runs next), **Inject inf** or
# **Inject NaN** to break the next micro-step, **Run N** to watch the sawtooth, and change the
# controls to rebuild the loop from its initial state. The status beside the code shows the
# scale, the growth tracker, `found_inf` and whether the last step was skipped. The **plot**
# buttons switch between the scale history and the last step's gradients against fp16's range.

# %%
from ampnb.panels import ScalerPanel

ScalerPanel(ScalerStepper(*setup(), init_scale=2.0**10, growth_interval=4), run_n=12)

# %% [markdown]
# ## Exercise 1: counting stages and batches
#
# Take `accumulation_steps=3` with `setup()`'s 8 batches. Predict (a) how many stages one
# optimizer step has, (b) how many batches the stepper has read after 4 optimizer steps, and
# (c) which batch the next forward pass will use. Check with `next_stage()`, `run()` and
# `batch_index`.

# %%
# your code here

# %% [markdown]
# ### Solution
#
# Each micro-step has 3 stages (forward, divide, backward) and each optimizer step adds 5 more
# (unscale, clip, step, update, zero_grad): 3·3 + 5 = 14. Every micro-step reads one batch, so
# 4 steps read 12 batches; the batches are cycled, so the next forward uses batch 12 mod 8 = 4.

# %% jupyter={"source_hidden": true} tags=["solution"]
# NBVAL_CHECK_OUTPUT
acc = ScalerStepper(*setup(), accumulation_steps=3)
records = [acc.next_stage() for _ in range(14)]
print("stages in one step:", len(records), "| optimizer steps done:", len(acc.history))
acc.run(3)
print("batches read:", acc.batch_index, "| next batch:", acc.batch_index % len(acc.batches))

# %% [markdown]
# ## Exercise 2: a scale far too large
#
# Start with a scale far too large for fp16, `init_scale=2.0**30`, and the default
# `backoff_factor` of 0.5. Predict: how many of the first steps are skipped before training really
# starts, and what is the scale then? Run 20 steps and check. (Hint: what does each skip do to the
# scale?)

# %%
# your code here

# %% [markdown]
# ### Solution
#
# Every skipped step halves the scale, so the skipping stops at the first scale at which the
# scaled gradients fit in fp16. The gradients change as the model trains, so a later step can
# overflow again and cost one more halving: that is the scaler doing its job, not a failure. With
# no growth in 20 steps (growth needs 2000 clean steps in a row), the final scale is exactly
# 2^30 / 2^(number of skipped steps).

# %% jupyter={"source_hidden": true} tags=["solution"]
ex = ScalerStepper(*setup(), init_scale=2.0**30)
history = ex.run(20)
skipped = [r.step for r in history if r.skipped]
print("skipped steps:", skipped)
print(f"scale now {ex.scale:g} = 2^30 / 2^{len(skipped)}: {ex.scale == 2.0**30 / 2**len(skipped)}")
plot_scale_history(ex).figure
