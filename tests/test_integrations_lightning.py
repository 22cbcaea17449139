"""PrecisionMonitor in a real Lightning Trainer: the planted overflow, the logger, fused optimizers."""

from __future__ import annotations

import csv
import importlib
import math
import subprocess
import sys
import warnings
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.fabric.plugins.precision.amp import _optimizer_handles_unscaling
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.plugins import MixedPrecision
from torch import nn
from watch_models import Spike

from ampnb.formats import get_format
from ampnb.integrations import lightning as integration
from ampnb.integrations.lightning import PrecisionMonitor
from ampnb.watchlog import read_log

K = 3       # the step whose forward overflows
STEPS = 6


class Net(pl.LightningModule):
    def __init__(self, at: int | None = None, fused: bool = False) -> None:
        super().__init__()
        self.inp, self.boom, self.out = nn.Linear(8, 16), Spike(at), nn.Linear(16, 1)
        self.fused = fused

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.boom(torch.tanh(self.inp(x))))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self(x).float(), y)

    def configure_optimizers(self):
        if self.fused:
            return torch.optim.Adam(self.parameters(), lr=1e-2, fused=True)
        return torch.optim.SGD(self.parameters(), lr=0.1)


MARK = 100.0  # a value no batch of randn holds: the batch that carries it overflows


class Marked(nn.Linear):
    """A Linear whose output goes past fp16's max on a batch that carries MARK (replayable)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        return out * (4 * get_format("fp16").max) if bool((x == MARK).any()) else out


class MarkedNet(Net):
    def __init__(self) -> None:
        super().__init__()
        self.boom = Marked(8, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.boom(x))


class Scales(pl.Callback):
    """The scaler's own scale after every optimizer step (what the records must agree with)."""

    def __init__(self) -> None:
        self.start = 0.0
        self.after: list[float] = []

    def on_train_start(self, trainer, pl_module):
        self.start = trainer.precision_plugin.scaler.get_scale()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.after.append(trainer.precision_plugin.scaler.get_scale())


def _data(marked: int | None = None) -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(4 * STEPS, 8, generator=g), torch.randn(4 * STEPS, 1, generator=g)
    if marked is not None:
        x[4 * marked, 0] = MARK  # the first sample of that step's batch
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=4)


def _fit(net: pl.LightningModule, callbacks: list, logger=False, precision: str = "16-mixed",
         data: torch.utils.data.DataLoader | None = None, init_scale: float = 2.0**16,
         scaler: torch.amp.GradScaler | None = None):
    pl.seed_everything(0, verbose=False)
    scaler = scaler or torch.amp.GradScaler("cpu", init_scale=init_scale)
    plugins = [MixedPrecision(precision, "cpu", scaler)] if precision == "16-mixed" else []
    trainer = pl.Trainer(max_steps=STEPS, accelerator="cpu", plugins=plugins,
                         precision=None if plugins else precision, callbacks=callbacks,
                         deterministic=True, enable_checkpointing=False, logger=logger,
                         enable_progress_bar=False, enable_model_summary=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Lightning's notes on workers and the tiny dataset
        trainer.fit(net, _data() if data is None else data)
    return trainer


def _net(**kw) -> Net:
    torch.manual_seed(0)
    return Net(**kw)


def test_a_planted_overflow_is_skipped_halves_the_scale_and_names_the_module(tmp_path):
    monitor, scales = PrecisionMonitor(), Scales()
    trainer = _fit(_net(at=K), [monitor, scales], logger=CSVLogger(tmp_path))
    scaler = trainer.precision_plugin.scaler
    records = monitor.records
    assert [r.step for r in records] == list(range(STEPS))
    assert [r.skipped for r in records] == [s == K for s in range(STEPS)]
    bad = records[K]
    assert bad.nonfinite and bad.first_module == "boom" and bad.first_phase == "forward"
    # each record holds the scale its backward ran at: the scaler's own value before the step
    assert [r.scale for r in records] == [scales.start, *scales.after[:-1]]
    assert scales.after[K] == records[K].scale * scaler.get_backoff_factor()
    assert all(not r.nonfinite for r in records if r.step != K)

    # the logger got every step's scalars under ampnb/*
    (path,) = tmp_path.rglob("metrics.csv")
    rows = [r for r in csv.DictReader(path.read_text().splitlines()) if r.get("ampnb/scale")]
    assert [int(r["step"]) for r in rows] == list(range(STEPS))
    assert [float(r["ampnb/scale"]) for r in rows] == [r.scale for r in records]
    assert [float(r["ampnb/skipped"]) for r in rows] == [float(r.skipped) for r in records]
    assert float(rows[0]["ampnb/loss"]) == pytest.approx(records[0].loss)


def test_log_dir_and_keep_overflow_reach_the_watch(tmp_path):
    monitor = PrecisionMonitor(log_dir=tmp_path / "log", keep_overflow=tmp_path / "kept")
    _fit(_net(at=K), [monitor])
    assert [r.to_json() for r in read_log(tmp_path / "log")] == [r.to_json() for r in monitor.records]
    assert monitor.watch.overflow_file is not None and Path(monitor.watch.overflow_file).is_file()


def test_the_step_kept_inside_fit_replays_to_the_planted_op(tmp_path):
    import ampnb

    monitor = PrecisionMonitor(keep_overflow=tmp_path / "kept")
    torch.manual_seed(0)
    # a low initial scale: the marked batch is the first (and only) step that overflows
    _fit(MarkedNet(), [monitor], data=_data(marked=K), init_scale=2.0**8)
    assert [r.skipped for r in monitor.records] == [s == K for s in range(STEPS)]
    assert monitor.records[K].first_module == "boom"
    replay = ampnb.diagnosis.replay(monitor.watch.overflow_file, MarkedNet())
    assert replay.step == K and replay.scale == monitor.records[K].scale
    found = replay.nonfinite
    assert found.found and found.module == "boom" and found.phase == "forward"
    assert found.op.endswith("mul")  # the planted multiplication, not the Linear before it


def test_accumulation_and_validation_inside_fit():
    losses: list[float] = []

    class WithVal(Net):
        def training_step(self, batch, batch_idx):
            loss = super().training_step(batch, batch_idx)
            losses.append(float(loss.detach()))  # the user's loss (Lightning then divides it)
            return loss

        def validation_step(self, batch, batch_idx):
            self.log("val", nn.functional.mse_loss(self(batch[0]).float(), batch[1]))

    torch.manual_seed(0)
    monitor = PrecisionMonitor()
    pl.seed_everything(0, verbose=False)
    trainer = pl.Trainer(max_steps=3, accumulate_grad_batches=2, val_check_interval=2,
                         limit_val_batches=2, accelerator="cpu", enable_checkpointing=False,
                         plugins=[MixedPrecision("16-mixed", "cpu", torch.amp.GradScaler("cpu"))],
                         callbacks=[monitor], logger=False, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(WithVal(), _data(), _data())
    records = monitor.records
    # one record per optimizer step, fed by 2 micro-batches; validation forwards not counted
    assert [r.micro_batches for r in records] == [2, 2, 2] and trainer.global_step == 3
    assert "val" in trainer.callback_metrics  # validation did run in between
    expected = [(losses[2 * i] + losses[2 * i + 1]) / 2 for i in range(3)]
    assert [r.loss for r in records] == pytest.approx(expected, rel=1e-6)


def test_the_loss_is_the_unscaled_loss_lightning_computed():
    seen: list[float] = []

    class Losses(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            seen.append(float(outputs["loss"]))  # Lightning's own (no accumulation: as returned)

    monitor = PrecisionMonitor()
    _fit(_net(), [monitor, Losses()])
    assert [r.loss for r in monitor.records] == pytest.approx(seen, rel=1e-6)
    assert all(r.micro_batches == 1 for r in monitor.records)


def test_weights_with_and_without_the_monitor_are_bit_identical():
    plain, watched = _net(at=K), _net(at=K)
    _fit(plain, [])
    monitor = PrecisionMonitor()
    _fit(watched, [monitor])
    assert len(monitor.records) == STEPS
    for (name, a), b in zip(plain.state_dict().items(), watched.state_dict().values()):
        assert torch.equal(a, b), name
    assert all(not m._forward_hooks for m in watched.modules())  # closed at fit's end


def test_fused_adam_gradients_are_reported_unscaled_where_lightning_skips_unscale():
    monitor = PrecisionMonitor()
    trainer = _fit(_net(fused=True), [monitor])
    opt = trainer.optimizers[0]
    assert _optimizer_handles_unscaling(opt)  # Lightning's own test: it does not call unscale_

    # the reference: a plain loop over the same batches, fused Adam, the scaler's own step
    net = _net(fused=True)
    ref_opt = torch.optim.Adam(net.parameters(), lr=1e-2, fused=True)
    scaler = torch.amp.GradScaler("cpu")
    unscaled, scaled = [], []
    for x, y in _data():
        with torch.autocast("cpu", dtype=torch.float16, cache_enabled=False):
            loss = nn.functional.mse_loss(net(x).float(), y)
        scaler.scale(loss).backward()
        # the largest finite |gradient| of each layer's own parameters, as the record defines it
        scaled.append({n: max(float(torch.where(p.grad.isfinite(), p.grad.abs(), 0).max())
                              for p in m.parameters()) for n, m in net.named_children()})
        unscaled.append({n: g / scaler.get_scale() for n, g in scaled[-1].items()})
        scaler.step(ref_opt)
        scaler.update()
        ref_opt.zero_grad()
    for record, ref, raw in zip(monitor.records, unscaled, scaled):
        got = {la.module: la.grad_amax for la in record.layers}
        assert got == pytest.approx(ref, rel=1e-6)
        assert all(got[n] <= raw[n] / 1000 for n in raw)  # not the scaled gradients
    assert sum(not r.skipped for r in monitor.records) >= STEPS // 2
    assert max(la.grad_amax for la in monitor.records[-1].layers) > 0


def test_bf16_mixed_has_no_scaler_and_the_monitor_says_so():
    monitor = PrecisionMonitor()
    trainer = _fit(_net(), [monitor], precision="bf16-mixed")
    assert getattr(trainer.precision_plugin, "scaler", None) is None
    assert len(monitor.records) == STEPS
    assert all(r.scale is None and not r.has_scaler and not r.skipped for r in monitor.records)


def test_an_exception_in_training_closes_the_watch_and_keeps_its_records():
    class Fails(Net):
        def training_step(self, batch, batch_idx):
            if batch_idx == 2:
                raise ValueError("user's bug")
            return super().training_step(batch, batch_idx)

    class Optimizer(pl.Callback):
        def on_train_start(self, trainer, pl_module):
            self.opt = trainer.optimizers[0]

    torch.manual_seed(0)
    net, monitor, seen = Fails(), PrecisionMonitor(), Optimizer()
    scaler = torch.amp.GradScaler("cpu")
    with pytest.raises(ValueError, match="user's bug"):
        _fit(net, [monitor, seen], scaler=scaler)
    assert len(monitor.records) == 2
    # every hook removed, the scaler's methods its class's own again
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in net.modules())
    assert not seen.opt._optimizer_step_pre_hooks and not seen.opt._optimizer_step_post_hooks
    assert "update" not in vars(scaler) and "scale" not in vars(scaler)


@pytest.mark.parametrize(("kwargs", "says"), [
    ({"every": 0}, "every=0"), ({"log": "yes"}, "log='yes'"), ({"log_dir": 3}, "log_dir=3")])
def test_bad_arguments_are_refused_in_one_line(kwargs, says):
    with pytest.raises(ValueError, match=says) as e:
        PrecisionMonitor(**kwargs)
    assert "\n" not in str(e.value) and "allowed" in str(e.value)


def test_the_standalone_pytorch_lightning_is_used_when_only_it_is_installed(monkeypatch):
    # no second Lightning here: the unified one stands in under the standalone name
    monkeypatch.setitem(sys.modules, "lightning.pytorch", None)
    monkeypatch.setitem(sys.modules, "pytorch_lightning", pl)
    try:
        assert importlib.reload(integration).pl is pl
        monkeypatch.setitem(sys.modules, "pytorch_lightning", None)
        with pytest.raises(ImportError, match="needs Lightning: pip install lightning"):
            importlib.reload(integration)
    finally:
        monkeypatch.undo()
        importlib.reload(integration)
    assert integration.pl is pl and issubclass(integration.PrecisionMonitor, pl.Callback)


def test_importing_the_integrations_imports_no_framework():
    code = ("import sys, ampnb.integrations as i\n"
            "heavy = ('lightning', 'pytorch_lightning', 'transformers', 'accelerate', "
            "'tensorboard', 'IPython', 'matplotlib')\n"
            "print(sorted(m for m in heavy if m in sys.modules))\n"
            "i.lightning.PrecisionMonitor\n"
            "print('lightning' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split("\n")[:2] == ["[]", "True"]  # nothing until the callback is touched


def test_the_integrations_are_reached_from_a_plain_import_ampnb():
    """The public spelling (docs/design.md): `ampnb.integrations.lightning.PrecisionMonitor` after `import ampnb`."""
    code = ("import sys, ampnb\n"
            "print('lightning' in sys.modules)\n"
            "print(ampnb.integrations.lightning.PrecisionMonitor.__name__)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split("\n")[:2] == ["False", "PrecisionMonitor"]


class Wrapping(pl.LightningModule):
    """The common shape: training_step calls self.model(x), never the LightningModule itself."""

    def __init__(self) -> None:
        super().__init__()
        self.model = _net(at=K)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.model(x).float(), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_a_training_step_that_calls_its_model_directly_is_recorded():
    monitor = PrecisionMonitor()
    _fit(Wrapping(), [monitor])
    records = monitor.records
    assert [r.micro_batches for r in records] == [1] * STEPS
    assert [r.skipped for r in records] == [s == K for s in range(STEPS)]
    assert all(math.isfinite(r.loss) for r in records if r.step != K)
    bad = records[K]
    assert (bad.first_module, bad.first_phase) == ("model.boom", "forward")
    assert not any(r.nonfinite for r in records if r.step != K)
