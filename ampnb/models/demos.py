"""Ready-to-train demos: a model, its optimizer, loss and batches, built from a seed."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ampnb.models.cnn import SmallCNN, bars
from ampnb.models.gpt import SequenceCrossEntropy, TinyGPT, corpus
from ampnb.models.mlp import MLP, spirals
from ampnb.putback import generator, rng_kept
from ampnb.putback import seed as putback_seed

Batches = list[tuple[torch.Tensor, torch.Tensor]]


# eq=False: comparing two demos would compare tensors, which has no single truth value.
@dataclass(frozen=True, eq=False)
class Demo:
    """A model with everything needed to train it; unpacks as (model, optimizer, loss_fn, batches)."""

    name: str
    model: nn.Module
    optimizer: torch.optim.Optimizer
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    batches: Batches = field(repr=False)

    def __iter__(self) -> Iterator[Any]:
        return iter((self.model, self.optimizer, self.loss_fn, self.batches))

    @property
    def n_params(self) -> int:
        """Distinct parameters (a tied weight counts once)."""
        return sum(p.numel() for p in self.model.parameters())

    def __repr__(self) -> str:
        x, _ = self.batches[0]
        return (f"Demo({self.name!r}: {type(self.model).__name__} with {self.n_params:,} "
                f"parameters, {type(self.optimizer).__name__}, {len(self.batches)} batches "
                f"of inputs {tuple(x.shape)} {str(x.dtype).removeprefix('torch.')})")


Built = tuple[nn.Module, Callable, Batches]


def _mlp(g: torch.Generator, width: int, depth: int, batch_size: int, n_batches: int) -> Built:
    model = MLP(in_features=2, width=width, depth=depth, n_classes=3)
    return model, nn.CrossEntropyLoss(), [spirals(batch_size, generator=g)
                                          for _ in range(n_batches)]


def _cnn(g: torch.Generator, width: int, batch_size: int, n_batches: int) -> Built:
    model = SmallCNN(width=width, n_classes=4, size=16)
    return model, nn.CrossEntropyLoss(), [bars(batch_size, size=16, generator=g)
                                          for _ in range(n_batches)]


def _gpt(g: torch.Generator, width: int, depth: int, n_head: int, batch_size: int,
         n_batches: int, seq_len: int) -> Built:
    text = corpus()
    model = TinyGPT(text.vocab_size, width=width, depth=depth, n_head=n_head, seq_len=seq_len)
    return model, SequenceCrossEntropy(), text.batches(n_batches, batch_size, seq_len, generator=g)


def _adam(params: Any, lr: float) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=lr)


def _adamw(params: Any, lr: float) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=lr, weight_decay=0.01)


@dataclass(frozen=True)
class DemoSpec:
    """A registered demo: what it is, how to build it, and its size knobs with defaults."""

    name: str
    description: str
    build: Callable[..., Built]
    optimizer: Callable[[Any, float], torch.optim.Optimizer]
    defaults: dict[str, Any]
    lr: float


DEMOS: dict[str, DemoSpec] = {s.name: s for s in (
    DemoSpec("mlp", "MLP classifier on three interleaved 2-D spirals", _mlp, _adam,
             dict(width=64, depth=2, batch_size=128, n_batches=8), lr=1e-2),
    DemoSpec("cnn", "small CNN on noisy 1×16×16 images of bars in 4 orientations", _cnn, _adam,
             dict(width=8, batch_size=64, n_batches=8), lr=3e-3),
    DemoSpec("gpt", "tiny character-level GPT on a short English story", _gpt, _adamw,
             dict(width=64, depth=2, n_head=4, batch_size=16, n_batches=8, seq_len=32),
             lr=3e-3),
)}


def _check_knobs(spec: DemoSpec, kw: dict[str, Any]) -> dict[str, Any]:
    unknown = sorted(set(kw) - set(spec.defaults))
    if unknown:
        raise ValueError(f"demo {spec.name!r} has no option {unknown[0]!r}; "
                         f"allowed: {', '.join(sorted(spec.defaults))}, seed, lr, device.")
    knobs = {**spec.defaults, **kw}
    for k, v in knobs.items():
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{k}={v!r} is not allowed; allowed: a positive integer.")
    return knobs


def demo(name: str, seed: int = 0, lr: float | None = None,
         device: str | torch.device = "cpu", **kw: Any) -> Demo:
    """Build the named demo, deterministically from seed; kw overrides its size knobs."""
    if name not in DEMOS:
        raise ValueError(f"unknown demo {name!r}; allowed: {', '.join(DEMOS)}.")
    spec = DEMOS[name]
    knobs = _check_knobs(spec, kw)
    if lr is not None and (isinstance(lr, bool) or not isinstance(lr, (int, float)) or lr <= 0):
        raise ValueError(f"lr={lr!r} is not allowed; allowed: a positive number.")
    device = torch.device(device)
    g = generator(seed)
    # Seed parameter initialisation without touching the user's global RNG stream.
    with rng_kept():
        putback_seed(seed, "cpu")
        model, loss_fn, batches = spec.build(g, **knobs)
    model = model.to(device)
    batches = [(x.to(device), y.to(device)) for x, y in batches]
    # Built after the move, so the optimizer holds the parameters that actually train.
    opt = spec.optimizer(model.parameters(), spec.lr if lr is None else lr)
    return Demo(name, model, opt, loss_fn, batches)


# Sizes per device type where the defaults teach the wrong lesson. On a GPU the 105K-parameter
# demo GPT is launch-bound (H200: 32-true 5.0 ms, bf16-mixed 5.8 ms): kernel launches, not
# arithmetic, set its step time. At ~100M parameters and 8K tokens a step its matmuls do, so
# bf16-mixed shows what tensor cores give (the 1.31B GPT-2 config: 5.6x over 32-true).
SIZED_FOR: dict[tuple[str, str], dict[str, Any]] = {
    ("gpt", "cuda"): dict(width=1024, depth=8, n_head=16, batch_size=32, n_batches=4, seq_len=256),
    ("mlp", "cuda"): dict(width=4096, depth=4, batch_size=4096, n_batches=4),
}


def demo_for(device: str | torch.device = "cpu", name: str = "gpt", seed: int = 0,
             lr: float | None = None, **kw: Any) -> Demo:
    """The named demo on `device`, sized for it: on a CPU as `demo` builds it, on a GPU large
    enough that bf16-mixed shows its tensor-core speedup over 32-true (SIZED_FOR); kw overrides."""
    kind = torch.device(device).type
    return demo(name, seed=seed, lr=lr, device=device, **{**SIZED_FOR.get((name, kind), {}), **kw})
