"""Measurements that each run in a fresh process, so peak memory is that run's alone.

`python -m benchmarks._procs train|doctor MODEL THREADS` builds MODEL, sets the torch thread
count and prints one `RESULT {json}` line. Both run the same plain 32-true steps with the
model's optimizer (median step time); `doctor` then runs `ampnb.doctor` with its defaults (wall
time, the headline, what did not fit) and times as many plain steps again after it. Both report
peak RSS from `getrusage` at the end.
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch

MARK = "RESULT "
KINDS = ("train", "doctor")
TRAIN_STEPS = 5  # timed, after one warm-up step that creates the optimizer's state
# Where a report says what did not fit its time budget and what it spent (issue #25), if it does.
_NOT_FIT, _BUDGET = "left_out", "budget"


def _tiny() -> tuple:
    # Plain torch (no transformers import): the harness's tests start it in seconds.
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    batch = (torch.randn(8, 16), torch.randn(8, 4))
    return model, batch, torch.optim.AdamW(model.parameters()), torch.nn.functional.mse_loss


def _gpt2_5m() -> tuple:
    from benchmarks._common import gpt2_5m

    return (*gpt2_5m(), None)


def _gpt2_17m() -> tuple:
    from benchmarks._common import gpt2_17m

    return (*gpt2_17m(), None)


def _demo_gpt() -> tuple:
    from ampnb.models import demo

    d = demo("gpt", seed=0)
    return d.model, d.batches[0], d.optimizer, d.loss_fn


def _conv() -> tuple:
    # Convolutions: on a CPU they have no emulated fp16 kernels (only GEMMs do), so 16-mixed runs
    # torch's native fp16 convolutions, many times slower than fp32's where fp16 units are absent.
    nn = torch.nn
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 64, 3, padding=1), nn.GELU(),
                          nn.Conv2d(64, 64, 3, padding=1), nn.GELU(),
                          nn.Conv2d(64, 128, 3, stride=2, padding=1), nn.GELU(),
                          nn.Conv2d(128, 128, 3, padding=1), nn.GELU(),
                          nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(128, 10))
    batch = (torch.randn(16, 3, 48, 48), torch.randint(0, 10, (16,)))
    return model, batch, torch.optim.AdamW(model.parameters()), nn.functional.cross_entropy


class _GruLM(torch.nn.Module):
    """A word-level GRU language model (2.2M parameters): embedding, two GRU layers, a head."""

    def __init__(self, vocab: int = 4000, width: int = 128, hidden: int = 256) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, width)
        self.gru = torch.nn.GRU(width, hidden, num_layers=2, batch_first=True)
        self.head = torch.nn.Linear(hidden, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.gru(self.emb(ids))[0]).flatten(0, 1)


def _gru_lm() -> tuple:
    # oneDNN has no bf16 RNN on an AVX2 CPU, and its steps are short: the budget's floor shows.
    torch.manual_seed(0)
    model = _GruLM()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 4000, (8, 65), generator=g)
    batch = (ids[:, :-1], ids[:, 1:].reshape(-1))
    return model, batch, torch.optim.AdamW(model.parameters()), torch.nn.functional.cross_entropy


def _ids(vocab: int, batch: int, seq: int) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(1))


def _convnext() -> tuple:
    # Four models the doctor was not tuned on, each built from a config (nothing downloads).
    import transformers as t

    torch.manual_seed(0)
    model = t.ConvNextForImageClassification(t.ConvNextConfig(
        num_channels=3, hidden_sizes=[48, 96, 192, 384], depths=[2, 2, 4, 2], num_labels=10,
        image_size=64))
    g = torch.Generator().manual_seed(1)
    batch = {"pixel_values": torch.randn(16, 3, 64, 64, generator=g),
             "labels": torch.randint(0, 10, (16,), generator=g)}
    return model, batch, torch.optim.AdamW(model.parameters()), None


def _clip() -> tuple:
    import transformers as t

    torch.manual_seed(0)
    model = t.CLIPModel(t.CLIPConfig(
        text_config=dict(vocab_size=1000, hidden_size=256, intermediate_size=1024,
                         num_hidden_layers=4, num_attention_heads=4, max_position_embeddings=64),
        vision_config=dict(hidden_size=256, intermediate_size=1024, num_hidden_layers=4,
                           num_attention_heads=4, image_size=64, patch_size=8),
        projection_dim=128))
    g = torch.Generator().manual_seed(1)
    batch = {"input_ids": _ids(1000, 16, 32), "pixel_values": torch.randn(16, 3, 64, 64, generator=g),
             "return_loss": True}
    return model, batch, torch.optim.AdamW(model.parameters()), None


def _llama_gqa() -> tuple:
    import transformers as t

    torch.manual_seed(0)
    model = t.LlamaForCausalLM(t.LlamaConfig(
        vocab_size=4000, hidden_size=256, intermediate_size=704, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=4096,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 512},
        rope_theta=500000.0))
    ids = _ids(4000, 8, 128)
    return model, {"input_ids": ids, "labels": ids}, torch.optim.AdamW(model.parameters()), None


def _deberta() -> tuple:
    import transformers as t

    torch.manual_seed(0)
    model = t.DebertaV2ForSequenceClassification(t.DebertaV2Config(
        vocab_size=4000, hidden_size=256, intermediate_size=1024, num_hidden_layers=4,
        num_attention_heads=4, max_position_embeddings=256, num_labels=3,
        relative_attention=True, position_buckets=64, pos_att_type=["p2c", "c2p"]))
    batch = {"input_ids": _ids(4000, 16, 64),
             "labels": torch.randint(0, 3, (16,), generator=torch.Generator().manual_seed(2))}
    return model, batch, torch.optim.AdamW(model.parameters()), None


# name -> () -> (model, batch, optimizer, loss_fn or None: the model's own loss)
MODELS: dict[str, Callable[[], tuple]] = {
    "tiny": _tiny, "demo-gpt": _demo_gpt, "gpt2-5M": _gpt2_5m, "gpt2-17M": _gpt2_17m,
    "conv": _conv, "gru-lm": _gru_lm, "convnext": _convnext, "clip": _clip,
    "llama-gqa": _llama_gqa, "deberta-v2": _deberta}


@dataclass(frozen=True)
class Measurement:
    """What one process measured: seconds (train: median plain step; doctor: its wall time),
    the process CPU time of the same, peak RSS in MiB; a doctor process also times plain steps
    just before and just after the doctor, so a load that comes and goes shows in the unit too."""

    kind: str
    model: str
    threads: int
    params: int
    seconds: float
    cpu_seconds: float
    peak_mib: float
    step_seconds: float = 0.0      # doctor: median plain step in the same process, wall
    step_cpu_seconds: float = 0.0  # doctor: the same in process CPU time
    step_low: float = 0.0          # doctor: the quartiles of those plain steps, wall
    step_high: float = 0.0
    import_seconds: float = 0.0    # doctor: its first use's imports (once per process; not counted)
    headline: str = ""    # the doctor's recommendation
    not_fit: str = ""     # what the doctor's report says did not fit its budget
    budget: str = ""      # the report's line on its budget and what it spent
    most_time: str = ""   # the doctor's three longest stages
    speeds: str = ""      # each mode's measured speed against 32-true, as the report gives it
    fp16: str = ""        # what the report says of 16-mixed: how it ran, or why it did not


def command(kind: str, model: str, threads: int) -> list[str]:
    """The command line of one measurement."""
    if kind not in KINDS:
        raise ValueError(f"kind {kind!r} is not one of {', '.join(KINDS)}")
    if model not in MODELS:
        raise ValueError(f"model {model!r} is not one of {', '.join(MODELS)}")
    if not isinstance(threads, int) or threads < 1:
        raise ValueError(f"threads={threads!r}: a positive int is allowed")
    return [sys.executable, "-m", "benchmarks._procs", kind, model, str(threads)]


def parse(output: str) -> Measurement:
    """The measurement in a child's stdout (its last RESULT line; other lines are ignored)."""
    lines = [ln for ln in output.splitlines() if ln.startswith(MARK)]
    if not lines:
        tail = " | ".join(output.strip().splitlines()[-3:])
        raise ValueError(f"no {MARK.strip()} line in the child's output (last lines: {tail!r})")
    return Measurement(**json.loads(lines[-1][len(MARK):]))


def measure(kind: str, model: str, threads: int, timeout: float = 900.0,
            env: dict[str, str] | None = None) -> Measurement:
    """Run one measurement in a fresh process (with `env` added to its variables) and return
    what it printed."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    done = subprocess.run(command(kind, model, threads), capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=root)
    if done.returncode != 0:
        tail = " | ".join(done.stderr.strip().splitlines()[-3:])
        raise RuntimeError(f"{kind} on {model} with {threads} threads exited "
                           f"{done.returncode}: {tail}")
    return parse(done.stdout)


# ----- in the child ----------------------------------------------------------------------------


def _peak_mib() -> float:
    # ru_maxrss is KiB on Linux (bytes on macOS).
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 1024


class _Phases:
    """Progress callback that charges the time between messages to the stage that was running."""

    def __init__(self) -> None:
        self.t, self.stage = time.perf_counter(), "start"
        self.spent: dict[str, float] = defaultdict(float)

    def __call__(self, text: str) -> None:
        now = time.perf_counter()
        self.spent[self.stage] += now - self.t
        self.t, self.stage = now, text.split(" (")[0].split(":")[0]

    def top(self, n: int = 3) -> str:
        """The n longest stages; call it as the doctor returns (the stage it was in ends)."""
        self(" end")
        ranked = sorted(self.spent.items(), key=lambda kv: -kv[1])[:n]
        return ", ".join(f"{k} {v:.1f} s" for k, v in ranked)


def _said(report: Any, name: str) -> str:
    """A report's field as one line ("" where this version of the doctor has none)."""
    found = getattr(report, name, None) or ""
    return found if isinstance(found, str) else "; ".join(map(str, found))


def _short(left_out: Any) -> str:
    """What did not fit, each piece by its name only ("bf16-true: its step (about ...)" -> "bf16-true")."""
    names = [str(s).split(":")[0].split(" (")[0] for s in (left_out or ())]
    return ", ".join(names)


def _plain_steps(model: Any, batch: Any, optimizer: Any, loss_fn: Any,
                 n: int) -> tuple[list[float], list[float]]:
    """Wall and process-CPU seconds of n plain 32-true steps with the model's optimizer."""
    from ampnb.batch import as_batch
    from ampnb.precision import Precision
    from ampnb.step import train_step

    p, data, wall, cpu = Precision.of("32-true", model=model), as_batch(batch, loss_fn), [], []
    for _ in range(n):
        t0, c0 = time.perf_counter(), time.process_time()
        train_step(p, model, optimizer, data, loss_fn)
        wall.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    return wall, cpu


def child(kind: str, model_name: str, threads: int) -> Measurement:
    """One measurement in this process (call it in a fresh one)."""
    torch.set_num_threads(threads)
    model, batch, optimizer, loss_fn = MODELS[model_name]()
    params = sum(p.numel() for p in model.parameters())
    base = dict(kind=kind, model=model_name, threads=torch.get_num_threads(), params=params)
    # The same steps in both kinds (the first creates the optimizer's state): the doctor then
    # starts from the state training leaves.
    _plain_steps(model, batch, optimizer, loss_fn, 1)
    wall, cpu = _plain_steps(model, batch, optimizer, loss_fn, TRAIN_STEPS)
    if kind == "train":
        return Measurement(**base, seconds=statistics.median(wall),
                           cpu_seconds=statistics.median(cpu), peak_mib=_peak_mib())
    t0 = time.perf_counter()
    from ampnb import doctor  # a lazy name: its modules load here, once per process

    imported = time.perf_counter() - t0
    phases = _Phases()  # only listens: the doctor runs with its default arguments
    t0, c0 = time.perf_counter(), time.process_time()
    report = doctor(model, batch, loss_fn, optimizer=optimizer, progress=phases)
    seconds, doctor_cpu = time.perf_counter() - t0, time.process_time() - c0
    most_time = phases.top()  # now: the steps timed after it are no stage of the doctor's
    after, after_cpu = _plain_steps(model, batch, optimizer, loss_fn, TRAIN_STEPS)
    wall, cpu = wall + after, cpu + after_cpu
    quartiles = statistics.quantiles(wall, n=4)  # one stray step does not make the unit noisy
    return Measurement(**base, seconds=seconds, cpu_seconds=doctor_cpu, peak_mib=_peak_mib(),
                       step_seconds=statistics.median(wall), step_cpu_seconds=statistics.median(cpu),
                       step_low=quartiles[0], step_high=quartiles[2], import_seconds=imported,
                       headline=report.recommended.headline, not_fit=_short(getattr(report, _NOT_FIT, ())),
                       budget=_said(report, _BUDGET).split("; order")[0],
                       most_time=most_time, speeds=_speeds(report), fp16=_fp16(report))


def _fp16(report: Any) -> str:
    """'16-mixed: fp16 kernels, inf/NaN, islands up' or '16-mixed: not run: ...'."""
    row = report.mode("16-mixed")
    if not getattr(row, "ran", True):
        return f"16-mixed: {row.how[:160]}"
    kept = [r.label for r in report.modes if r.name == "16-mixed" and r.keep_fp32]
    return (f"16-mixed: examined ({row.how.split(':')[0]}), "
            + ("finite" if row.finite else f"inf/NaN at {row.nonfinite_module or 'a module'}")
            + (f", verified {'; '.join(kept)}" if kept else ""))


def _speeds(report: Any) -> str:
    """'bf16-mixed: 1.42x (...)' per mode the report timed."""
    return "; ".join(f"{m.label}: {m.speed}" for m in report.modes[1:]
                     if getattr(m, "ratio", None) is not None)


if __name__ == "__main__":
    kind, name, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
    command(kind, name, n)  # the same checks as the parent's
    print(MARK + json.dumps(asdict(child(kind, name, n))), flush=True)
