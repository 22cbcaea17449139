"""Reduction precision at scale, by simulation: N ranks' gradients summed in fp32, bf16 or fp16.

Every addition is rounded into the reduce format with `ampnb.quantize` (what a collective
does when it adds two bf16 values: add in fp32, round once). "ring" adds rank after rank (the
order a ring all-reduce accumulates one chunk in); "tree" adds pairs, level by level. The
result is the mean (DDP divides by N: before the sum with `pre_divide`, else after), compared
with the exact mean of the fp32 gradients (in fp64).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ampnb.display import Table, TableView
from ampnb.distributed import _demo
from ampnb.distributed._plan import Plan, run_plan
from ampnb.formats import quantize
from ampnb.putback import generator

ORDERS = ("ring", "tree")
VARIANTS = (("fp32", False), ("bf16", False), ("fp16", False), ("fp16", True))


def rank_gradients(n: int, seed: int = 0) -> torch.Tensor:
    """[n, 512]: the demo MLP's first-layer weight gradient on n different samples (one per rank)."""
    from torch.func import functional_call, grad, vmap

    net = _demo.model()
    params = {k: v.detach() for k, v in net.named_parameters()}
    g = generator(seed)
    x, y = torch.randn(n, _demo.WIDTH, generator=g), torch.randn(n, 4, generator=g)

    def loss(p: dict, xi: torch.Tensor, yi: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.mse_loss(functional_call(net, p, (xi[None],)), yi[None])

    return vmap(grad(loss), in_dims=(None, 0, 0))(params, x, y)["0.weight"].reshape(n, -1)


def _round(x: torch.Tensor, fmt: str) -> torch.Tensor:
    return x if fmt == "fp32" else quantize(x, fmt)  # fp32 additions already round to fp32


def _inputs(grads: torch.Tensor, fmt: str, divisor: torch.Tensor) -> torch.Tensor:
    """Each rank's gradient in the reduce format, divided by N first where asked ([.., rows, P])."""
    return _round(_round(grads.float(), fmt)[..., None, :] / divisor[:, None], fmt)


def ring(grads: torch.Tensor, fmt: str, ranks: list[int], pre_divide: bool = False,
         mean: bool = True) -> torch.Tensor:
    """[len(ranks), P]: the mean (or sum) over the first N ranks for each N, rank after rank."""
    if not pre_divide:  # one chain: the sum over N ranks is a prefix of the sum over more
        xs = _round(grads[:max(ranks)].float(), fmt)
        acc, sums = xs[0], {1: xs[0]}
        for i in range(1, max(ranks)):
            acc = _round(acc + xs[i], fmt)
            if i + 1 in ranks:
                sums[i + 1] = acc
        return _finish(torch.stack([sums[n] for n in ranks]), fmt, ranks, pre_divide, mean)
    divisor = torch.tensor([float(n) for n in ranks])
    acc = _inputs(grads[:1], fmt, divisor)[0]
    for start in range(1, max(ranks), 256):  # inputs rounded in blocks: one quantize per step
        block = _inputs(grads[start:start + 256], fmt, divisor)
        for i, x in enumerate(block, start):
            active = sum(1 for n in ranks if n <= i)  # rows whose N is reached stop adding
            acc[active:] = _round(acc[active:] + x[active:], fmt)
    return _finish(acc, fmt, ranks, pre_divide, mean)


def tree(grads: torch.Tensor, fmt: str, ranks: list[int], pre_divide: bool = False,
         mean: bool = True) -> torch.Tensor:
    """[len(ranks), P]: the mean (or sum) over the first N ranks for each N, pairs level by level."""
    if not pre_divide and all(n & (n - 1) == 0 for n in ranks):
        # One tree over the most ranks: its first node at level k is the tree over 2**k ranks.
        x, sums = _round(grads[:max(ranks)].float(), fmt), {}
        while True:
            sums[max(ranks) // len(x)] = x[0]
            if len(x) == 1:
                break
            x = _round(x[0::2] + x[1::2], fmt)
        return _finish(torch.stack([sums[n] for n in ranks]), fmt, ranks, pre_divide, mean)
    rows = []
    for n in ranks:
        divisor = torch.tensor([float(n) if pre_divide else 1.0])
        x = _inputs(grads[:n], fmt, divisor)[:, 0]
        while len(x) > 1:
            odd = x[-1:] if len(x) % 2 else x[:0]
            x = torch.cat([_round(x[0:len(x) - 1:2] + x[1::2], fmt), odd])
        rows.append(x[0])
    return _finish(torch.stack(rows), fmt, ranks, pre_divide, mean)


def _finish(acc: torch.Tensor, fmt: str, ranks: list[int], pre_divide: bool, mean: bool
            ) -> torch.Tensor:
    if pre_divide or not mean:
        return acc
    return _round(acc / torch.tensor([float(n) for n in ranks])[:, None], fmt)


SIMULATORS = {"ring": ring, "tree": tree}


def simulate_allreduce(grads: torch.Tensor, fmt: str, order: str = "ring",
                       pre_divide: bool = False, mean: bool = True) -> torch.Tensor:
    """The all-reduce of grads ([N, ...], one row per rank) as simulated: the mean, or the sum."""
    if order not in SIMULATORS:
        raise ValueError(f"order must be one of {', '.join(SIMULATORS)}, got {order!r}")
    flat = grads.reshape(len(grads), -1)
    return SIMULATORS[order](flat, fmt, [len(grads)], pre_divide, mean)[0].reshape(grads.shape[1:])


@dataclass(frozen=True, repr=False)
class ReductionSweep(TableView):
    """Relative error of the reduced mean, per format, order, pre-divide and N."""

    rows: tuple[tuple[str, str, bool, int, float, float], ...]  # fmt, order, pre, N, error, bits

    def series(self) -> dict[tuple[str, str, bool], tuple[list[int], list[float]]]:
        """(fmt, order, pre_divide) -> (N values, relative errors)."""
        out: dict[tuple[str, str, bool], tuple[list[int], list[float]]] = {}
        for fmt, order, pre, n, err, _bits in self.rows:
            ns, errs = out.setdefault((fmt, order, pre), ([], []))
            ns.append(n)
            errs.append(err)
        return out

    def ranks_losing(self, bits: int) -> dict[tuple[str, str, bool], int | None]:
        """The smallest N at which each reduction has lost `bits` bits (None: not within the sweep)."""
        out: dict[tuple[str, str, bool], int | None] = {}
        for fmt, order, pre, n, _err, lost in self.rows:
            key = (fmt, order, pre)
            out.setdefault(key, None)
            if out[key] is None and lost >= bits:
                out[key] = n
        return out

    def table(self, bits: tuple[int, ...] = (1, 2, 3, 4)) -> Table:
        found = {k: self.ranks_losing(k) for k in bits}
        top = max(r[3] for r in self.rows)
        rows = []
        for key in self.series():
            fmt, order, pre = key
            label = f"{fmt}{' ÷N first' if pre else ''}"
            rows.append((label, order, *(f"{found[k][key]:,}" if found[k][key] else f"> {top:,}"
                                         for k in bits)))
        return Table(("reduce in", "order", *(f"N losing {k} bit{'s' * (k > 1)}" for k in bits)),
                     rows, caption="ranks at which the reduced gradient has lost k bits "
                                   "(error vs one rounding of the exact mean)")


def reduction_error(max_ranks: int = 16384, orders: tuple[str, ...] = ORDERS,
                    variants: tuple[tuple[str, bool], ...] = VARIANTS, seed: int = 0) -> ReductionSweep:
    """Simulate N = 2, 4, ..., max_ranks ranks' all-reduce of real demo gradients."""
    if max_ranks < 2:
        raise ValueError(f"max_ranks must be >= 2, got {max_ranks}")
    ranks = [2 ** k for k in range(1, int(math.log2(max_ranks)) + 1)]
    grads = rank_gradients(ranks[-1], seed)
    exact = torch.stack([grads[:n].double().mean(0) for n in ranks])
    rows = []
    for fmt, pre in variants:
        once = _round(exact.float(), fmt).double()  # the best a result in this format can be
        floor = ((once - exact).norm(dim=1) / exact.norm(dim=1)).clamp_min(1e-300)
        for order in orders:
            got = SIMULATORS[order](grads, fmt, ranks, pre).double()
            errs = (got - exact).norm(dim=1) / exact.norm(dim=1)
            for n, err, base in zip(ranks, errs.tolist(), floor.tolist()):
                lost = math.log2(err / base) if err > 0 and math.isfinite(err) else (
                    0.0 if err == 0 else math.inf)
                rows.append((fmt, order, pre, n, err, max(lost, 0.0)))
    return ReductionSweep(tuple(rows))


def _gloo_worker(rank: int, world_size: int, device: torch.device, grads: torch.Tensor) -> dict:
    import torch.distributed as dist

    out = {}
    for fmt, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16), ("fp16", torch.float16)):
        t = grads[rank].to(dtype).to(device, copy=True)  # all_reduce works in place
        dist.all_reduce(t)  # SUM, in the tensor's own dtype
        out[fmt] = t.cpu()
    return out


@dataclass(frozen=True, repr=False)
class GlooCheck(TableView):
    """The simulated sum next to gloo's real all-reduce of the same gradients."""

    rows: tuple[tuple[str, bool, int], ...]  # fmt, bit-for-bit equal, elements differing

    @property
    def equal(self) -> bool:
        return all(eq for _, eq, _ in self.rows)

    def table(self) -> Table:
        return Table(("dtype", "simulation == gloo all_reduce (bit for bit)", "elements differing"),
                     [(f, "yes" if eq else "NO", d) for f, eq, d in self.rows],
                     caption="2 ranks: the simulated ring sum vs torch.distributed.all_reduce (gloo)")


def _gloo_check(values: tuple[dict[str, torch.Tensor], ...], grads: torch.Tensor) -> GlooCheck:
    rows = []
    for fmt, got in values[0].items():
        sim = simulate_allreduce(grads, fmt, "ring", mean=False).to(got.dtype)
        bits = {2: torch.int16, 4: torch.int32}[got.element_size()]
        rows.append((fmt, torch.equal(sim.view(bits), got.view(bits)), int((sim != got).sum())))
    return GlooCheck(tuple(rows))


def gloo_plan(seed: int = 0) -> Plan:
    """The real all-reduce of 2 ranks' demo gradients, to compare with the simulation."""
    grads = rank_gradients(2, seed)
    return Plan(_gloo_worker, lambda values: _gloo_check(values, grads), {"grads": grads})


def check_against_gloo(seed: int = 0) -> GlooCheck:
    """Run the real gloo all-reduce on 2 ranks and compare it with the simulation, bit for bit."""
    return run_plan(gloo_plan(seed), 2, "cpu")
