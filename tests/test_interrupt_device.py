"""An interrupt at any line of the TF32 switch, default dtype and mode contexts changes nothing.

sys.settrace raises KeyboardInterrupt at the k-th line these modules execute, for every k; while
SIGINT is held (`_interrupt._hold` is its handler) the sweep calls that handler instead, as a
real signal would be held, and the deferred section raises it at its end.
"""

from __future__ import annotations

import signal
import sys
from collections.abc import Callable

import pytest
import torch

import ampnb.cpu
import ampnb.device.tf32_switch
import ampnb.modes.base
from ampnb import _interrupt, putback_state
from ampnb.device import (
    cpu_features,
    cpu_features_as,
    restore_tf32,
    set_tf32,
    tf32,
    tf32_context,
    tf32_state,
)
from ampnb.modes import MODES, default_dtype

SWEPT = {m.__file__ for m in (ampnb.device.tf32_switch, ampnb.cpu, ampnb.modes.base)}


def interrupt_at(k: int, body: Callable[[], None]) -> bool:
    """Run body with an interrupt at the k-th line run in SWEPT; whether that line was reached."""
    count, fired = 0, False

    def local(frame, event, arg):
        nonlocal count, fired
        if event == "line":
            count += 1
            if count == k:
                fired = True
                if signal.getsignal(signal.SIGINT) is _interrupt._hold:
                    _interrupt._hold(signal.SIGINT, frame)
                else:
                    raise KeyboardInterrupt
        return local

    def calls(frame, event, arg):
        return local if frame.f_code.co_filename in SWEPT else None

    sys.settrace(calls)
    try:
        body()
    except KeyboardInterrupt:
        pass
    finally:
        sys.settrace(None)
    return fired


def sweep(body: Callable[[], None], check: Callable[[], None] | None = None) -> int:
    """Interrupt body at each of its lines in turn; the global state is always as before."""
    before, features = putback_state.torch_state(), cpu_features()
    k = 0
    while True:
        k += 1
        reached = interrupt_at(k, body)
        assert putback_state.torch_state() == before, f"state changed by an interrupt at line {k}"
        assert cpu_features() == features and not ampnb.cpu._override, k
        assert not _interrupt._pending and not _interrupt.deferring(), k
        if check is not None:
            check()
        if not reached:
            return k


def _matmul() -> None:
    torch.ones(2, 3) @ torch.ones(3, 2)


def test_the_sweep_interrupts_where_it_should():
    seen = []
    assert interrupt_at(1, lambda: seen.append(set_tf32(True))) is True
    assert seen == []  # the interrupt came before set_tf32 returned
    assert interrupt_at(10_000, _matmul) is False


@pytest.mark.parametrize("enabled", [True, False])
def test_tf32_switch(enabled):
    def body():
        with tf32(enabled):
            _matmul()
    assert sweep(body) > 5


@pytest.mark.parametrize("setting", ["on", "off", "emulate", True, None])
def test_tf32_context(setting):
    def body():
        with tf32_context(setting, "cpu"):
            _matmul()
    assert sweep(body) > 1


def test_set_tf32_is_done_or_undone_and_restore_all_or_nothing():
    start = tf32_state()
    for enabled in (True, False):
        k = 0
        while True:  # set_tf32 alone: an interrupt leaves the flags as they were
            k += 1
            got = []
            reached = interrupt_at(k, lambda got=got, on=enabled: got.append(set_tf32(on)))
            if got:
                restore_tf32(got[0])
            assert tf32_state() == start, k
            if not reached:
                break
        changed = set_tf32(enabled)
        after_set = tf32_state()
        k = 0
        while True:  # restore alone: finished, or (interrupted before it began) not started
            k += 1
            reached = interrupt_at(k, lambda old=changed: restore_tf32(old))
            assert tf32_state() in (start, after_set), k
            if tf32_state() == after_set:
                restore_tf32(changed)
                set_tf32(enabled)
            if not reached:
                break
        restore_tf32(changed)
        assert tf32_state() == start


def test_default_dtype():
    def body():
        with default_dtype(torch.float64):
            torch.ones(1)
    assert sweep(body) > 1


@pytest.mark.parametrize("name", ["32-true", "16-mixed", "bf16-mixed", "16-true", "bf16-true", "64-true"])
def test_mode_contexts(name):
    mode = MODES[name]
    model, x = mode.convert_module(torch.nn.Linear(3, 2)), mode.convert_input(torch.ones(1, 3))

    def body():
        with mode.module_init_context():
            torch.nn.Linear(2, 2)
        with mode.forward_context("cpu"):
            model(x).sum()
    sweep(body)


def test_injected_cpu_features():
    def body():
        with cpu_features_as({"avx512_bf16"}), cpu_features_as(()):
            cpu_features()
    sweep(body)
