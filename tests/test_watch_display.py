"""ampnb.watch's displays read real records: table, plots, panel, TensorBoard writer, log files.

The records come from a plain torch.amp fp16 loop with a GradScaler (the reference), observed
by hooks written here; two ranks are two replicas whose gradients are averaged as DDP's
all-reduce does, so an inf planted on one rank reaches both scalers.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import subprocess
import sys
import time

import pytest
import torch
from torch import nn

from ampnb.scaler.records import format_scale
from ampnb.watchlog import records as rec
from ampnb.watchlog.records import LayerStats, StepRecord, read_log
from ampnb.watchlog.table import layers_table, records_table

FINFO = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp8_e4m3": torch.float8_e4m3fn}


def _amax(t: torch.Tensor | None) -> float:
    if t is None:
        return math.nan
    t = t.detach().float().abs()
    t = t[torch.isfinite(t)]
    return t.max().item() if t.numel() else math.nan


class _Observe:
    """Forward and backward hooks on the Linear layers: amax and the first non-finite module."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.linears = {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear)}
        self.handles = []
        for name, m in self.linears.items():
            self.handles.append(m.register_forward_hook(self._fwd(name)))
        self.reset(1.0)

    def reset(self, scale: float) -> None:
        self.scale, self.act, self.act_grad, self.first = scale, {}, {}, ("", "")

    def _mark(self, name: str, t: torch.Tensor, phase: str) -> None:
        if not self.first[0] and not torch.isfinite(t).all():
            self.first = (name, phase)

    def _fwd(self, name):
        def hook(_m, _inp, out):
            self._mark(name, out, "forward")
            self.act[name] = _amax(out)
            out.register_hook(self._bwd(name))  # the gradient of this output, in backward
        return hook

    def _bwd(self, name):
        def hook(grad):
            self._mark(name, grad, "backward")
            self.act_grad[name] = _amax(grad) / self.scale  # unscaled
        return hook

    def layers(self) -> tuple[LayerStats, ...]:
        out = []
        for name, m in self.linears.items():
            g = m.weight.grad  # unscaled in place by scaler.step's unscale_
            nz = g[(g != 0) & torch.isfinite(g)]
            flush = ((nz.half() == 0).sum() / nz.numel()).item() if nz.numel() else math.nan
            out.append(LayerStats(name, self.act[name], self.act_grad.get(name, math.nan),
                                  _amax(g), flush))
        return tuple(out)


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(32, 16), nn.ReLU(), nn.Linear(16, 4))
    with torch.no_grad():
        model[0].weight.abs_()  # a planted all-6e4 input then overflows fp16 in layer 0
    return model


def ddp_run(steps: int = 6, plant: dict[int, set[int]] | None = None, ranks: int = 1,
            every: int = 2, order: tuple[int, ...] | None = None) -> list[StepRecord]:
    """Records of a real fp16 + GradScaler run on `ranks` replicas; plant = {rank: steps}."""
    plant = plant or {}
    models = [_model(0) for _ in range(ranks)]  # DDP: the same initial weights everywhere
    opts = [torch.optim.SGD(m.parameters(), lr=1e-3) for m in models]
    scalers = [torch.amp.GradScaler("cpu", init_scale=2.0**10) for _ in range(ranks)]
    obs = [_Observe(m) for m in models]
    gen = torch.Generator().manual_seed(1)
    out = []
    for step in range(steps):
        losses = []
        for r in range(ranks):
            x = torch.randn(4, 32, generator=gen)
            if step in plant.get(r, ()):
                x = torch.full_like(x, 6e4)
            obs[r].reset(scalers[r].get_scale())
            with torch.autocast("cpu", dtype=torch.float16):
                loss = models[r](x).float().pow(2).mean()
            scalers[r].scale(loss).backward()
            losses.append(loss.item())
        with torch.no_grad():  # the gradient all-reduce (mean) of DDP
            for ps in zip(*(m.parameters() for m in models)):
                mean = sum(p.grad for p in ps) / ranks
                for p in ps:
                    p.grad.copy_(mean)
        for r in order or range(ranks):
            scale = scalers[r].get_scale()
            scalers[r].step(opts[r])
            scalers[r].update()
            grads_bad = any(not torch.isfinite(p.grad).all() for p in models[r].parameters())
            bad = grads_bad or not math.isfinite(losses[r])
            name, phase = obs[r].first if bad else ("", "")
            out.append(StepRecord(
                step=step, rank=r, micro_batches=1, loss=losses[r], scale=scale,
                skipped=scalers[r].get_scale() < scale, nonfinite=bad, first_module=name,
                first_phase=phase, time=time.time(),
                layers=obs[r].layers() if step % every == 0 else ()))
            opts[r].zero_grad()
    return sorted(out, key=lambda x: (x.step, x.rank))


@pytest.fixture(scope="module")
def run() -> list[StepRecord]:
    return ddp_run(steps=6, plant={0: {3}})


def _json(records) -> list[str]:
    """Records compared by their log lines (nan fields make == false)."""
    return [r.to_json() for r in records]


def _rows(view) -> list[dict[str, str]]:
    t = view.table()
    return [dict(zip(t.headers, map(str, row))) for row in t.rows]


# ----- tables ----------------------------------------------------------------------------

def test_layer_headroom_is_log2_of_finfo_max_over_amax(run):
    stats = [r for r in run if r.layers]
    view = layers_table(run)
    assert view.step == stats[-1].step
    for layer, row in zip(stats[-1].layers, _rows(view)):
        assert row["module"] == layer.module
        for fmt, dtype in FINFO.items():
            want = [math.log2(torch.finfo(dtype).max / layer.amax(k)) for k in rec.KINDS]
            assert layer.headroom("act", fmt) == pytest.approx(want[0], rel=1e-12)
            assert row[f"headroom {fmt} (act / act_grad / grad)"] == \
                " / ".join(f"{w:.1f}" for w in want)
    assert [la.module for la in layers_table(run, step=0).layers] == ["0", "2"]
    with pytest.raises(ValueError, match=r"step=1 has no layer statistics; allowed: one of \[0"):
        layers_table(run, step=1)


def test_table_marks_the_planted_skip_and_the_scale_halves(run):
    rows = _rows(records_table(run))
    assert [r["skipped"] for r in rows] == ["yes" if r.step == 3 else "no" for r in run]
    assert rows[3]["non-finite (first module, phase)"] == "0 (forward)"
    assert all(r["non-finite (first module, phase)"] == "-" for k, r in enumerate(rows) if k != 3)
    # The scale the reference GradScaler used: halved by the skip at step 3.
    assert run[4].scale == run[3].scale * 0.5
    assert rows[4]["scale"] == format_scale(run[3].scale * 0.5)
    assert "non-finite on ranks" not in records_table(run).table().headers


def test_two_ranks_name_the_rank_and_the_shared_skip():
    # rank 1 ends its step first here, but the inf arose on rank 0: the module it names wins.
    recs = ddp_run(steps=5, plant={0: {2}}, ranks=2, order=(1, 0))
    view = records_table(recs)
    t = view.table()
    row = _rows(view)[2]
    assert row["non-finite on ranks"] == "0, 1"  # the all-reduce carries the inf to rank 1
    assert row["first rank"] == "0" and row["skipped"] == "yes"
    assert row["non-finite (first module, phase)"] == "0 (forward)"
    assert len(t.rows) == 5
    assert "the GradScaler's skip was the same on every rank at every step" in t.notes
    # Planted on both: both name a module, the earlier step end is the first rank.
    both = ddp_run(steps=3, plant={0: {1}, 1: {1}}, ranks=2, order=(1, 0))
    assert _rows(records_table(both))[1]["first rank"] == "1"
    # A rank whose scaler did not skip is said (it would not happen with DDP's scaler).
    split = [dataclasses.replace(r, skipped=False) if r.rank == 0 and r.step == 2 else r
             for r in recs]
    t = records_table(split).table()
    assert _rows(records_table(split))[2]["skipped"] == "ranks 1 only"
    assert any("disagree on the skip at steps 2" in n for n in t.notes)
    # The ranks' mean loss is what float arithmetic gives, also for inf and -inf.
    signs = [dataclasses.replace(r, loss=math.inf if r.rank else -math.inf) for r in recs]
    assert _rows(records_table(signs))[2]["loss"] == f"{math.inf - math.inf:.5g}"


def test_no_scaler_says_nothing_skipped_the_step(run):
    bare = [dataclasses.replace(r, scale=None, skipped=False) for r in run]
    view = records_table(bare)
    assert _rows(view)[3]["skipped"] == "no scaler"
    assert _rows(view)[3]["loss"] == f"{run[3].loss:.5g}" and not math.isfinite(run[3].loss)
    assert any("no GradScaler was there" in n for n in view.table().notes)


def test_long_runs_show_events_and_ends_and_say_what_was_elided():
    recs = ddp_run(steps=40, plant={0: {12, 20, 30}}, every=50)
    view = records_table(recs, head=2, tail=2, max_events=2)
    shown = [r["step"] for r in _rows(view)]
    assert shown == ["0", "1", "2..11", "12", "13..19", "20", "21..37", "38", "39"]
    note = view.table().notes[0]
    hidden = 40 - 6
    assert note.startswith(f"{hidden} of 40 steps elided") and "1 more are among the elided" in note
    assert len(_rows(records_table(recs))) == 40  # short enough: every step
    with pytest.raises(ValueError, match="head=-1 is not allowed"):
        records_table(recs, head=-1)
    with pytest.raises(ValueError, match="records contain int"):
        records_table([1])


# ----- the log -----------------------------------------------------------------------------

def test_read_log_round_trip_two_ranks_partial_line_ignored(tmp_path):
    recs = ddp_run(steps=4, plant={1: {2}}, ranks=2)
    for r in (0, 1):
        rec.write(rec.log_path(tmp_path, r), [x for x in recs if x.rank == r])
    with rec.log_path(tmp_path, 1).open("a") as f:
        f.write(recs[-1].to_json()[:40])  # a line still being written
    back = read_log(tmp_path)
    assert _json(back) == _json(recs)
    assert repr(records_table(back)) == repr(records_table(recs))


# ----- plots -------------------------------------------------------------------------------

def test_plot_records_points(run):
    from ampnb.plots.watch import plot_records
    ax = plot_records(run)
    (scale,) = ax.get_lines()
    assert list(scale.get_xdata()) == [r.step for r in run]
    assert list(scale.get_ydata()) == [r.scale for r in run]
    assert ax.get_yscale() == "log"
    marks = ax.collections[0].get_offsets()
    assert [(x, y) for x, y in marks.tolist()] == [(r.step, r.scale) for r in run if r.skipped]
    twin = next(a for a in ax.figure.axes if a is not ax)
    (loss,) = twin.get_lines()
    assert list(loss.get_ydata()) == [r.loss for r in run if math.isfinite(r.loss)]


def test_plot_headroom_lines_and_overflow_line(run):
    from ampnb.plots.watch import plot_headroom
    stats = [r for r in run if r.layers]
    ax = plot_headroom(run, kind="grad", fmt="bf16")
    lines = ax.get_lines()
    assert len(lines) == len(stats[0].layers) + 1  # one per layer and the zero line
    assert list(lines[-1].get_ydata()) == [0, 0]
    for line in lines[:-1]:
        want = [math.log2(torch.finfo(torch.bfloat16).max / _layer(r, line.get_label()).grad_amax)
                for r in stats]
        assert list(line.get_xdata()) == [r.step for r in stats]
        assert list(line.get_ydata()) == pytest.approx(want)
    assert len(plot_headroom(run, worst=1).get_lines()) == 2
    with pytest.raises(ValueError, match="kind='weights' is not allowed"):
        plot_headroom(run, kind="weights")


def _layer(r: StepRecord, module: str) -> LayerStats:
    return next(la for la in r.layers if la.module == module)


# ----- panel -------------------------------------------------------------------------------

class FakeWatch:
    """What the panel needs of a watch: a growing .records and .on_record(callback)."""

    def __init__(self) -> None:
        self.records: list[StepRecord] = []
        self.callbacks = []

    def on_record(self, callback):
        self.callbacks.append(callback)
        return lambda: self.callbacks.remove(callback)

    def add(self, r: StepRecord) -> None:
        self.records.append(r)
        for cb in list(self.callbacks):
            cb(r)


def test_panel_updates_on_each_record_and_closes(run):
    from ampnb.panels import WatchPanel
    w = FakeWatch()
    panel = WatchPanel(w, interval=0)
    assert "0 steps" in panel.status.value
    for r in run:
        draws = panel.draws
        w.add(r)
        assert panel.draws == draws + 1 and f"{r.step + 1} steps" in panel.status.value
    assert "first non-finite: step 3, 0 (forward)" in panel.status.value
    assert list(panel.ax.get_lines()[0].get_xdata()) == [r.step for r in run]
    panel.view.value = "headroom"
    assert len(panel.ax.get_lines()) == len(run[0].layers) + 1
    assert panel.message.value == ""
    panel.close()
    assert w.callbacks == [] and panel.widget.comm is None
    with pytest.raises(ValueError, match="source=int is not allowed"):
        WatchPanel(3)
    with pytest.raises(ValueError, match="interval=-1 is not allowed; allowed: seconds >= 0"):
        WatchPanel(FakeWatch(), interval=-1)


def test_panel_throttles_a_fast_loop_and_flushes_when_the_kernel_is_free(run):
    from ampnb.panels import WatchPanel

    async def loop() -> tuple[int, int]:
        w = FakeWatch()
        panel = WatchPanel(w, interval=0.3)
        before = panel.draws
        for i in range(50):
            w.add(dataclasses.replace(run[0], step=i))
        during = panel.draws - before  # the fast loop drew nothing more: within 0.3 s
        assert "0 steps" in panel.status.value
        await asyncio.sleep(0.6)       # the kernel is free: the pending records are drawn
        after = panel.draws - before
        assert "50 steps" in panel.status.value
        panel.close()
        return during, after
    during, after = asyncio.run(loop())
    assert during == 0 and after == 1
    # No event loop (a script): drawn by refresh().
    w = FakeWatch()
    panel = WatchPanel(w, interval=60)
    w.add(run[0])
    draws = panel.draws
    panel.refresh()
    assert panel.draws == draws + 1 and len(panel.records) == 1
    panel.close()


def test_panel_follows_a_log_dir(tmp_path, run):
    from ampnb.panels import WatchPanel
    path = rec.log_path(tmp_path, None)
    rec.write(path, run[:2])
    panel = WatchPanel(tmp_path)
    assert _json(panel.records) == _json(run[:2])
    rec.write(path, run[2:3])
    panel.refresh_button.click()
    assert _json(panel.records) == _json(run[:3]) and "3 steps" in panel.status.value
    panel.close()

    async def follow() -> list[StepRecord]:
        p = WatchPanel(tmp_path, poll=0.05)
        rec.write(path, run[3:])
        await asyncio.sleep(0.3)  # polled while idle
        p.close()
        return p.records
    assert _json(asyncio.run(follow())) == _json(run)
    with pytest.raises(ValueError, match="is not a directory"):
        WatchPanel(path)


# ----- TensorBoard ---------------------------------------------------------------------------

def test_tensorboard_event_files_read_back(tmp_path, run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from ampnb.watcher.tensorboard import TensorBoardWriter
    with TensorBoardWriter(tmp_path, rank=1) as tb:
        for r in run:
            tb.write(r)
    ea = EventAccumulator(str(tmp_path / "rank1"), size_guidance={"scalars": 0, "histograms": 0})
    ea.Reload()

    def f32(v: float) -> float:
        return torch.tensor(v, dtype=torch.float32).item()
    for tag, field in (("watch/loss", "loss"), ("watch/scale", "scale"),
                       ("watch/skipped", "skipped")):
        got = [(e.step, repr(e.value)) for e in ea.Scalars(tag)]  # repr: nan equals nan
        assert got == [(r.step, repr(f32(float(getattr(r, field))))) for r in run], tag
    assert math.isnan(ea.Scalars("watch/loss")[3].value) and run[3].skipped
    stats = [r for r in run if r.layers]
    layer = stats[-1].layers[0]
    got = ea.Scalars(f"headroom_fp16/act/{layer.module}")
    assert [e.step for e in got] == [r.step for r in stats]
    assert got[-1].value == f32(math.log2(torch.finfo(torch.float16).max / layer.act_amax))
    hist = ea.Histograms("log2_amax/act")
    assert [h.step for h in hist] == [r.step for r in stats]
    assert hist[-1].histogram_value.num == len(layer_amaxes := [la.act_amax for la in
                                                               stats[-1].layers])
    assert hist[-1].histogram_value.max == pytest.approx(math.log2(max(layer_amaxes)))


def test_tensorboard_missing_says_how_to_install(tmp_path, monkeypatch):
    from ampnb.watcher.tensorboard import TensorBoardWriter
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    with pytest.raises(ImportError, match="pip install tensorboard"):
        TensorBoardWriter(tmp_path)
    assert not any(tmp_path.iterdir())


def test_pure_modules_import_no_display_stack():
    code = ("import ampnb.watchlog.table, ampnb.watcher.tensorboard, sys; "
            "bad = [m for m in ('matplotlib', 'IPython', 'ipywidgets', 'tensorboard') "
            "if m in sys.modules]; assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)
