"""Take-home code: plain torch DDP / FSDP2 with torch.amp, and the Lightning equivalent."""

from __future__ import annotations

from dataclasses import dataclass

import torch

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


def _dt(dtype: torch.dtype) -> str:
    return f"torch.{str(dtype).removeprefix('torch.')}"


def _step(mixed: bool, dtype: str, scaler: bool, true: bool) -> list[str]:
    loss = "loss_fn(model(x), y)"
    cast = f"x.to(device, {dtype})" if true else "x.to(device)"
    lines = ["for x, y in loader:  # each rank loads its own part (DistributedSampler)",
             f"    x, y = {cast}, y.to(device)" + ("  # inputs in the parameters' dtype" if true else "")]
    if mixed:
        lines += [f"    with torch.autocast(device.type, dtype={dtype}):",
                  f"        loss = {loss}"]
    else:
        lines += [f"    loss = {loss}"]
    if scaler:
        lines += ["    scaler.scale(loss).backward()  # gradients reduced across ranks here",
                  "    scaler.step(optimizer)  # skipped on every rank when any rank overflowed",
                  "    scaler.update()"]
    else:
        lines += ["    loss.backward()  # gradients reduced across ranks here", "    optimizer.step()"]
    return lines + ["    optimizer.zero_grad()"]


def torch_code(strategy: str, mode: str) -> str:
    """A plain torch training script for the strategy and mode (torch.amp, DDP or FSDP2)."""
    m = get_mode(mode)
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {', '.join(STRATEGIES)}, got {strategy!r}")
    dtype = _dt(m.autocast_dtype or m.param_dtype)
    true = not m.is_mixed and m.name != "32-true"
    lines = [_LAUNCH, _SETUP, "model = build_model().to(device)"]
    if true:
        lines.append(f"model = model.to({dtype})  # {m.name}: parameters, gradients and "
                     "optimizer state in one dtype")
    if strategy == "ddp":
        lines += ["from torch.nn.parallel import DistributedDataParallel as DDP",
                  "model = DDP(model)  # all-reduces gradients in the parameters' dtype"]
        autocast = m.is_mixed
    else:
        lines += ["from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard", ""]
        if m.is_mixed:
            lines += [f"policy = MixedPrecisionPolicy(param_dtype={dtype}, reduce_dtype=torch.float32)",
                      "for block in model.children():  # one unit per block: all-gathered in turn",
                      "    fully_shard(block, mp_policy=policy)",
                      "fully_shard(model, mp_policy=policy)  # fp32 shards, unsharded copies in "
                      f"{dtype.removeprefix('torch.')}"]
        else:
            lines += ["for block in model.children():", "    fully_shard(block)", "fully_shard(model)"]
        autocast = False  # FSDP2 casts the unsharded parameters itself
    lines += ["optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)"]
    if m.uses_scaler:
        lines += ["scaler = torch.amp.GradScaler(device.type)  # FSDP2's DTensor gradients "
                  "agree on found_inf; FSDP1 needs ShardedGradScaler" if strategy == "fsdp"
                  else "scaler = torch.amp.GradScaler(device.type)"]
    lines += ["", *_step(autocast, dtype, m.uses_scaler, true), "", "dist.destroy_process_group()"]
    return "\n".join(lines)


def lightning_code(strategy: str, mode: str, nproc: int = 2) -> str:
    """The same run in Lightning: the strategy and precision strings."""
    m = get_mode(mode)
    lines = ["import lightning as L", ""]
    if strategy == "ddp":
        lines += [f'trainer = L.Trainer(strategy="ddp", precision="{m.name}", devices={nproc})']
    else:
        lines += ["from lightning.pytorch.strategies import ModelParallelStrategy",
                  "# FSDP2: call fully_shard(...) in your LightningModule.configure_model();",
                  '# strategy="fsdp" is FSDP1, with its MixedPrecision set from precision',
                  f'trainer = L.Trainer(strategy=ModelParallelStrategy(), precision="{m.name}", '
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
