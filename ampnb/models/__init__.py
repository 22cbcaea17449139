"""Small real demo models built in code (no downloads): an MLP, a CNN and a tiny GPT;
`demo_for(device)` sizes one for the device (a GPU gets one its tensor cores speed up)."""

from ampnb.models.cnn import SmallCNN, bars
from ampnb.models.demos import DEMOS, SIZED_FOR, Demo, DemoSpec, demo, demo_for
from ampnb.models.gpt import CharCorpus, TinyGPT, corpus
from ampnb.models.mlp import MLP, spirals

__all__ = ["DEMOS", "MLP", "SIZED_FOR", "CharCorpus", "Demo", "DemoSpec", "SmallCNN", "TinyGPT",
           "bars", "corpus", "demo", "demo_for", "spirals"]
