"""A kept step is data (#41, security): what `keep_overflow` writes loads with
`torch.load(weights_only=True)`, `ampnb.diagnosis.replay` loads nothing else, checks `model=` before
it reads the file, and unpickles the watched model only when told `trust_pickled_model=True`."""

from __future__ import annotations

import collections
import io
import re
from pathlib import Path
from typing import NamedTuple

import numpy as np
import pytest
import torch
from torch import nn
from watch_models import Blowup, Planted, batches, run

import ampnb
from ampnb.watcher.overflow import target

K = 1  # the planted step
ROOT = Path(__file__).resolve().parents[1]


class Pair(NamedTuple):
    x: torch.Tensor
    blow: bool


class Structured(nn.Module):
    """Takes its batch in containers torch's weights-only loader does not know (a namedtuple,
    a Mapping subclass), indexing them as plain tuples and dicts do."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.blowup, self.fc2 = nn.Linear(8, 16), Blowup(), nn.Linear(16, 4)

    def forward(self, pair: Pair, extra: collections.UserDict) -> torch.Tensor:
        return self.fc2(self.blowup(self.fc1(pair[0] + extra["shift"]), pair[1]))


def _kept(tmp_path) -> Path:
    """A watched torch.amp loop over Structured whose step K overflows; the file it kept."""
    np.random.seed(3)  # numpy imported and drawn from: its generator is kept too
    m = Structured()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    sc = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    with ampnb.watch(m, opt, sc, keep_overflow=tmp_path / "kept") as w:
        for (x, y, blow), in batches(3, blow_at=K):
            with torch.autocast("cpu", dtype=torch.float16):
                out = m(Pair(x, blow), collections.UserDict(shift=torch.zeros(8)))
                loss = nn.functional.mse_loss(out.float(), y)
            sc.scale(loss).backward()
            sc.step(opt)
            sc.update()
            opt.zero_grad()
    assert [r.skipped for r in w.records] == [k == K for k in range(3)]
    return w.overflow_file


def test_the_kept_step_loads_with_weights_only_and_replays(tmp_path):
    file = _kept(tmp_path)
    data = torch.load(file, weights_only=True)  # raised UnpicklingError before
    assert data["step"] == K and isinstance(data["model"], bytes)
    assert isinstance(data["rng"]["numpy"][1], torch.Tensor)
    r = ampnb.diagnosis.replay(file, model=Structured())
    assert (r.micro_batch, r.nonfinite.op, r.nonfinite.module) == (0, "mul", "blowup")


class Marker:
    """Unpickling it runs code: it opens (creates) a marker file."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def _crafted(tmp_path, marker: Path) -> Path:
    """A file shaped like a kept step whose unpickling would run code."""
    file = tmp_path / "crafted.pt"
    torch.save({"format": 4, "step": 0, "state_dict": {}, "payload": Marker(marker)}, file)
    return file


@pytest.mark.parametrize("how", ["model", "model and trust", "trust only", "nothing"])
def test_a_crafted_file_runs_nothing_and_is_refused_in_one_line(tmp_path, how):
    marker = tmp_path / "ran"
    file = _crafted(tmp_path, marker)
    kwargs = {"model": Planted()} if "model" in how else {}
    if "trust" in how:
        kwargs["trust_pickled_model"] = True
    with pytest.raises(ValueError) as e:
        ampnb.diagnosis.replay(file, **kwargs)
    assert not marker.exists()  # nothing of the file ran
    msg = str(e.value)
    assert "\n" not in msg and "trust_pickled_model" in msg
    if how != "nothing":  # it was read (data only) and refused, naming the file
        assert str(file) in msg and "weights_only" in msg


def test_model_is_checked_before_the_file_is_read(tmp_path):
    marker = tmp_path / "ran"
    file = _crafted(tmp_path, marker)
    for bad in ({"model": "Planted"}, {"model": Planted(), "trust_pickled_model": "yes"}):
        with pytest.raises(ValueError) as e:
            ampnb.diagnosis.replay(file, **bad)
        assert "\n" not in str(e.value) and not marker.exists()
    with pytest.raises(ValueError, match="model=") as e:
        ampnb.diagnosis.replay(file)
    assert not marker.exists()


def test_the_pickled_model_is_unpickled_only_when_trusted(tmp_path):
    steps = batches(3, blow_at=K)
    m = Planted()
    run(m, torch.optim.AdamW(m.parameters(), lr=1e-2), steps,
        scaler=torch.amp.GradScaler("cpu", init_scale=2.0**10),
        watch={"keep_overflow": tmp_path / "kept"})
    file = target(tmp_path / "kept")
    data = torch.load(file, weights_only=True)
    marker = tmp_path / "ran"
    buf = io.BytesIO()
    torch.save(Marker(marker), buf)
    data["model"] = buf.getvalue()  # the pickled model replaced by code
    torch.save(data, file)
    r = ampnb.diagnosis.replay(file, model=Planted(seed=5))  # model=: the pickle is never read
    assert not marker.exists() and r.nonfinite.module == "blowup"
    with pytest.raises(ValueError, match="trust_pickled_model=True"):
        ampnb.diagnosis.replay(file)
    assert not marker.exists()
    with pytest.raises(ValueError, match="not an nn.Module"):
        ampnb.diagnosis.replay(file, trust_pickled_model=True)  # the opt-in: now it runs
    assert marker.exists()


def test_weights_only_false_appears_only_behind_the_opt_in():
    found = [(p.relative_to(ROOT).as_posix(), n) for p in sorted((ROOT / "ampnb").rglob("*.py"))
             for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1)
             if re.search(r"weights_only\s*=\s*(?!True)", line)]
    assert len(found) == 1 and found[0][0] == "ampnb/diagnosis/replay.py", found
    source = (ROOT / found[0][0]).read_text(encoding="utf-8").splitlines()
    body = "\n".join(source[found[0][1] - 6:found[0][1]])
    assert "trust_pickled_model" in body  # the one unpickling sits behind the opt-in


def test_a_model_of_another_class_is_refused_in_one_line(tmp_path):
    file = _kept(tmp_path)
    with pytest.raises(ValueError) as e:
        ampnb.diagnosis.replay(file, model=nn.Linear(8, 4))
    assert "\n" not in str(e.value) and "Structured" in str(e.value)


class Opaque:
    """A batch leaf of the user's own type: not data."""


def test_a_batch_that_is_not_data_is_a_warning_and_no_file(tmp_path):
    class Takes(Planted):
        def forward(self, x, tag=None):
            return super().forward(x, blow=tag is not None)

    m = Takes()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    sc = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    with pytest.warns(UserWarning, match="could not save.*more than data.*Opaque"):
        with ampnb.watch(m, opt, sc, keep_overflow=tmp_path / "kept") as w:
            for k, ((x, y, _),) in enumerate(batches(2)):
                with torch.autocast("cpu", dtype=torch.float16):
                    out = m(x, tag=Opaque() if k == 1 else None)
                    loss = nn.functional.mse_loss(out.float(), y)
                sc.scale(loss).backward()
                sc.step(opt)
                sc.update()
                opt.zero_grad()
    assert w.records[1].skipped and w.overflow_file is None
    assert not target(tmp_path / "kept").exists()
