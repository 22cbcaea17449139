"""torch's profiler start/stop lines never reach a notebook; nothing else on descriptor 2 is lost."""

from __future__ import annotations

import subprocess
import sys

PROFILE = """
import os, torch
from torch.profiler import profile, ProfilerActivity
from ampnb._quiet import QuietProfile, without_chatter
quiet = {quiet}
p = profile(activities=[ProfilerActivity.CPU])
with (QuietProfile(p) if quiet else p):
    torch.mm(torch.randn(4, 4), torch.randn(4, 4))
without_chatter(lambda: os.write(2, b"USDT:x] profiler_start\\nkeep me\\n"))
"""


def _stderr(quiet: bool) -> str:
    done = subprocess.run([sys.executable, "-c", PROFILE.format(quiet=quiet)], capture_output=True,
                          text=True, timeout=120, check=True)
    return done.stderr


def test_the_profilers_lines_are_dropped_and_the_rest_kept():
    loud, quiet = _stderr(False), _stderr(True)
    assert "profiler_start" in loud  # torch writes them (else this test shows nothing)
    assert "profiler_start" not in quiet and "profiler_stop" not in quiet
    assert "keep me" in quiet


def test_the_doctors_profile_is_quiet():
    code = ("import torch, ampnb\n"
            "from ampnb.models import demo\n"
            "d = demo('mlp')\n"
            "ampnb.diagnosis.profile_step(d.model, d.batches[0], d.loss_fn, modes=['bf16-mixed'])\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300, check=True)
    assert "profiler_start" not in done.stderr and "profiler_stop" not in done.stderr
