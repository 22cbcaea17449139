"""Figures about hardware absent here, as data with their sources: cited, never measured by ampnb."""

from __future__ import annotations

from dataclasses import dataclass

from ampnb.display import Table


@dataclass(frozen=True)
class Cited:
    """One published figure: what was run, what it gave, and where it is written."""

    format: str
    figure: str
    setup: str
    source: str
    url: str


BLOCK_SCALED_GAINS: tuple[Cited, ...] = (
    Cited("MXFP8", "+20.0 % tokens/s over bf16 (mxfp8_cublas)",
          "torchtitan, Llama3-8B, 8x B200 (power limited), FSDP2, torch.compile",
          "torchao mx_formats README, training e2e benchmarks",
          "https://github.com/pytorch/ao/tree/main/torchao/prototype/mx_formats"),
    Cited("MXFP8", "1.22x to 1.28x over bf16, equivalent convergence",
          "torchtitan, Llama3-70B, up to 1,856 B200 GPUs (Crusoe)",
          "PyTorch blog: Accelerating 2K scale pre-training up to 1.28x with TorchAO, MXFP8 "
          "and TorchTitan on Crusoe B200 Cluster",
          "https://pytorch.org/blog/accelerating-2k-scale-pre-training-up-to-1-28x-with-torchao-"
          "mxfp8-and-torchtitan-on-crusoe-b200-cluster"),
    Cited("NVFP4", "MMLU-Pro 5-shot 62.58 % vs 62.62 % for the FP8 baseline",
          "12B hybrid Mamba-Transformer pretrained on 10T tokens (Blackwell)",
          "NVIDIA, Pretraining Large Language Models with NVFP4 (arXiv:2509.25149); "
          "Transformer Engine NVFP4 recipe",
          "https://arxiv.org/abs/2509.25149"),
)


def cited_table(rows: tuple[Cited, ...] = BLOCK_SCALED_GAINS) -> Table:
    """The figures as a table labelled cited: none was measured on this machine."""
    return Table(("format", "figure (cited)", "setup", "source"),
                 [(c.format, c.figure, c.setup, f"{c.source} <{c.url}>") for c in rows],
                 caption="What GPUs with block-scaled units gain: CITED from the sources, "
                         "not measured here",
                 notes=("ampnb emulates these formats on any device; it measures nothing about "
                        "hardware that is not present.",))
