"""The zoo: tiny models built from `transformers` configs (random init, no download) + an LSTM.

Each case is a model in train() mode (dropout on, as transformers builds them), one batch in
the form its users pass it, and the loss_fn (None: the model's own ModelOutput.loss).
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


@dataclass(frozen=True)
class Case:
    """A zoo model with one batch; loss_fn None means the model computes its own loss."""

    name: str
    model: nn.Module
    batch: Any
    loss_fn: Callable[..., torch.Tensor] | None
    architecture: str

    def optimizer(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.model.parameters(), lr=1e-3)


def _tokens(gen: torch.Generator, vocab: int, batch: int = 2, seq: int = 16) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, seq), generator=gen)


def gpt2() -> Case:
    """Decoder with Conv1D projections, tied embeddings and dropout."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=128, n_positions=32, n_embd=64, n_layer=2,
                                       n_head=2)).train()
    ids = _tokens(torch.Generator().manual_seed(1), 128)
    return Case("gpt2", model, {"input_ids": ids, "labels": ids}, None,
                "decoder, Conv1D, tied weights, dropout")


def bert() -> Case:
    """Encoder called with keyword arguments (input_ids, attention_mask, labels)."""
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    model = BertForSequenceClassification(BertConfig(
        vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=128, max_position_embeddings=32, num_labels=3)).train()
    gen = torch.Generator().manual_seed(2)
    ids = _tokens(gen, 128)
    mask = torch.ones_like(ids)
    mask[1, 12:] = 0
    labels = torch.randint(0, 3, (2,), generator=gen)
    return Case("bert", model, {"input_ids": ids, "attention_mask": mask, "labels": labels}, None,
                "encoder, keyword inputs, attention mask")


def llama() -> Case:
    """LLaMA family: rotary embeddings (an int arange cast to float), grouped-query attention."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)).train()
    ids = _tokens(torch.Generator().manual_seed(3), 128)
    return Case("llama", model, {"input_ids": ids, "labels": ids}, None,
                "rotary, grouped-query attention, RMSNorm")


def vit() -> Case:
    """Vision transformer: patch convolution, pixel_values in, logits out, loss_fn outside."""
    from transformers import ViTConfig, ViTForImageClassification

    torch.manual_seed(0)
    model = ViTForImageClassification(ViTConfig(
        image_size=16, patch_size=4, num_channels=3, hidden_size=64, num_hidden_layers=2,
        num_attention_heads=2, intermediate_size=128, num_labels=4)).train()
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(2, 3, 16, 16, generator=gen)
    y = torch.randint(0, 4, (2,), generator=gen)
    return Case("vit", model, (x, y), lambda out, t: nn.functional.cross_entropy(out.logits, t),
                "vision transformer, (inputs, targets) with a loss_fn on .logits")


def resnet() -> Case:
    """A BatchNorm CNN (transformers' ResNet): running statistics change in train mode."""
    from transformers import ResNetConfig, ResNetForImageClassification

    torch.manual_seed(0)
    model = ResNetForImageClassification(ResNetConfig(
        num_channels=3, embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1],
        layer_type="basic", num_labels=4)).train()
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(2, 3, 32, 32, generator=gen)
    y = torch.randint(0, 4, (2,), generator=gen)
    return Case("resnet", model, {"pixel_values": x, "labels": y}, None,
                "BatchNorm CNN, keyword inputs, model's own loss")


class LSTMTagger(nn.Module):
    """A plain nn.LSTM over embeddings with a linear head (returns logits)."""

    def __init__(self, vocab: int = 64, hidden: int = 32, classes: int = 5) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.lstm = nn.LSTM(hidden, hidden, num_layers=2, batch_first=True)
        self.head = nn.Linear(hidden, classes)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out, _ = self.lstm(self.embed(ids))
        return self.head(out[:, -1])


def lstm() -> Case:
    """A plain nn.LSTM model: positional tensor input, (inputs, targets) with a loss_fn."""
    torch.manual_seed(0)
    model = LSTMTagger().train()
    gen = torch.Generator().manual_seed(6)
    return Case("lstm", model, (_tokens(gen, 64, seq=8), torch.randint(0, 5, (2,), generator=gen)),
                nn.functional.cross_entropy, "nn.LSTM, positional input")


BUILDERS: dict[str, Callable[[], Case]] = {
    "gpt2": gpt2, "bert": bert, "llama": llama, "vit": vit, "resnet": resnet, "lstm": lstm}
HF = ("gpt2", "bert", "llama", "vit", "resnet")


def matmul_layers(model: nn.Module) -> dict[str, nn.Module]:
    """Every nn.Linear and transformers Conv1D by name, found by plain isinstance checks."""
    from transformers.pytorch_utils import Conv1D

    return {n: m for n, m in model.named_modules()
            if type(m) is nn.Linear or isinstance(m, Conv1D)}


def others_by_type(model: nn.Module) -> tuple[tuple[str, int], ...]:
    """Modules with parameters of their own that are not matmul layers, counted by type."""
    mm = set(map(id, matmul_layers(model).values()))
    counts = Counter(type(m).__name__ for m in model.modules()
                     if id(m) not in mm and list(m.parameters(recurse=False)))
    return tuple(sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))
