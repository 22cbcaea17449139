"""Small real demo models built in code (no downloads): an MLP, a CNN and a tiny GPT."""

from ampnb.models.cnn import SmallCNN, bars
from ampnb.models.demos import DEMOS, Demo, DemoSpec, demo
from ampnb.models.gpt import CharCorpus, TinyGPT, corpus
from ampnb.models.mlp import MLP, spirals

__all__ = ["DEMOS", "MLP", "CharCorpus", "Demo", "DemoSpec", "SmallCNN", "TinyGPT", "bars",
           "corpus", "demo", "spirals"]
