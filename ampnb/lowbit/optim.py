"""bitsandbytes' Adam8bit, emulated: Adam's two moments in the dynamic 8-bit map, block-wise."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from ampnb.lowbit.blockwise import dequantize_blockwise, dynamic_map, quantize_blockwise

# bitsandbytes/optim/optimizer.py: 8-bit state only for tensors of at least this many values,
# in blocks of 256 (the 8-bit optimizers paper used 2048; today's kernels use 256).
MIN_8BIT_SIZE = 4096
BLOCKSIZE = 256


def _number(x: Any) -> bool:
    """A real number (a one-value tensor too, as torch's optimizers take for lr), not NaN."""
    if isinstance(x, torch.Tensor):
        return x.numel() == 1 and not x.is_complex() and not bool(x.isnan())
    return isinstance(x, (int, float)) and not isinstance(x, bool) and not math.isnan(x)


def _integer(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


class Adam8bit(torch.optim.Optimizer):
    """Adam whose exp_avg (signed map) and exp_avg_sq (unsigned map) are stored in 8 bits.

    As `bitsandbytes.optim.Adam8bit`: each step dequantizes both moments to fp32 (code value x
    block absmax), updates them and the weight in fp32, and quantizes them back. Tensors smaller
    than `min_8bit_size` keep fp32 state. A param group with `optim_bits=32` keeps fp32 state
    (bitsandbytes' `register_module_override(emb, "weight", {"optim_bits": 32})`; see
    `param_groups`). weight_decay is decoupled (p *= 1 - lr*wd), as bitsandbytes does it.
    """

    def __init__(self, params: Any, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, optim_bits: int = 8,
                 min_8bit_size: int = MIN_8BIT_SIZE, blocksize: int = BLOCKSIZE) -> None:
        pair = isinstance(betas, (tuple, list)) and len(betas) == 2
        for name, value, ok, allowed in (
                ("lr", lr, _number(lr) and lr >= 0, "a number >= 0"),
                ("betas", betas, pair and all(_number(b) and 0 <= b < 1 for b in betas),
                 "two numbers in [0, 1)"),
                ("eps", eps, _number(eps) and eps >= 0, "a number >= 0"),
                ("weight_decay", weight_decay, _number(weight_decay) and weight_decay >= 0,
                 "a number >= 0"),
                ("optim_bits", optim_bits, optim_bits in (8, 32), "8 or 32"),
                ("min_8bit_size", min_8bit_size, _integer(min_8bit_size) and min_8bit_size >= 0,
                 "an integer >= 0"),
                ("blocksize", blocksize, _integer(blocksize) and blocksize > 0, "a positive integer")):
            if not ok:
                raise ValueError(f"{name}={value!r} is not allowed; allowed: {allowed}")
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                                      optim_bits=optim_bits, min_8bit_size=min_8bit_size,
                                      blocksize=blocksize))
        for g in self.param_groups:
            if g["optim_bits"] not in (8, 32):
                raise ValueError(f"optim_bits={g['optim_bits']!r} in a param group is not allowed; "
                                 f"allowed: 8 or 32")

    @staticmethod
    def is_8bit(p: torch.Tensor, group: dict[str, Any]) -> bool:
        """Whether p's state is kept in 8 bits under this group's settings."""
        return group["optim_bits"] == 8 and p.numel() >= group["min_8bit_size"]

    def _init(self, p: torch.Tensor, group: dict[str, Any]) -> dict[str, Any]:
        state = self.state[p]
        state["step"] = torch.tensor(0.0)
        if self.is_8bit(p, group):
            blocks = math.ceil(p.numel() / group["blocksize"])
            for key in ("exp_avg", "exp_avg_sq"):
                state[f"{key}_codes"] = torch.zeros_like(p, dtype=torch.uint8)
                state[f"{key}_absmax"] = torch.zeros(blocks, dtype=torch.float32, device=p.device)
        else:
            state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32)
            state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32)
        return state

    def moments(self, p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(exp_avg, exp_avg_sq) of p in fp32, as the next step will read them."""
        state, group = self.state[p], self._group(p)
        if "exp_avg" in state:
            return state["exp_avg"], state["exp_avg_sq"]
        bs = group["blocksize"]
        return tuple(dequantize_blockwise(state[f"{k}_codes"], state[f"{k}_absmax"], dynamic_map(signed), bs)
                     for k, signed in (("exp_avg", True), ("exp_avg_sq", False)))

    def _group(self, p: torch.Tensor) -> dict[str, Any]:
        return next(g for g in self.param_groups if any(q is p for q in g["params"]))

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            lr, eps, wd, bs = group["lr"], group["eps"], group["weight_decay"], group["blocksize"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p] if self.state[p] else self._init(p, group)
                state["step"] += 1
                t = int(state["step"].item())
                m, v = (t.clone() for t in self.moments(p)) if "exp_avg_codes" in state \
                    else (state["exp_avg"], state["exp_avg_sq"])
                g = p.grad.float()
                m.mul_(beta1).add_(g, alpha=1 - beta1)
                v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
                denom = (v.sqrt() / math.sqrt(1 - beta2 ** t)).add_(eps)
                w = p.float()
                if wd:
                    w.mul_(1 - lr * wd)
                w.addcdiv_(m, denom, value=-lr / (1 - beta1 ** t))
                p.copy_(w)
                if "exp_avg_codes" in state:
                    for key, value, signed in (("exp_avg", m, True), ("exp_avg_sq", v, False)):
                        codes, absmax = quantize_blockwise(value, dynamic_map(signed), bs)
                        state[f"{key}_codes"].copy_(codes)
                        state[f"{key}_absmax"].copy_(absmax)
        return loss

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # torch casts every floating point param's state to the param's dtype: the uint8 codes
        # and fp32 absmax are put back in their own dtypes (exact: codes are 0..255).
        dtypes = {(i, k): v.dtype for i, s in state_dict["state"].items() for k, v in s.items()
                  if isinstance(v, torch.Tensor)}
        super().load_state_dict(state_dict)
        params = [p for g in self.param_groups for p in g["params"]]
        index = {id(p): i for i, p in enumerate(params)}
        for p, s in self.state.items():
            for k, v in s.items():
                want = dtypes.get((index[id(p)], k))
                if want is not None and isinstance(v, torch.Tensor) and v.dtype != want:
                    s[k] = v.to(want)


def param_groups(model: nn.Module, keep_32bit: Iterable[type[nn.Module] | str] = (nn.Embedding,)
                 ) -> list[dict[str, Any]]:
    """Param groups for Adam8bit: parameters of modules matching keep_32bit (a type or a name
    prefix) get `optim_bits=32`, the rest take the optimizer's default (8 bits)."""
    if not isinstance(model, nn.Module):
        raise ValueError(f"param_groups got a {type(model).__name__} as the model; allowed: an "
                         "nn.Module (the model the optimizer will train)")
    one = isinstance(keep_32bit, str) or isinstance(keep_32bit, type)
    keep = (keep_32bit,) if one else tuple(keep_32bit) if isinstance(keep_32bit, Iterable) else None
    if keep is None:
        raise ValueError(f"keep_32bit={keep_32bit!r} is not allowed; allowed: nn.Module types or "
                         "module name prefixes, e.g. (nn.Embedding, 'tok')")
    bad = [k for k in keep if not (isinstance(k, str) or (isinstance(k, type) and issubclass(k, nn.Module)))]
    if bad:
        raise ValueError(f"keep_32bit entry {bad[0]!r} is not allowed; allowed: an nn.Module type "
                         f"(e.g. nn.Embedding) or a module name prefix (e.g. 'tok')")
    wide, seen = [], set()
    for name, m in model.named_modules():
        if any(isinstance(m, k) if isinstance(k, type) else name.startswith(k) for k in keep):
            for p in m.parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    wide.append(p)
    rest = [p for p in model.parameters() if id(p) not in seen]
    return [g for g in ({"params": rest}, {"params": wide, "optim_bits": 32}) if g["params"]]
