"""What `%%amp` does beside the user's own code: its probes run outside the user's torch modes,
`--compare` treats the user's generators as the global ones, and a default dtype the cell sets is
put back alike under every mode."""

from __future__ import annotations

import pytest
import torch
from _magics_kit import amp, shell_with_ampnb, shown
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

from ampnb import fp16_kernels
from ampnb.cpu import cpu_features_as
from ampnb.magics import runs
from ampnb.modes import MODES, get_mode


@pytest.fixture
def ip():
    yield from shell_with_ampnb()


CPU_MODES = [m for m in MODES if get_mode(m).availability("cpu").ok]


# ----- 8c: a default dtype the cell sets ------------------------------------------------------


@pytest.mark.parametrize("mode", CPU_MODES)
def test_a_default_dtype_set_in_the_cell_is_put_back_under_every_mode(ip, mode):
    before = torch.get_default_dtype()
    _, out = amp(ip, mode, "torch.set_default_dtype(torch.float64)\nmade = torch.ones(2).dtype")
    assert torch.get_default_dtype() == before
    assert ip.user_ns["made"] == torch.float64  # inside the cell, the cell's choice held
    said = "the cell set the default dtype to float64" in shown(out)
    assert said == (get_mode(mode).param_dtype != torch.float64)  # 64-true's cell starts there


def test_compare_puts_back_a_default_dtype_the_cell_sets_in_each_run(ip):
    before = torch.get_default_dtype()
    ip.run_cell("seen = []")
    amp(ip, "--compare bf16-mixed,bf16-true -q",
        "seen.append(torch.get_default_dtype())\ntorch.set_default_dtype(torch.float64)\n"
        "y = torch.ones(2)")
    assert torch.get_default_dtype() == before
    # each run started with the dtype its mode gives (bf16-true: bfloat16), none with float64
    assert set(ip.user_ns["seen"]) == {before, torch.bfloat16}


# ----- 8b: the user's generators under --compare -----------------------------------------------


def test_compare_starts_every_mode_from_the_users_generators_and_puts_them_back(ip):
    ip.run_cell("g = torch.Generator().manual_seed(5)\n"
                "loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.arange(8.)),"
                " batch_size=2, shuffle=True, generator=torch.Generator().manual_seed(6))")
    states = [ip.user_ns["g"].get_state(), ip.user_ns["loader"].generator.get_state()]
    value, _ = amp(ip, "--compare 32-true,bf16-mixed -q -o c",
                   "y = torch.randn(64, generator=g)\n"
                   "order = torch.cat([b for (b,) in loader])\n"
                   "(y, order)")
    rows = ip.user_ns["c"].comparison.rows
    assert len(rows) >= 2 and all(r.max_abs_error == 0.0 for r in rows)  # the same draws
    assert torch.equal(ip.user_ns["g"].get_state(), states[0])
    assert torch.equal(ip.user_ns["loader"].generator.get_state(), states[1])


# ----- 8a: probes outside the user's modes ------------------------------------------------------


class _Ops(TorchDispatchMode):
    """Counts every aten op it sees."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


CELL = "y = lin(x)"


def _first_cell(ip, mode_cls):
    """The kernel's first 16-mixed cell (its fp16 note not yet measured), under a user's mode."""
    fp16_kernels.native_slowdown.cache_clear()
    runs._support_note.cache_clear()
    with cpu_features_as(()), mode_cls() as seen:  # a CPU without fp16 units: the note measures
        amp(ip, "16-mixed --fp16-kernels emulated", CELL)
    return seen


def _plain(ip, mode_cls):
    with mode_cls() as seen, torch.autocast("cpu", dtype=torch.float16):
        ip.run_cell(CELL)
    return seen


def test_the_first_cells_probes_are_not_counted_by_a_users_flop_counter(ip):
    mine = _first_cell(ip, lambda: FlopCounterMode(display=False))
    plain = _plain(ip, lambda: FlopCounterMode(display=False))
    assert plain.get_total_flops() > 0
    assert mine.get_total_flops() == plain.get_total_flops()


def test_the_first_cells_probes_are_not_seen_by_a_users_dispatch_mode(ip):
    mine = _first_cell(ip, _Ops)
    plain = _plain(ip, _Ops)
    assert "aten.mm.default" not in mine.ops  # the probe's fp16 matmuls ran elsewhere
    assert sorted(mine.ops) == sorted(plain.ops)
