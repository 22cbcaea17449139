"""What a cell needs from the notebook, packed and rebuilt (in this process: no ranks started)."""

from __future__ import annotations

import threading

import pytest
import torch
from IPython.core.interactiveshell import InteractiveShell

from ampnb.distributed._ship import pack, split_cell, unpack


@pytest.fixture(autouse=True)
def _clean_shell():
    shell = InteractiveShell.instance()
    names = set(shell.user_ns)
    yield
    for name in set(shell.user_ns) - names:
        shell.user_ns.pop(name, None)


def _rebuilt(shell, source):
    body, last = split_cell(source)
    payload = pack(body, last, "<cell>", shell.user_ns, source=source)
    ns = {}
    unpack(payload, ns)
    return payload, ns


def test_notebook_functions_classes_values_and_modules_are_sent():
    shell = InteractiveShell.instance()
    shell.run_cell("import torch\nclass Net(torch.nn.Linear):\n    pass\n"
                   "def make():\n    return Net(2, 3)\nnet = make()\nunused = threading_lock = None\n")
    payload, ns = _rebuilt(shell, "y = net(torch.ones(2))\nmake()")
    assert {i.name for i in payload.items} == {"torch", "net", "make", "Net"}
    assert ns["torch"] is torch and isinstance(ns["make"](), ns["Net"])
    assert torch.equal(ns["net"].weight, shell.user_ns["net"].weight)


def test_a_name_the_cell_binds_itself_is_skipped_when_it_cannot_be_sent():
    shell = InteractiveShell.instance()
    shell.user_ns["box"] = threading.Lock()
    payload, _ = _rebuilt(shell, "box = 1\nbox")
    assert "box" not in {i.name for i in payload.items}
    with pytest.raises(ValueError, match="`box` \\(lock\\) cannot be sent"):
        _rebuilt(shell, "with box:\n    pass\n")


def test_split_keeps_the_cells_line_numbers():
    body, last = split_cell("a = 1\nb = 2; a + \\\n  b")
    assert body == "a = 1\nb = 2; " and last.startswith("\na + ")  # still on line 2
    assert eval(compile(last, "<c>", "eval"), {"a": 1, "b": 2}) == 3
