"""A tiny character-level GPT (nanoGPT's shape, written with plain matmuls) and its corpus."""

from __future__ import annotations

import math
from dataclasses import dataclass
from importlib import resources

import torch
from torch import nn
from torch.nn import functional as F


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention where each position sees only itself and earlier ones."""

    def __init__(self, width: int, n_head: int, seq_len: int) -> None:
        super().__init__()
        if width % n_head:
            raise ValueError(f"width={width} must be divisible by n_head={n_head}.")
        self.n_head = n_head
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        mask = torch.ones(seq_len, seq_len, dtype=torch.bool).triu(1)
        self.register_buffer("future", mask, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        # Plain matmul + softmax (not F.scaled_dot_product_attention) so that tracers and
        # range probes see every step of attention, and autocast's per-op dtypes show.
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(k.size(-1))
        scores = scores.masked_fill(self.future[:t, :t], float("-inf"))
        y = scores.softmax(dim=-1) @ v
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class Block(nn.Module):
    """Pre-LayerNorm transformer block: attention then a GELU MLP, each with a residual."""

    def __init__(self, width: int, n_head: int, seq_len: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(width)
        self.attn = CausalSelfAttention(width, n_head, seq_len)
        self.ln2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(),
                                 nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


def _init_weights(module: nn.Module) -> None:
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)


class TinyGPT(nn.Module):
    """Token + position embeddings, a few blocks, and a head tied to the token embedding."""

    def __init__(self, vocab_size: int, width: int = 64, depth: int = 2, n_head: int = 4,
                 seq_len: int = 32) -> None:
        super().__init__()
        self.seq_len = seq_len
        self.tok = nn.Embedding(vocab_size, width)
        self.pos = nn.Embedding(seq_len, width)
        self.blocks = nn.Sequential(*(Block(width, n_head, seq_len) for _ in range(depth)))
        self.ln_f = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab_size, bias=False)
        self.head.weight = self.tok.weight  # weight tying, as in GPT-2 and nanoGPT
        # GPT-2's small normal init: torch's N(0, 1) embedding, reused as the tied head,
        # would start with logits in the tens and a loss far above log(vocab_size).
        self.apply(_init_weights)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Logits [batch, time, vocab] for token ids [batch, time]."""
        t = idx.size(1)
        if t > self.seq_len:
            raise ValueError(f"sequence length {t} exceeds seq_len={self.seq_len}.")
        pos = torch.arange(t, device=idx.device)
        return self.head(self.ln_f(self.blocks(self.tok(idx) + self.pos(pos))))

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, n_new: int,
                 generator: torch.Generator | None = None) -> torch.Tensor:
        """Token ids [B, T] extended by n_new tokens sampled from the model's predictions."""
        for _ in range(n_new):
            logits = self(idx[:, -self.seq_len:])[:, -1].float()
            probs = logits.softmax(-1)
            nxt = torch.multinomial(probs, 1, generator=generator)
            idx = torch.cat([idx, nxt], dim=1)
        return idx


class SequenceCrossEntropy(nn.Module):
    """Cross-entropy over every position: logits [B, T, V] against targets [B, T]."""

    def forward(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


@dataclass(frozen=True)
class CharCorpus:
    """A text and its character vocabulary, with encode/decode between them."""

    text: str

    @property
    def chars(self) -> str:
        return "".join(sorted(set(self.text)))

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def encode(self, s: str) -> torch.Tensor:
        index = {ch: i for i, ch in enumerate(self.chars)}
        unknown = sorted(set(s) - index.keys())
        if unknown:
            raise ValueError(f"characters {unknown!r} are not in the corpus vocabulary.")
        return torch.tensor([index[ch] for ch in s], dtype=torch.long)

    def decode(self, ids: torch.Tensor) -> str:
        return "".join(self.chars[i] for i in ids.tolist())

    def batches(self, n_batches: int, batch_size: int, seq_len: int,
                generator: torch.Generator | None = None) -> list[tuple[torch.Tensor, ...]]:
        """Random windows of the text: inputs [B, T] and the next characters as targets."""
        data = self.encode(self.text)
        if len(data) <= seq_len:
            raise ValueError(f"seq_len={seq_len} must be shorter than the corpus ({len(data)}).")
        out = []
        for _ in range(n_batches):
            start = torch.randint(0, len(data) - seq_len, (batch_size,), generator=generator)
            window = torch.stack([data[s:s + seq_len + 1] for s in start.tolist()])
            out.append((window[:, :-1], window[:, 1:]))
        return out


def corpus(name: str = "tiny_corpus.txt") -> CharCorpus:
    """The short English text shipped in ampnb/data, for character-level language models."""
    return CharCorpus(resources.files("ampnb").joinpath("data", name).read_text("utf-8"))
