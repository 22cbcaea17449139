"""Checks of arguments whose errors name the bad value (below `apex` and the modes, which share them)."""

from __future__ import annotations

from typing import Any

from torch import nn


def shown(value: Any) -> str:
    """A bad value for a one-line message: its repr when short, else its type."""
    text = repr(value)
    return text if len(text) <= 40 and "\n" not in text else f"a {type(value).__name__}"


def needs_module(module: Any, call: str) -> None:
    """ValueError naming the bad value unless module is an nn.Module."""
    if not isinstance(module, nn.Module):
        raise ValueError(f"{call} got {shown(module)}; allowed: an nn.Module")
