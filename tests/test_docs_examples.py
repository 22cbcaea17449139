"""The docs pages' examples are still tests: every ```python block is a cell IPython accepts, and
the examples that need only a model, its optimizer, loss and batches run on the demo MLP."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from ampnb import putback_state

DOCS = Path(__file__).resolve().parents[1] / "docs"
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
# (page, block index): examples whose names a demo's (model, optimizer, loss_fn, batches) give
RUN = {("modes.md", 0), ("scaler.md", 0), ("workbench.md", 0)}


def blocks() -> list[tuple[str, int, str]]:
    return [(p.name, i, b) for p in sorted(DOCS.glob("*.md"))
            for i, b in enumerate(BLOCK.findall(p.read_text()))]


@pytest.mark.parametrize(("page", "i", "code"),
                         [pytest.param(*b, id=f"{b[0]}-{b[1]}") for b in blocks()])
def test_every_python_block_is_a_cell_ipython_accepts(page, i, code):
    from IPython.core.inputtransformer2 import TransformerManager

    compile(TransformerManager().transform_cell(code), f"{page} block {i}", "exec")


def test_the_run_list_names_blocks_that_exist():
    found = {(page, i) for page, i, _ in blocks()}
    assert RUN <= found, sorted(RUN - found)


@pytest.mark.parametrize(("page", "i"), sorted(RUN))
def test_a_self_contained_example_runs(page, i):
    pytest.importorskip("ipywidgets")
    import ampnb
    from ampnb.models import demo

    (code,) = [c for p, k, c in blocks() if (p, k) == (page, i)]
    model, optimizer, loss_fn, batches = demo("mlp", seed=0)
    space = {"ampnb": ampnb, "torch": torch, "model": model, "optimizer": optimizer,
             "loss_fn": loss_fn, "batches": batches}
    before = putback_state.torch_state()
    exec(compile(code, f"{page} block {i}", "exec"), space)  # noqa: S102 - the page's own code
    assert putback_state.torch_state() == before
