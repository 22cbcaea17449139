"""Take-home code: plain torch DDP / FSDP2 with torch.amp, and the Lightning equivalent."""

from __future__ import annotations

from dataclasses import dataclass

from ampnb import recipe_code as rc
from ampnb.modes import get_mode

STRATEGIES = ("ddp", "fsdp")

_LAUNCH = "# run with: torchrun --nproc-per-node N train.py   (gloo on CPU, nccl on GPUs)"

_SETUP = '''import os
import torch
import torch.distributed as dist

dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
rank = dist.get_rank()
device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if torch.cuda.is_available() else torch.device("cpu")
'''


_LOOP = rc.Loop(device_type="device.type", inputs="x", targets="y", to_device="device", notes={
    "loop": "each rank loads its own part (DistributedSampler)",
    "backward": "gradients reduced across ranks here",
    "scaler.step": "skipped on every rank when any rank overflowed"})


def torch_code(strategy: str, mode: str) -> str:
    """A plain torch training script for the strategy and mode (torch.amp, DDP or FSDP2)."""
    m = get_mode(mode)
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {', '.join(STRATEGIES)}, got {strategy!r}")
    lines = [_LAUNCH, _SETUP, "model = build_model().to(device)", *rc.model_lines(m)]
    if strategy == "ddp":
        lines += ["from torch.nn.parallel import DistributedDataParallel as DDP",
                  "model = DDP(model)  # all-reduces gradients in the parameters' dtype"]
        autocast = True
    else:
        lines += ["from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard", ""]
        if m.is_mixed:
            dtype = rc.dtype_code(m.autocast_dtype)
            lines += [f"policy = MixedPrecisionPolicy(param_dtype={dtype}, reduce_dtype=torch.float32)",
                      "for block in model.children():  # one unit per block: all-gathered in turn",
                      "    fully_shard(block, mp_policy=policy)",
                      "fully_shard(model, mp_policy=policy)  # fp32 shards, unsharded copies in "
                      f"{dtype.removeprefix('torch.')}"]
        else:
            lines += ["for block in model.children():", "    fully_shard(block)", "fully_shard(model)"]
        autocast = False  # FSDP2 casts the unsharded parameters itself
    lines += ["optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)",
              *rc.scaler_lines(m, _LOOP.device_type, "FSDP2's DTensor gradients agree on found_inf; "
                               "FSDP1 needs ShardedGradScaler" if strategy == "fsdp" else ""),
              "", *rc.step_lines(m, _LOOP, autocast=autocast), "", "dist.destroy_process_group()"]
    return "\n".join(lines)


def lightning_code(strategy: str, mode: str, nproc: int = 2) -> str:
    """The same run in Lightning: the strategy and precision strings."""
    precision = rc.lightning_precision(get_mode(mode))
    lines = ["import lightning as L", ""]
    if strategy == "ddp":
        lines += [f'trainer = L.Trainer(strategy="ddp", precision="{precision}", devices={nproc})']
    else:
        lines += ["from lightning.pytorch.strategies import ModelParallelStrategy",
                  "# FSDP2: call fully_shard(...) in your LightningModule.configure_model();",
                  '# strategy="fsdp" is FSDP1, with its MixedPrecision set from precision',
                  f'trainer = L.Trainer(strategy=ModelParallelStrategy(), precision="{precision}", '
                  f"devices={nproc})"]
    return "\n".join(lines + ["trainer.fit(model, datamodule)"])


@dataclass(frozen=True)
class TakeHome:
    """The torch script and the Lightning lines for a strategy and mode."""

    strategy: str
    mode: str
    torch: str
    lightning: str

    def __repr__(self) -> str:
        return (f"# --- plain torch: {self.strategy}, {self.mode} ---\n{self.torch}\n\n"
                f"# --- Lightning ---\n{self.lightning}")

    def _repr_markdown_(self) -> str:
        return f"```python\n{self.torch}\n```\n\nLightning:\n```python\n{self.lightning}\n```"


def take_home(strategy: str = "ddp", mode: str = "bf16-mixed", nproc: int = 2) -> TakeHome:
    """The plain torch DDP/FSDP2 + torch.amp code, and the Lightning strategy= + precision= lines."""
    name = get_mode(mode).name
    return TakeHome(strategy, name, torch_code(strategy, name), lightning_code(strategy, name, nproc))
