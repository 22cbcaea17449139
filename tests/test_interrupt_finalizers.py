"""No interrupt is lost in a finalizer: Ctrl-C during `%%amp --memory` or the doctor always
reaches the caller.

Python discards an exception raised in `__del__` or a weakref callback ("Exception ignored
in ..."), so a KeyboardInterrupt landing in ampnb code run there would vanish. ampnb runs no
Python code in finalizers; these tests check the source for finalizers, and deliver an
interrupt at sampled lines of ampnb's own code (tests/_sweep.py), also where autograd frees
the tensors saved for backward, and check that every one reaches the caller.
"""

from __future__ import annotations

import ast
import os
from pathlib import Path

import pytest
import torch
from _magics_kit import loaded_shell
from _sweep import PACKAGE, sweep
from doctor_models import Plain, data
from IPython.utils.capture import capture_output
from torch import nn

import ampnb
from ampnb import _interrupt, putback_state

BUDGET = int(os.environ.get("AMPNB_SWEEP_BUDGET", "60")) or 10**9
_WEAK = {"ref", "proxy", "WeakMethod", "finalize"}
# torch's and the standard library's weak containers drop dead keys from a Python callback.
_WEAK_CONTAINERS = {"WeakIdKeyDictionary", "WeakKeyDictionary", "WeakValueDictionary",
                    "WeakSet", "WeakTensorKeyDictionary"}


def _finalizers(source: str) -> list[str]:
    """`__del__` methods, `weakref.finalize`, and weak references whose callback is not a
    builtin list's `append` (the one callback that runs no Python code)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef) and node.name == "__del__":
            found.append(f"line {node.lineno}: def __del__")
        if not isinstance(node, ast.Call):
            continue
        name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(
            node.func, "id", "")
        if name in _WEAK_CONTAINERS:
            found.append(f"line {node.lineno}: {name}() removes dead keys in a Python callback")
            continue
        if name not in _WEAK:
            continue
        callback = node.args[1] if len(node.args) > 1 else next(
            (k.value for k in node.keywords if k.arg == "callback"), None)
        if name == "finalize" or (callback is not None and not (
                isinstance(callback, ast.Attribute) and callback.attr == "append")):
            found.append(f"line {node.lineno}: {ast.unparse(node)}")
    return found


def test_the_finalizer_check_finds_each_kind():
    source = ("class A:\n    def __del__(self): pass\n"
              "weakref.finalize(a, f)\nweakref.ref(a, lambda r: None)\n"
              "weakref.ref(a, callback=forget)\nweakref.ref(a, dead.append)\nweakref.ref(a)\n"
              "m = WeakIdKeyDictionary()\n")
    assert [f.split(":")[0] for f in _finalizers(source)] == ["line 2", "line 3", "line 4",
                                                              "line 5", "line 8"]


def test_no_ampnb_code_runs_in_a_finalizer():
    found = {str(p.relative_to(PACKAGE)): f for p in sorted(Path(PACKAGE).rglob("*.py"))
             if (f := _finalizers(p.read_text()))}
    assert not found, f"finalizers running ampnb code (an interrupt there is lost): {found}"


def lost_interrupts(fn, budget: int) -> tuple[int, list[str]]:
    """Interrupt fn at sampled ampnb lines; returns (points tried, interrupts that were lost
    or left torch state behind)."""
    def check(before: putback_state.TorchState) -> list[str]:
        problems = ["the interrupt was still held after the run"] if _interrupt._pending else []
        _interrupt._pending.clear()
        after = putback_state.torch_state()
        changed = [k for k in before.__dataclass_fields__ if getattr(before, k) != getattr(after, k)]
        return problems + ([f"torch state changed: {', '.join(changed)}"] if changed else [])

    return sweep(putback_state.torch_state, lambda _: fn(), check, budget)


ip = pytest.fixture(scope="module", name="ip")(loaded_shell)


def test_every_interrupt_during_amp_memory_reaches_the_caller(ip):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(),
                          nn.Linear(16, 4))
    ip.user_ns.update(model=model, x=torch.randn(4, 8))
    cell = "for _ in range(2):\n    model(x).sum().backward()\n"

    def run():
        with capture_output():
            ip.run_cell_magic("amp", "bf16-mixed --memory -q", cell)

    tried, lost = lost_interrupts(run, BUDGET)
    assert tried > 10
    assert not lost, f"{len(lost)} of {tried} interrupts lost:\n" + "\n".join(lost[:10])


def test_every_interrupt_during_the_doctor_reaches_the_caller():
    x, y = data()

    def run():
        ampnb.doctor(Plain(), (x, y), nn.functional.cross_entropy,
                     modes=("32-true", "bf16-mixed"), repeat=1, profile=False)

    tried, lost = lost_interrupts(run, BUDGET)
    assert tried > 10
    assert not lost, f"{len(lost)} of {tried} interrupts lost:\n" + "\n".join(lost[:10])


def test_an_interrupt_in_another_librarys_gc_callback_is_not_ampnbs_leak():
    """A garbage-collector callback of another library (hypothesis registers one) loses an
    interrupt that lands in it whatever ampnb does: the sweep does not count it; one of ampnb's
    own functions losing it would be counted."""
    import gc
    import sys

    from _sweep import _foreign_finalizer

    from ampnb.formats import get_format

    def callback(phase, info):
        raise KeyboardInterrupt

    lost = []
    previous, sys.unraisablehook = sys.unraisablehook, lost.append
    gc.callbacks.append(callback)
    try:
        gc.collect()
    finally:
        gc.callbacks.remove(callback)
        sys.unraisablehook = previous
    assert lost and all(u.object is callback for u in lost)
    assert _foreign_finalizer(lost[0].object) and not _foreign_finalizer(get_format)
