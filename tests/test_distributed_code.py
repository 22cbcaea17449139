"""The take-home code runs: each script trains for real on a 1-rank gloo group in this process."""

from __future__ import annotations

import gc

import pytest
import torch

from ampnb.distributed.code import take_home
from ampnb.distributed.launcher import free_port

CASES = [(s, m) for s in ("ddp", "fsdp") for m in ("32-true", "bf16-mixed", "16-mixed", "bf16-true")]


@pytest.mark.parametrize("strategy, mode", CASES)
def test_the_torch_script_trains(strategy, mode, monkeypatch):
    for key, value in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "RANK": "0",
                       "WORLD_SIZE": "1", "LOCAL_RANK": "0"}.items():
        monkeypatch.setenv(key, value)
    code = take_home(strategy, mode)
    torch.manual_seed(0)
    loader = [(torch.randn(4, 8), torch.randn(4, 2)) for _ in range(2)]
    ns = {"build_model": lambda: torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2)),
          "loader": loader, "loss_fn": lambda out, y: torch.nn.functional.mse_loss(out.float(), y)}
    try:
        exec(compile(code.torch, f"<{strategy} {mode}>", "exec"), ns)
        has_scaler = "scaler" in ns
    finally:
        # The script's DDP model holds gloo's process group through its Reducer. Freed last, it
        # would join gloo's threads while holding the GIL, which one of them may need: a
        # deadlock seen once in CI. Free the script's objects first, then shut the group down.
        ns.clear()
        gc.collect()
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    assert has_scaler == (mode == "16-mixed")
    assert ("MixedPrecisionPolicy(param_dtype=torch.bfloat16" in code.torch) == (
        strategy == "fsdp" and mode == "bf16-mixed")
    assert f'precision="{mode}"' in code.lightning


def test_bad_strategy():
    with pytest.raises(ValueError, match="strategy must be one of ddp, fsdp"):
        take_home("zero3", "bf16-mixed")
