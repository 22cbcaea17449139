"""The "Your own model" page's rows (docs/your_model.md, moved there from the README) say what
ampnb prints on the page's own GPT-2, and an overflow that `tanh` absorbs by accident is not
called deliberate."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from torch import nn

import ampnb

ROOT = Path(__file__).resolve().parents[1]
PAGE = (ROOT / "docs" / "your_model.md").read_text()


def _setup_code() -> str:
    """The page's block that builds the tiny GPT-2 and its `step`."""
    (block,) = [b for b in re.findall(r"^```python\n(.*?)^```", PAGE, re.S | re.M)
                if "GPT2LMHeadModel(GPT2Config(" in b and "step = " in b]
    return block


def _row(marker: str) -> str:
    """The quoted output in the page's table row whose first cell holds `marker`."""
    (line,) = [ln for ln in PAGE.splitlines() if ln.startswith("|") and marker in ln.split("|")[1]]
    return re.search(r"`([^`]*)`", line.split("|")[2]).group(1)


def _pattern(quoted: str) -> re.Pattern:
    """The quote as a pattern: each … stands for any text."""
    return re.compile(".*?".join(map(re.escape, quoted.split("…"))))


def test_the_fp16_overflow_row_is_what_find_nonfinite_prints():
    pytest.importorskip("transformers")
    space: dict = {}
    exec(_setup_code(), space)  # noqa: S102 - the page's own code
    model, batch = space["model"], space["batch"]
    with torch.no_grad():
        model.transformer.h[1].mlp.c_fc.weight.mul_(2000)

    def step():
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(**batch).loss
        loss.backward()

    report = ampnb.find_nonfinite(step)
    quoted = _row("mul_(2000)")
    assert report and _pattern(quoted).fullmatch(report.message), (quoted, report.message)


class SquashedCube(nn.Module):
    """GPT-2's GELU in miniature: x**3 overflows fp16 for |x| > 40, tanh squashes it back."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x.half() ** 3).float()


def test_an_overflow_tanh_absorbs_is_discarded_and_not_called_deliberate():
    x = torch.full((4,), 100.0)
    assert torch.isinf(x.half() ** 3).all() and torch.isfinite(SquashedCube()(x)).all()
    report = ampnb.find_nonfinite(lambda: SquashedCube()(x).sum())
    assert not report and [d.op for d in report.discarded] == ["pow"]
    assert "purpose" not in report.message and "deliberate" not in report.message.lower()
    assert "1 op made inf/NaN that was discarded before the end (a later op masked or absorbed" \
        in report.message


def test_the_quantize_model_row_is_what_its_report_says():
    pytest.importorskip("transformers")
    from ampnb import lowbit

    space: dict = {}
    exec(_setup_code(), space)  # noqa: S102 - the page's own code
    model = space["model"]
    (line,) = [ln for ln in PAGE.splitlines() if ln.startswith("| `q, report = lowbit.quantize")]
    call = re.search(r"`([^`]*)`", line).group(1)
    assert call == 'q, report = lowbit.quantize_model(model, "nf4")'
    q, report = lowbit.quantize_model(model, "nf4")
    assert q is not model  # a copy unless inplace=True, as the row says
    quoted = re.findall(r"`([^`]*)`", line.split("|")[2])[-1]
    assert _pattern(quoted).search(repr(report)), (quoted, repr(report))
