"""DDP under each precision mode: the all-reduce dtype, the GradScaler across ranks, 32-true = 1 process."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from ampnb.display import Table, TableView, dtype_name
from ampnb.distributed import _demo
from ampnb.distributed._plan import Plan, run_plan

MODES = ("32-true", "bf16-mixed", "16-mixed", "bf16-true", "16-true")


def _ddp(net: nn.Module, device: torch.device) -> nn.Module:
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(net.to(device), device_ids=[device.index] if device.type == "cuda" else None)


def _dtype_rows(rank: int, world_size: int, device: torch.device, modes: tuple[str, ...]) -> list[tuple]:
    """Per mode: parameter dtype, forward output dtype, and the dtype DDP all-reduced in."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    from ampnb.precision import Precision

    rows = []
    for name in modes:
        p = Precision.of(name, device=device)  # the mode on this rank's device
        net = _ddp(p.convert_module(_demo.model()), device)
        seen: list[torch.dtype] = []

        def hook(state, bucket, seen=seen):  # no annotations: DDP checks for dist.GradBucket
            seen.append(bucket.buffer().dtype)
            return default_hooks.allreduce_hook(None, bucket)

        net.register_comm_hook(None, hook)
        x, y = (p.convert_input(t.to(device)) for t in _demo.shard(_demo.batches(1)[0], rank, world_size))
        with p.forward_context():
            out = net(x)
            loss = nn.functional.mse_loss(out.float(), y.float())
        loss.backward()
        grad = next(net.parameters()).grad
        rows.append((name, dtype_name(next(net.parameters()).dtype), dtype_name(out.dtype),
                     dtype_name(seen[0]), dtype_name(grad.dtype)))
    return rows


@dataclass(frozen=True, repr=False)
class DdpDtypes(TableView):
    """What dtype DDP's gradient all-reduce runs in, per mode (measured by a comm hook)."""

    rows: tuple[tuple, ...]

    def table(self) -> Table:
        return Table(("mode", "parameters", "forward output", "all-reduce", "gradients"), self.rows,
                     caption="DDP: dtypes on rank 0 (a comm hook records the bucket DDP all-reduces)",
                     notes=("mixed modes keep fp32 parameters, so gradients are reduced in fp32; "
                            "true modes reduce in the parameter dtype",))


def dtypes_plan(modes: tuple[str, ...] = MODES) -> Plan:
    """One DDP step per mode; the dtypes on rank 0."""
    return Plan(_dtype_rows, lambda values: DdpDtypes(tuple(values[0])), {"modes": tuple(modes)})


def ddp_dtypes(nproc: int = 2, modes: tuple[str, ...] = MODES, device: str = "cpu") -> DdpDtypes:
    """One DDP step per mode on nproc ranks; the dtypes on rank 0."""
    return run_plan(dtypes_plan(modes), nproc, device)


def _scaler_rows(rank: int, world_size: int, device: torch.device, steps: int, inject_step: int,
                 inject_rank: int) -> list[tuple]:
    """16-mixed DDP with a GradScaler; an inf in one rank's input at one step."""
    from ampnb.precision import Precision

    p = Precision.of("16-mixed", device=device)  # its GradScaler: torch's recipe, spelled out below
    net = _ddp(_demo.model(), device)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    scaler = p.scaler
    rows = []
    for step, batch in enumerate(_demo.batches(steps)):
        x, y = (t.to(device) for t in _demo.shard(batch, rank, world_size))
        if step == inject_step and rank == inject_rank:
            x = x.clone()
            x[0, 0] = math.inf
        before = [p.detach().clone() for p in net.parameters()]
        with p.forward_context():
            loss = nn.functional.mse_loss(net(x).float(), y)
        scaler.scale(loss).backward()  # DDP all-reduces the scaled gradients here
        finite = all(bool(torch.isfinite(p.grad).all()) for p in net.parameters())
        scaler.step(opt)
        scaler.update()
        stepped = any(not torch.equal(b, p) for b, p in zip(before, net.parameters()))
        opt.zero_grad()
        rows.append((step, rank, "yes" if bool(torch.isfinite(loss)) else "inf/NaN",
                     "finite" if finite else "inf/NaN", "stepped" if stepped else "skipped",
                     scaler.get_scale()))
    return rows


@dataclass(frozen=True, repr=False)
class ScalerAcrossRanks(TableView):
    """Per step and rank: local loss, gradients after the all-reduce, step or skip, the scale."""

    rows: tuple[tuple, ...]
    inject_step: int
    inject_rank: int

    def agree(self) -> bool:
        """Every rank took or skipped the same steps and holds the same scale after each."""
        by_step: dict[int, set] = {}
        for step, _rank, _loss, _grads, action, scale in self.rows:
            by_step.setdefault(step, set()).add((action, scale))
        return all(len(v) == 1 for v in by_step.values())

    def table(self) -> Table:
        rows = [(s, r, loss, g, a, f"{scale:g}") for s, r, loss, g, a, scale in sorted(self.rows)]
        return Table(("step", "rank", "local loss finite", "gradients after all-reduce",
                      "optimizer", "scale after update"), rows,
                     caption=f"16-mixed DDP + GradScaler: inf in rank {self.inject_rank}'s input "
                             f"at step {self.inject_step} only",
                     notes=(f"ranks agree on every step: {'yes' if self.agree() else 'NO'} — the "
                            "all-reduce sums an inf into every rank's gradients, so every "
                            "scaler finds it",))


def scaler_plan(nproc: int = 2, steps: int = 4, inject_step: int = 1, inject_rank: int = 1) -> Plan:
    """16-mixed DDP with torch.amp.GradScaler, an inf injected on one rank only."""
    if not 0 <= inject_rank < nproc or not 0 <= inject_step < steps:
        raise ValueError(f"inject_rank must be in [0, {nproc}) and inject_step in [0, {steps}), "
                         f"got {inject_rank}, {inject_step}")
    return Plan(_scaler_rows,
                lambda values: ScalerAcrossRanks(tuple(r for rows in values for r in rows),
                                                 inject_step, inject_rank),
                {"steps": steps, "inject_step": inject_step, "inject_rank": inject_rank})


def ddp_scaler(nproc: int = 2, steps: int = 4, inject_step: int = 1, inject_rank: int = 1,
               device: str = "cpu") -> ScalerAcrossRanks:
    """16-mixed DDP with torch.amp.GradScaler, an inf injected on one rank only."""
    return run_plan(scaler_plan(nproc, steps, inject_step, inject_rank), nproc, device)


def _train(rank: int, world_size: int, device: torch.device, steps: int) -> dict[str, torch.Tensor]:
    net = _ddp(_demo.model(), device)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    for batch in _demo.batches(steps):
        x, y = (t.to(device) for t in _demo.shard(batch, rank, world_size))
        nn.functional.mse_loss(net(x), y).backward()
        opt.step()
        opt.zero_grad()
    return {k: v.detach().cpu() for k, v in net.module.state_dict().items()}


def single_process(steps: int) -> dict[str, torch.Tensor]:
    """The reference: the same model trained in this process on each whole global batch."""
    net = _demo.model()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    for x, y in _demo.batches(steps):
        nn.functional.mse_loss(net(x), y).backward()
        opt.step()
        opt.zero_grad()
    return {k: v.detach() for k, v in net.state_dict().items()}


@dataclass(frozen=True, repr=False)
class DdpVsSingle(TableView):
    """Per parameter: the largest difference between DDP's weights (each rank) and one process."""

    rows: tuple[tuple[str, int, float], ...]
    steps: int
    nproc: int
    ranks_identical: bool  # every rank holds bit-for-bit the same weights

    @property
    def max_difference(self) -> float:
        return max(d for _, _, d in self.rows)

    def table(self) -> Table:
        eps = torch.finfo(torch.float32).eps
        worst: dict[str, float] = {}
        for n, _r, d in self.rows:
            worst[n] = max(worst.get(n, 0.0), d)
        return Table(("parameter", "max |DDP - 1 process| (any rank)"),
                     [(n, f"{d:.1e}") for n, d in worst.items()],
                     caption=f"32-true: DDP on {self.nproc} ranks vs 1 process on the same global "
                             f"batch, after {self.steps} SGD steps",
                     notes=(f"largest difference {self.max_difference:.1e} (fp32 eps is "
                            f"{eps:.1e}): the mean of per-rank means is the global mean up to "
                            "rounding; every rank holds the same weights bit for bit: "
                            f"{'yes' if self.ranks_identical else 'NO'}",))


def _vs_single(values: tuple[dict[str, torch.Tensor], ...], steps: int) -> DdpVsSingle:
    ref = single_process(steps)
    rows = tuple((name, r, float((sd[name].float() - ref[name]).abs().max()))
                 for r, sd in enumerate(values) for name in ref)
    same = all(torch.equal(sd[n], values[0][n]) for sd in values for n in ref)
    return DdpVsSingle(rows, steps, len(values), same)


def vs_single_plan(steps: int = 3) -> Plan:
    """Train with DDP (32-true) on the ranks and in this process; compare the weights."""
    return Plan(_train, lambda values: _vs_single(values, steps), {"steps": steps})


def ddp_vs_single(nproc: int = 2, steps: int = 3, device: str = "cpu") -> DdpVsSingle:
    """Train with DDP (32-true) on nproc ranks and in one process; compare the weights."""
    return run_plan(vs_single_plan(steps), nproc, device)
