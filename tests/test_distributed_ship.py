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


def test_the_settings_go_as_plain_values_with_what_as_is_meant_here():
    from ampnb.device import TF32Setting, tf32_state
    from ampnb.distributed._ship import RankSettings
    from ampnb.fp16_kernels import Fp16Kernels
    from ampnb.precision import Precision
    from ampnb.step import StepSettings

    s = StepSettings(Precision.of("16-mixed", device="cpu"), TF32Setting.emulate,
                     Fp16Kernels.NATIVE, ("head",))
    shipped = RankSettings.of(s)
    assert shipped == RankSettings("16-mixed", "emulate", "native", ("head",), tf32_state())
    assert RankSettings.of(StepSettings(Precision.of("32-true", device="cpu"), None,
                                        Fp16Kernels.EMULATED)
                           ).fp16_kernels == "emulated"  # decided here, not by the rank's CPU
    payload = pack("", "1", "<cell>", {}, shipped)
    assert payload.mode == "16-mixed" and payload.settings is shipped
    assert pack("", "1", "<cell>", {}, "bf16-mixed").settings == RankSettings("bf16-mixed")


def test_a_line_that_needs_ipython_is_named_with_its_line():
    from ampnb.distributed._ship import ipython_lines

    shell = InteractiveShell.instance()
    source = shell.transform_cell("a = 1\n%time b = 2\n!ls -l\nc = !pwd\nd = 4\n")
    assert ipython_lines(source) == ["line 2 `%time`", "line 3 `!ls`", "line 4 `!pwd`"]
    with pytest.raises(ValueError, match="line 2 `%time`, line 3 `!ls`, line 4 `!pwd` need IPython"):
        pack(*split_cell(source), "<cell>", {}, source=source)
    assert ipython_lines("import os\nos.system('ls')\n") == []


def test_a_model_and_its_optimizer_stay_sharing_their_parameters():
    shell = InteractiveShell.instance()
    shell.run_cell("import torch\nnet = torch.nn.Linear(2, 2)\n"
                   "opt = torch.optim.SGD(net.parameters(), lr=0.1)\nother = torch.ones(1)\n")
    payload, ns = _rebuilt(shell, "opt.step()\nnet(other)")
    assert ns["opt"].param_groups[0]["params"][0] is ns["net"].weight  # a step moves the model
    assert ns["net"] is not shell.user_ns["net"] and payload.shared is not None
    assert _rebuilt(shell, "net(other)")[0].shared is None  # nothing shared: nothing sent twice
