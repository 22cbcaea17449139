"""PrecisionMonitorCallback in a real Hugging Face Trainer on CPU (tiny GPT-2 from a config)."""

from __future__ import annotations

import contextlib
import math
import os

import pytest
import torch
from torch import nn

os.environ.setdefault("HF_HUB_OFFLINE", "1")
from transformers import (  # noqa: E402 - offline first
    GPT2Config,
    GPT2LMHeadModel,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)
from transformers.utils import logging as hf_logging  # noqa: E402

from ampnb.formats import get_format  # noqa: E402
from ampnb.integrations.transformers import PrecisionMonitorCallback  # noqa: E402
from ampnb.watchlog.table import records_table  # noqa: E402

K = 2       # the step whose forward overflows
STEPS = 5
PLANTED = "transformer.h.0.mlp.act"


class Spike(nn.Module):
    """Wraps a module; multiplies its output by `factor` on one training forward only."""

    def __init__(self, inner: nn.Module, at: int, factor: float) -> None:
        super().__init__()
        self.inner, self.at, self.factor, self.calls = inner, at, factor, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.inner(x)
        if self.training and torch.is_grad_enabled():
            self.calls += 1
            if self.calls - 1 == self.at:
                out = out * self.factor
        return out


class Tokens(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 4 * STEPS

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = torch.randint(0, 64, (16,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids}


class Fp16AutocastTrainer(Trainer):
    """fp16 autocast on CPU through the Trainer's own hook for it (Accelerate sets none there)."""

    def autocast_smart_context_manager(self, cache_enabled=True):
        return torch.autocast("cpu", dtype=torch.float16, cache_enabled=cache_enabled)


class Logged(TrainerCallback):
    """What a report_to integration receives: every on_log's dict."""

    def __init__(self) -> None:
        self.logs: list[dict] = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.logs.append(dict(logs))


def _model(plant: tuple[int, float] | None = None) -> GPT2LMHeadModel:
    torch.manual_seed(0)
    with _quiet():
        model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64,
                                           n_positions=32, bos_token_id=0, eos_token_id=0))
    if plant is not None:
        mlp = model.transformer.h[0].mlp
        mlp.act = Spike(mlp.act, *plant)
    return model


@contextlib.contextmanager
def _quiet():
    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)


def _trainer(model, tmp_path, cls=Trainer, logging_steps: int = 1, **kw) -> Trainer:
    args = TrainingArguments(output_dir=str(tmp_path), fp16=True, use_cpu=True, max_steps=STEPS,
                             per_device_train_batch_size=4, report_to=[], save_strategy="no",
                             logging_steps=logging_steps, disable_tqdm=True, seed=0,
                             dataloader_num_workers=0, **kw)
    return cls(model=model, args=args, train_dataset=Tokens())


def _train(trainer: Trainer) -> None:
    with _quiet():
        trainer.train()


def test_fp16_on_cpu_runs_with_no_scaler_and_no_autocast(tmp_path):
    """What this transformers/Accelerate does with fp16=True on CPU, checked, and said."""
    model = _model()
    seen: list[tuple[torch.dtype, bool]] = []
    model.lm_head.register_forward_hook(
        lambda m, a, out: seen.append((out.dtype, torch.is_autocast_enabled("cpu"))))
    trainer = _trainer(model, tmp_path)
    assert trainer.args.fp16 and trainer.accelerator.mixed_precision == "fp16"
    assert trainer.accelerator.scaler is None
    trainer.add_callback(monitor := PrecisionMonitorCallback(trainer))
    with pytest.warns(UserWarning, match="no fp16 autocast and no GradScaler"):
        _train(trainer)
    assert set(seen) == {(torch.float32, False)}  # the model ran in fp32
    assert len(monitor.records) == STEPS and all(r.scale is None for r in monitor.records)


def test_a_planted_overflow_under_fp16_autocast_shows_the_loss_the_module_and_no_scaler(
        tmp_path):
    # |GELU output| ~ 1: this factor overflows fp16, not fp32, so only fp16 autocast makes the inf
    factor = 4 * get_format("fp16").max
    model = _model(plant=(K, factor))
    trainer = _trainer(model, tmp_path, cls=Fp16AutocastTrainer)
    trainer.add_callback(monitor := PrecisionMonitorCallback(trainer))
    _train(trainer)
    assert trainer.accelerator.scaler is None
    records = monitor.records
    assert len(records) == STEPS
    bad = records[K]
    assert bad.nonfinite and not math.isfinite(bad.loss)
    assert bad.first_module == PLANTED and bad.first_phase == "forward"
    assert bad.scale is None and not bad.has_scaler and not bad.skipped
    assert all(r.nonfinite is False for r in records[:K])
    assert all(math.isfinite(r.loss) for r in records[:K])
    # no scaler skipped the step: the optimizer applied the inf/NaN gradients
    assert not all(torch.isfinite(p).all() for p in model.parameters())
    assert "no scaler" in repr(records_table(records))


@pytest.mark.parametrize("optim", ["adamw_torch", "adamw_torch_fused"])
def test_with_a_grad_scaler_as_accelerate_makes_on_cuda_the_skip_is_recorded(tmp_path, optim):
    # Accelerate makes no GradScaler on CPU; given one (as it makes for fp16 on CUDA), its
    # backward scales, clipping unscales and its optimizer steps through the scaler.
    model = _model(plant=(K, 4 * get_format("fp16").max))
    trainer = _trainer(model, tmp_path, cls=Fp16AutocastTrainer, optim=optim)
    trainer.accelerator.scaler = scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    kept: list[bool] = []        # the truth: the step left every weight as it was
    accelerate: list[bool] = []  # Accelerate's own word

    class Skips(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            self.before = [p.detach().clone() for p in model.parameters()]

        def on_step_end(self, args, state, control, **kwargs):
            kept.append(all(torch.equal(a, p) for a, p in zip(self.before, model.parameters())))
            accelerate.append(trainer.accelerator.optimizer_step_was_skipped)

    logged = Logged()
    trainer.add_callback(Skips())
    trainer.add_callback(logged)
    trainer.add_callback(monitor := PrecisionMonitorCallback(trainer))
    _train(trainer)
    records = monitor.records
    assert kept == [s == K for s in range(STEPS)]
    assert [r.skipped for r in records] == kept
    if optim == "adamw_torch":  # (a fused optimizer skips inside its own step, unseen by it)
        assert accelerate == kept
    assert records[K].first_module == PLANTED and records[K].first_phase == "forward"
    assert records[K + 1].scale == records[K].scale * scaler.get_backoff_factor()
    assert records[-1].scale == scaler.get_scale()  # nothing grew since (growth_interval 2000)
    assert [d["ampnb/scale"] for d in logged.logs if "ampnb/scale" in d] == \
        [r.scale for r in records]


def test_the_records_go_through_trainer_log_to_every_callback(tmp_path):
    model = _model()
    trainer = _trainer(model, tmp_path, cls=Fp16AutocastTrainer)
    logged = Logged()
    trainer.add_callback(logged)  # stands for report_to's integrations
    trainer.add_callback(monitor := PrecisionMonitorCallback(trainer))
    _train(trainer)
    ours = [d for d in logged.logs if "ampnb/nonfinite" in d]
    assert [d["ampnb/loss"] for d in ours] == [r.loss for r in monitor.records]
    assert [d["ampnb/skipped"] for d in ours] == [0.0] * STEPS
    assert all("ampnb/scale" not in d for d in ours)  # there is no scaler: no scale to log
    steps = [h["step"] for h in trainer.state.log_history if "ampnb/loss" in h]
    assert steps == list(range(1, STEPS + 1))  # the Trainer's own step numbers
    # the model's loss, as the Trainer itself logged it
    theirs = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert [r.loss for r in monitor.records] == pytest.approx(theirs, rel=1e-5)


def test_logging_follows_the_trainers_cadence_but_keeps_a_bad_step(tmp_path):
    model = _model(plant=(K, math.inf))
    trainer = _trainer(model, tmp_path, logging_steps=4)
    trainer.add_callback(monitor := PrecisionMonitorCallback(trainer))
    with pytest.warns(UserWarning):
        _train(trainer)
    records = monitor.records
    assert records[K].nonfinite and records[K].first_module == PLANTED
    assert not any(r.nonfinite for r in records[:K])
    steps = [h["step"] for h in trainer.state.log_history if "ampnb/nonfinite" in h]
    assert steps == [r.step + 1 for r in records if r.nonfinite or (r.step + 1) % 4 == 0]
    assert 1 not in steps and K + 1 in steps and 4 in steps


def test_weights_with_and_without_the_callback_are_bit_identical(tmp_path):
    plain, watched = _model(), _model()
    _train(_trainer(plain, tmp_path / "a", cls=Fp16AutocastTrainer))
    trainer = _trainer(watched, tmp_path / "b", cls=Fp16AutocastTrainer)
    trainer.add_callback(monitor := PrecisionMonitorCallback(trainer))
    _train(trainer)
    assert len(monitor.records) == STEPS
    for (name, a), b in zip(plain.state_dict().items(), watched.state_dict().values()):
        assert torch.equal(a, b), name
    assert all(not m._forward_hooks for m in watched.modules())  # closed at train's end


@pytest.mark.parametrize("accumulation, micro", [(2, [2, 2, 1, 2, 2]), (4, [4, 1, 4, 1, 4])])
def test_with_gradient_accumulation_the_loss_is_the_one_the_trainer_logs(tmp_path, accumulation,
                                                                          micro):
    trainer = _trainer(_model(), tmp_path, cls=Fp16AutocastTrainer,
                       gradient_accumulation_steps=accumulation)
    trainer.add_callback(monitor := PrecisionMonitorCallback(trainer))
    _train(trainer)
    # 5 batches an epoch: the Trainer steps after each `accumulation`, and at the epoch's end
    assert [r.micro_batches for r in monitor.records] == micro
    theirs = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert [r.loss for r in monitor.records] == pytest.approx(theirs, rel=1e-5)


def test_a_train_that_raises_leaves_no_hook_once_the_callback_closes(tmp_path):
    model = _model()

    def fail(module, args, out):
        if module.training and torch.is_grad_enabled() and len(monitor.records) == K:
            raise RuntimeError("user's bug")

    model.transformer.h[0].register_forward_hook(fail)
    trainer = _trainer(model, tmp_path, cls=Fp16AutocastTrainer)
    # the Trainer has no exception event for callbacks: `with` closes the watch
    with PrecisionMonitorCallback(trainer) as monitor, pytest.raises(RuntimeError, match="user"):
        trainer.add_callback(monitor)
        _train(trainer)
    assert len(monitor.records) == K
    assert all(list(m._forward_hooks.values()) in ([], [fail]) for m in model.modules())
    assert not trainer.optimizer.optimizer._optimizer_step_post_hooks


def test_bad_arguments_are_refused_in_one_line(tmp_path):
    with pytest.raises(ValueError, match="trainer=str is not allowed") as e:
        PrecisionMonitorCallback("trainer")
    assert "\n" not in str(e.value)
    trainer = _trainer(_model(), tmp_path)
    with pytest.raises(ValueError, match="every=0"):
        PrecisionMonitorCallback(trainer, every=0)
