"""What the watch writes and reads back (#41, files): one watch per log_dir, in one process or
several; a log line that is not a record is a ValueError naming its file and line, every field's
type checked; a log_dir spelled with '..' is the folder it names."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from dataclasses import fields
from pathlib import Path

import pytest
import torch
from watch_models import Planted, batches, run

import ampnb
from ampnb.watchlog import read_log
from ampnb.watchlog.records import LayerStats, StepRecord

ROOT = Path(__file__).resolve().parents[1]


def _opt(m):
    return torch.optim.AdamW(m.parameters(), lr=1e-2)


# ----- one watch per log_dir -------------------------------------------------------------------


def test_a_second_watch_on_a_log_dir_in_use_is_refused_in_one_line(tmp_path):
    d = tmp_path / "new"
    a, b = Planted(), Planted(seed=1)
    opt = _opt(a)
    first = ampnb.watch(a, opt, log_dir=d)
    try:
        for spelling in (d, tmp_path / "other" / ".." / "new"):  # the same folder either way
            with pytest.raises(ValueError) as e:
                ampnb.watch(b, _opt(b), log_dir=spelling)
            msg = str(e.value)
            assert "\n" not in msg and repr(os.fspath(spelling)) in msg
            assert f"pid {os.getpid()}" in msg  # the owner: this process
            assert not b._forward_pre_hooks  # nothing attached to the refused one's model
        run(a, opt, batches(2))
    finally:
        first.close()
    assert [r.step for r in read_log(d)] == [0, 1]  # the first watch's records only
    assert not (d / "watch.lock").exists()  # released at close()


def test_closing_releases_the_log_dir(tmp_path):
    m = Planted()
    ampnb.watch(m, _opt(m), log_dir=tmp_path / "d").close()  # no step: no records
    with ampnb.watch(m, _opt(m), log_dir=tmp_path / "d"):
        pass


_CHILD = textwrap.dedent("""
    import os, sys
    import torch, ampnb
    m = torch.nn.Linear(2, 2)
    try:
        w = ampnb.watch(m, torch.optim.SGD(m.parameters(), lr=0.1), log_dir=sys.argv[1])
    except ValueError as e:
        print("refused", e, flush=True)
        sys.exit(0)
    print("accepted", os.getpid(), flush=True)
    sys.stdin.read()  # held until the test closes stdin
    w.close()
""")


def _child(d: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    return subprocess.Popen([sys.executable, "-c", _CHILD, str(d)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env=env, cwd=ROOT)


def test_watches_in_several_processes_on_one_new_log_dir_one_is_accepted(tmp_path):
    d = tmp_path / "new"
    children = [_child(d) for _ in range(3)]  # they race for the folder
    try:
        said = [c.stdout.readline().strip() for c in children]
        accepted = [s for s in said if s.startswith("accepted")]
        assert len(accepted) == 1, said
        owner = accepted[0].split()[1]
        for s in said:
            if s.startswith("refused"):
                assert repr(str(d)) in s and f"pid {owner}" in s
        m = Planted()
        with pytest.raises(ValueError, match=f"pid {owner}"):  # and this process too
            ampnb.watch(m, _opt(m), log_dir=d)
    finally:
        for c in children:
            c.communicate("", timeout=120)
    assert all(c.returncode == 0 for c in children)
    m = Planted()
    ampnb.watch(m, _opt(m), log_dir=d).close()  # released by the owner's close()


def test_the_lock_of_a_process_that_died_is_taken_over(tmp_path):
    d = tmp_path / "d"
    child = _child(d)
    assert child.stdout.readline().startswith("accepted")
    os.kill(child.pid, signal.SIGKILL)  # killed: its watch never closed
    child.wait(timeout=60)
    assert (d / "watch.lock").is_file()
    m = Planted()
    opt = _opt(m)
    with ampnb.watch(m, opt, log_dir=d):
        run(m, opt, batches(1))
    assert len(read_log(d)) == 1 and not (d / "watch.lock").exists()


def test_a_lock_from_a_live_process_on_another_host_names_the_file_to_delete(tmp_path):
    d = tmp_path / "d"
    d.mkdir()
    (d / "watch.lock").write_text(json.dumps({"pid": 1, "host": "elsewhere", "started": "t"}))
    m = Planted()
    with pytest.raises(ValueError) as e:
        ampnb.watch(m, _opt(m), log_dir=d)
    assert "pid 1 on elsewhere" in str(e.value) and str(d / "watch.lock") in str(e.value)


# ----- paths with '..' ---------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["log_dir", "keep_overflow"])
def test_a_path_through_a_new_folder_and_dot_dot_is_the_folder_it_names(tmp_path, monkeypatch,
                                                                         kind):
    monkeypatch.chdir(tmp_path)
    m = Planted()
    opt, scaler = _opt(m), torch.amp.GradScaler("cpu", init_scale=2.0**10)
    with ampnb.watch(m, opt, scaler, **{kind: "new/../a"}):
        run(m, opt, batches(3, blow_at=1), scaler=scaler)
    assert not (tmp_path / "new").exists()
    if kind == "log_dir":
        assert len(read_log("a")) == 3 and len(read_log(tmp_path / "a")) == 3
    else:
        assert (tmp_path / "a" / "overflow.pt").is_file()


# ----- read_log: a line that is not a record -----------------------------------------------------


def _good() -> dict:
    layer = LayerStats("fc1", 1.0, 2.0, 3.0, 0.5)
    return json.loads(StepRecord(step=1, loss=0.5, scale=1024.0, seconds=0.25, time=5.0,
                                 layers=(layer,)).to_json())


def _without(key):
    def f(d):
        del d[key]
    return f


def _set(path, value):
    def f(d):
        *head, last = path
        for k in head:
            d = d[k]
        d[last] = value
    return f


FIELD_CASES = {
    "step str": _set(["step"], "1"), "step float": _set(["step"], 1.5),
    "step bool": _set(["step"], True), "rank null": _set(["rank"], None),
    "micro_batches str": _set(["micro_batches"], "2"), "loss str": _set(["loss"], "0.5"),
    "loss bool": _set(["loss"], True), "loss too big": _set(["loss"], 10**400),
    "scale str": _set(["scale"], "big"), "skipped int": _set(["skipped"], 1),
    "nonfinite str": _set(["nonfinite"], "no"), "first_module int": _set(["first_module"], 3),
    "first_phase null": _set(["first_phase"], None), "lost_updates str": _set(["lost_updates"], "a"),
    "seconds list": _set(["seconds"], []), "time object": _set(["time"], {}),
    "layers object": _set(["layers"], {}), "layers null": _set(["layers"], None),
    "layer int": _set(["layers", 0], 3), "layer module int": _set(["layers", 0, "module"], 3),
    "layer amax str": _set(["layers", 0, "act_amax"], "x"),
    "layer missing field": lambda d: d["layers"][0].pop("grad_amax"),
    "loss nested": _set(["loss"], [[0.5]]), "layers nested": _set(["layers"], [[{}]]),
    "scale nested": _set(["scale"], {"v": 1.0}),
    **{f"missing {f.name}": _without(f.name) for f in fields(StepRecord)},
}
RAW_CASES = {
    "not JSON": "{not json", "truncated": '{"step": 1, "loss": ', "empty": "",
    "list": "[1, 2]", "number": "3", "string": '"record"', "null": "null", "true": "true",
    "deep list": "[" * 100_000 + "]" * 100_000,
    "deep field": '{"step": ' + "[" * 100_000 + "]" * 100_000 + "}",
}


def _check_refused(tmp_path, line, *named):
    log = tmp_path / "records.jsonl"
    ok = StepRecord(step=0).to_json()
    log.write_text(ok + "\n" + line + "\n" + ok + "\n", encoding="utf-8")
    with pytest.raises(ValueError) as e:
        read_log(tmp_path)
    msg = str(e.value)
    assert msg.startswith(f"{log}:2: ") and "\n" not in msg and len(msg) < 300
    for word in named:
        assert word in msg


@pytest.mark.parametrize("case", FIELD_CASES)
def test_a_field_of_the_wrong_type_or_missing_is_a_value_error_at_its_line(tmp_path, case):
    d = _good()
    FIELD_CASES[case](d)
    words = case.split()
    _check_refused(tmp_path, json.dumps(d), words[1] if words[0] == "missing" else words[0])


@pytest.mark.parametrize("case", RAW_CASES)
def test_a_line_that_is_not_a_json_object_is_a_value_error_at_its_line(tmp_path, case):
    _check_refused(tmp_path, RAW_CASES[case])


def test_a_good_line_reads_back_exactly_and_unknown_keys_are_ignored(tmp_path):
    d = _good()
    d["from_a_newer_version"] = {"x": [1]}
    d["loss"] = 1  # an integer is a number
    (tmp_path / "records.jsonl").write_text(json.dumps(d) + "\n")
    (r,) = read_log(tmp_path)
    assert r == StepRecord(step=1, loss=1.0, scale=1024.0, seconds=0.25, time=5.0,
                           layers=(LayerStats("fc1", 1.0, 2.0, 3.0, 0.5),))
    assert type(r.loss) is float and type(r.layers) is tuple
