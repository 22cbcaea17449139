"""FSDP2 mixed precision: MixedPrecisionPolicy's dtypes, memory per rank, and the sharded scaler."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ampnb.display import Table, TableView, dtype_name, format_bytes
from ampnb.distributed import _demo
from ampnb.distributed._plan import Plan, run_plan


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _nbytes(tensors: Any) -> int:
    return sum(_local(t).numel() * _local(t).element_size() for t in tensors)


def _reduce_scatter_recorder(seen: list[torch.dtype]) -> Any:
    """A reduce-scatter for FSDP2 that records the dtype of what it reduces (None if unsupported)."""
    try:
        from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultReduceScatter
    except ImportError:
        return None

    class Recording(DefaultReduceScatter):
        def __call__(self, output_tensor: Any, input_tensor: Any, *args: Any, **kw: Any) -> Any:
            seen.append(input_tensor.dtype)
            return super().__call__(output_tensor, input_tensor, *args, **kw)

    return Recording()


def _sharded(policy: dict[str, torch.dtype | None], device: torch.device) -> nn.Module:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(**policy)
    net = _demo.model().to(device)
    for layer in net:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mp_policy=mp)
    return fully_shard(net, mp_policy=mp)


def _policy_worker(rank: int, world_size: int, device: torch.device,
                   policy: dict[str, torch.dtype | None]) -> dict[str, Any]:
    net = _sharded(policy, device)
    units = [m for m in net if isinstance(m, nn.Linear)]
    in_forward: list[torch.dtype] = []
    unsharded: list[int] = []

    def see(module: nn.Module, args: Any) -> None:
        in_forward.append(module.weight.dtype)
        unsharded.append(_nbytes(module.parameters()))

    for m in units:
        m.register_forward_pre_hook(see)
    seen: list[torch.dtype] = []
    recorder = _reduce_scatter_recorder(seen)
    if recorder is not None:
        for m in [*units, net]:
            m.set_custom_reduce_scatter(recorder)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    x, y = (t.to(device) for t in _demo.shard(_demo.batches(1)[0], rank, world_size))
    out = net(x)
    nn.functional.mse_loss(out.float(), y).backward()
    opt.step()
    weight = units[0].weight
    return {
        "sharded": dtype_name(_local(weight).dtype), "in_forward": dtype_name(in_forward[0]),
        "output": dtype_name(out.dtype), "reduce": dtype_name(seen[0]) if seen else "not seen",
        "grad": dtype_name(_local(weight.grad).dtype),
        "shard_shape": tuple(_local(weight).shape), "full_shape": tuple(weight.shape),
        "params": _nbytes(net.parameters()),
        "grads": _nbytes(p.grad for p in net.parameters() if p.grad is not None),
        "optimizer": _nbytes(v for s in opt.state.values() for v in s.values()
                             if isinstance(v, torch.Tensor) and v.dim() > 0),
        "unsharded_largest": max(unsharded), "unsharded_all": sum(unsharded),
    }


@dataclass(frozen=True, repr=False)
class FsdpPolicy(TableView):
    """The dtypes FSDP2 used under a MixedPrecisionPolicy, and memory per rank."""

    policy: dict[str, str]
    ranks: tuple[dict[str, Any], ...]

    def table(self) -> Table:
        r = self.ranks[0]
        rows = [("sharded parameters (what the optimizer updates)", r["sharded"],
                 f"shard {list(r['shard_shape'])} of {list(r['full_shape'])}"),
                ("unsharded copies in forward (all-gathered)", r["in_forward"], "param_dtype"),
                ("forward output", r["output"], "output_dtype (None: as computed)"),
                ("gradients in the reduce-scatter", r["reduce"], "reduce_dtype (None: param_dtype)"),
                ("sharded gradients", r["grad"], "the sharded parameters' dtype")]
        pol = ", ".join(f"{k}={v}" for k, v in self.policy.items())
        return Table(("tensor", "dtype", "set by"), rows,
                     caption=f"FSDP2 fully_shard, MixedPrecisionPolicy({pol}), rank 0")

    def memory(self) -> Table:
        """Bytes per rank measured here (each rank's local shards)."""
        keys = (("parameters (sharded)", "params"), ("gradients (sharded)", "grads"),
                ("optimizer state (AdamW, sharded)", "optimizer"),
                ("unsharded copies, largest unit", "unsharded_largest"),
                ("unsharded copies, all units", "unsharded_all"))
        rows = [(label, *(format_bytes(r[k]) for r in self.ranks)) for label, k in keys]
        return Table(("memory", *(f"rank {i}" for i in range(len(self.ranks)))), rows,
                     caption=f"measured on {len(self.ranks)} ranks",
                     notes=("a unit's unsharded copy lives from its all-gather to its reshard: "
                            "the largest unit bounds it when units reshard after forward",))

    def projected(self, ranks: tuple[int, ...] = (1, 8, 64, 1024, 8192)) -> Table:
        """Bytes per rank for N ranks: shards scale as 1/N, the unsharded unit does not."""
        total = {k: sum(r[k] for r in self.ranks) for k in ("params", "grads", "optimizer")}
        largest = self.ranks[0]["unsharded_largest"]
        rows = []
        for n in ranks:
            shards = {k: math.ceil(v / n) for k, v in total.items()}
            rows.append((n, *(format_bytes(shards[k]) for k in ("params", "grads", "optimizer")),
                         format_bytes(largest), format_bytes(sum(shards.values()) + largest)))
        return Table(("ranks", "parameters", "gradients", "optimizer", "largest unsharded unit",
                      "total"), rows,
                     caption="projected per rank from the measured totals (padding ignored)")


_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, None: None}


def policy_plan(param_dtype: str | None = "bf16", reduce_dtype: str | None = "fp32",
                output_dtype: str | None = None) -> Plan:
    """One AdamW step of the demo MLP under FSDP2 with this MixedPrecisionPolicy."""
    bad = [v for v in (param_dtype, reduce_dtype, output_dtype) if v not in _DTYPES]
    if bad:
        raise ValueError(f"dtypes must be one of fp32, bf16, fp16 or None, got {bad[0]!r}")
    policy = {"param_dtype": _DTYPES[param_dtype], "reduce_dtype": _DTYPES[reduce_dtype],
              "output_dtype": _DTYPES[output_dtype]}
    shown = {k: str(v) for k, v in zip(policy, (param_dtype, reduce_dtype, output_dtype))}
    return Plan(_policy_worker, lambda values: FsdpPolicy(shown, tuple(values)), {"policy": policy})


def fsdp_policy(param_dtype: str | None = "bf16", reduce_dtype: str | None = "fp32",
                output_dtype: str | None = None, nproc: int = 2, device: str = "cpu") -> FsdpPolicy:
    """One AdamW step of the demo MLP under FSDP2 with this policy on nproc ranks."""
    return run_plan(policy_plan(param_dtype, reduce_dtype, output_dtype), nproc, device)


def _local_optimizer(net: nn.Module) -> torch.optim.Optimizer:
    """SGD over plain-tensor copies of this rank's shards (what FSDP1's flat shards are)."""
    params = []
    for p in net.parameters():
        plain = nn.Parameter(_local(p).detach().clone())
        plain.grad = _local(p.grad).detach().clone()
        params.append(plain)
    return torch.optim.SGD(params, lr=0.1)


SCALERS = ("GradScaler, DTensor shards (FSDP2)", "GradScaler, plain local shards",
           "ShardedGradScaler, plain local shards")


def _scaler_worker(rank: int, world_size: int, device: torch.device, inject_rank: int) -> list[tuple]:
    """FSDP2 in fp16 compute, an inf in one rank's gradient shard, with each scaler."""
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    rows = []
    for name in SCALERS:
        net = _sharded({"param_dtype": torch.float16, "reduce_dtype": torch.float32}, device)
        scaler = (ShardedGradScaler(device.type) if name.startswith("Sharded")
                  else torch.amp.GradScaler(device.type))
        x, y = (t.to(device) for t in _demo.shard(_demo.batches(1)[0], rank, world_size))
        scaler.scale(nn.functional.mse_loss(net(x).float(), y)).backward()
        if rank == inject_rank:  # an overflow that landed in this rank's shard only
            _local(net[0].weight.grad).view(-1)[0] = math.inf
        opt = (torch.optim.SGD(net.parameters(), lr=0.1) if "DTensor" in name
               else _local_optimizer(net))
        params = [p for g in opt.param_groups for p in g["params"]]
        before = [_local(p).detach().clone() for p in params]
        scaler.step(opt)
        scaler.update()
        stepped = any(not torch.equal(b, _local(p)) for b, p in zip(before, params))
        rows.append((name, rank, "yes" if rank == inject_rank else "no",
                     "stepped" if stepped else "skipped", scaler.get_scale()))
    return rows


@dataclass(frozen=True, repr=False)
class FsdpScaler(TableView):
    """Per scaler and rank: step taken or skipped, and the scale after, with an inf in one shard."""

    rows: tuple[tuple, ...]

    def agree(self, scaler: str) -> bool:
        """Whether every rank did the same under this scaler."""
        return len({(a, s) for name, _r, _i, a, s in self.rows if name == scaler}) == 1

    def table(self) -> Table:
        rows = [(n, r, i, a, f"{s:g}") for n, r, i, a, s in self.rows]
        verdict = ", ".join(f"{n}: {'agree' if self.agree(n) else 'DIVERGE'}"
                            for n in dict.fromkeys(r[0] for r in self.rows))
        return Table(("scaler", "rank", "inf in its shard", "optimizer", "scale after"), rows,
                     caption="FSDP2 with fp16 parameters: an inf in one rank's gradient shard",
                     notes=(f"ranks {verdict}. Each rank holds only its shard of the gradients. "
                            "On plain shards (FSDP1's flat parameters) GradScaler sees only its "
                            "own; ShardedGradScaler all-reduces found_inf. FSDP2's gradients are "
                            "DTensors, whose unscale_ reduces found_inf across the mesh",))


def scaler_plan(nproc: int = 2, inject_rank: int = 1) -> Plan:
    """FSDP2 + fp16: the scalers with an inf in one rank's gradient shard."""
    if not 0 <= inject_rank < nproc:
        raise ValueError(f"inject_rank must be in [0, {nproc}), got {inject_rank}")
    return Plan(_scaler_worker,
                lambda values: FsdpScaler(tuple(sorted((r for rows in values for r in rows),
                                                       key=lambda r: (SCALERS.index(r[0]), r[1])))),
                {"inject_rank": inject_rank})


def fsdp_scaler(nproc: int = 2, inject_rank: int = 1, device: str = "cpu") -> FsdpScaler:
    """FSDP2 + fp16: torch.amp.GradScaler vs ShardedGradScaler with an inf in one rank's shard."""
    return run_plan(scaler_plan(nproc, inject_rank), nproc, device)
