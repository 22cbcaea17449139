"""The take-home code runs: each script trains for real on a 1-rank gloo group in this process."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from ampnb.distributed.code import take_home
from ampnb.distributed.launcher import free_port

CASES = [(s, m) for s in ("ddp", "fsdp") for m in ("32-true", "bf16-mixed", "16-mixed", "bf16-true")]


PRELUDE = """
import torch
torch.manual_seed(0)
loader = [(torch.randn(4, 8), torch.randn(4, 2)) for _ in range(2)]
def build_model():
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
def loss_fn(out, y):
    return torch.nn.functional.mse_loss(out.float(), y)
"""
EPILOGUE = """
print("AMPNB-RESULT", "scaler" in globals(), all(torch.isfinite(p).all() for p in model.parameters()))
"""


@pytest.mark.parametrize("strategy, mode", CASES)
def test_the_torch_script_trains(strategy, mode, tmp_path):
    """Each script runs as a take-home script does: its own process, a 1-rank gloo group.

    (Not in the test process: a DDP model freed after the script's destroy_process_group()
    joins gloo's threads holding the GIL, which a thread may need — torch stashes a Python
    object in the thread-local state of every backward — a deadlock seen in CI.)
    """
    code = take_home(strategy, mode)
    script = tmp_path / f"{strategy}_{mode}.py"
    script.write_text(PRELUDE + code.torch + EPILOGUE)
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
           "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = [line.split()[1:] for line in done.stdout.splitlines()
              if line.startswith("AMPNB-RESULT")]
    assert result == [[str(mode == "16-mixed"), "True"]]
    assert "model" in code.torch and "dist.destroy_process_group()" in code.torch
    assert ("MixedPrecisionPolicy(param_dtype=torch.bfloat16" in code.torch) == (
        strategy == "fsdp" and mode == "bf16-mixed")
    assert f'precision="{mode}"' in code.lightning


def test_bad_strategy():
    with pytest.raises(ValueError, match="strategy must be one of ddp, fsdp"):
        take_home("zero3", "bf16-mixed")
