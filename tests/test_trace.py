"""trace_ops: op names, dtypes and module paths checked against what torch itself produces."""

from __future__ import annotations

import signal
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import ampnb
from ampnb import _interrupt, putback_state
from ampnb.instruments import hunt as hunt_module
from ampnb.instruments import trace as trace_module
from ampnb.instruments.trace import category, internal, is_internal
from ampnb.models.mlp import MLP


def _mlp() -> tuple[nn.Module, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    return MLP(width=8, depth=2), torch.randn(4, 2, generator=g)


def test_linear_under_bf16_autocast_is_a_bf16_addmm_in_its_module():
    lin, x = nn.Linear(4, 3), torch.randn(2, 4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = lin(x).dtype  # torch's own answer
    with ampnb.trace_ops() as t, torch.autocast("cpu", dtype=torch.bfloat16):
        lin(x)
    (row,) = t.select(op="addmm")
    assert row.output_dtype == str(expected).removeprefix("torch.") == "bfloat16"
    assert row.input_dtypes == ("bfloat16",) * 3
    assert row.module == "Linear" and row.phase == "forward"
    assert row.cast and row.cast_from == ("float32",) and row.category == "lowered"
    casts = t.select(op="_to_copy")
    assert len(casts) == 3 and all(r.category == "cast" for r in casts)


def test_module_paths_match_named_modules_forward_and_backward():
    model, x = _mlp()
    linears = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    with ampnb.trace_ops() as t, torch.autocast("cpu", dtype=torch.bfloat16):
        model(x).float().sum().backward()
    fwd = [r.module for r in t.select(op="addmm", phase="forward")]
    assert fwd == linears
    bwd = {r.module for r in t.select(op="mm", phase="backward")}
    assert bwd == set(linears)
    gelus = {r.module for r in t.select(op="gelu")}
    assert gelus == {n for n, m in model.named_modules() if isinstance(m, nn.GELU)}
    assert all(r.module == "" for r in t.select(op="sum", phase="forward"))  # outside the model


def test_fp32_run_keeps_everything_fp32_without_casts():
    model, x = _mlp()
    with ampnb.trace_ops() as t:
        model(x)
    c = t.counts
    assert c["lowered"] == c["cast"] == c["promoted"] == 0 and c["kept"] > 0
    assert all(not r.cast for r in t.rows)
    assert {r.output_dtype for r in t.select(op="addmm")} == {str(model(x).dtype)[6:]}


def test_mixed_dtypes_are_promoted_as_torch_promotes_them():
    a, b = torch.ones(3, dtype=torch.bfloat16), torch.ones(3)
    with ampnb.trace_ops() as t:
        a + b
    (row,) = t.select(op="add")
    assert row.output_dtype == str(torch.promote_types(a.dtype, b.dtype))[6:]
    assert row.category == "promoted"


@pytest.mark.parametrize("op, ins, out, cast_from, expected", [
    ("_to_copy", ("float32",), "bfloat16", (), "cast"),
    ("addmm", ("float16", "float16"), "float16", ("float32",), "lowered"),
    ("mm", ("float32", "float32"), "float32", (), "kept"),
    ("layer_norm", ("float32",), "float32", ("bfloat16",), "promoted"),
    ("add", ("float64", "float32"), "float64", (), "promoted"),
    ("argmax", ("float32",), "int64", (), "other"),
    ("_to_copy", ("int64",), "float32", (), "kept"),
])
def test_category_named_cases(op, ins, out, cast_from, expected):
    assert category(op, ins, out, cast_from) == expected


def test_counts_sum_to_all_ops_and_limit_caps_rows_only():
    model, x = _mlp()
    with ampnb.trace_ops(limit=3) as t:
        model(x)
    with ampnb.trace_ops() as full:
        model(x)
    assert len(t.rows) == 3 and t.rows == full.rows[:3]
    assert t.counts == full.counts and sum(t.counts.values()) == len(full.rows)
    assert "first 3 ops" in repr(t)


def test_state_and_hooks_restored_also_when_user_code_raises():
    model, x = _mlp()
    before = putback_state.torch_state()
    with pytest.raises(RuntimeError, match="boom"):
        with ampnb.trace_ops() as t, torch.autocast("cpu", dtype=torch.bfloat16):
            model(x)
            raise RuntimeError("boom")
    assert putback_state.torch_state() == before
    assert t.select(op="addmm")  # what ran before the error is kept
    with pytest.raises(RuntimeError):
        with ampnb.trace_ops():
            model(torch.randn(4, 5))  # shape error inside a module forward
    assert putback_state.torch_state() == before


def test_table_and_html_show_summary():
    lin, x = nn.Linear(4, 3), torch.randn(2, 4)
    with ampnb.trace_ops() as t, torch.autocast("cpu", dtype=torch.bfloat16):
        lin(x)
    html = t._repr_html_()
    assert "<table" in html and "addmm" in html and "bfloat16" in html
    assert t.summary().startswith(f"{len(t.rows)} ops: {t.counts['lowered']} ran in lower")


def test_bad_input_is_one_line_value_error():
    with pytest.raises(ValueError, match="limit must be an int >= 0, got -1"):
        ampnb.trace_ops(limit=-1)
    with ampnb.trace_ops() as t:
        pass
    with pytest.raises(ValueError, match="unknown category 'fast'; allowed: lowered"):
        t.select(category="fast")
    with pytest.raises(ValueError, match="unknown phase"):
        t.select(phase="sideways")
    assert t.rows == [] and sum(t.counts.values()) == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_fp16_autocast_addmm():
    lin, x = nn.Linear(8, 4).cuda(), torch.randn(2, 8, device="cuda")
    with ampnb.trace_ops() as t, torch.autocast("cuda", dtype=torch.float16):
        y = lin(x)
    (row,) = t.select(op="addmm")
    assert row.output_dtype == str(y.dtype)[6:] == "float16" and row.cast


def test_int_to_float_cast_then_arithmetic_is_traced():
    with ampnb.trace_ops() as t:  # LLaMA's rotary embedding does this
        y = torch.arange(4).float() * 2
    (cast,) = t.select(op="_to_copy")
    (mul,) = t.select(op="mul")
    assert cast.input_dtypes == ("int64",) and cast.output_dtype == str(y.dtype)[6:]
    assert cast.category == "kept"  # an int becoming a float is no autocast precision cast
    assert mul.output_dtype == "float32" and mul.category == "kept" and not mul.cast


_OWN = tuple(str(Path(m.__file__)) for m in (trace_module, hunt_module))


def _interrupt_at(k: int, fn, files: tuple[str, ...] = _OWN) -> int:
    """Run fn, delivering SIGINT at the k-th line run in `files` (as Jupyter's interrupt
    would: the installed handler runs, so a deferred section holds it); returns lines seen."""
    seen = [0]

    def local(frame, event, arg):
        if event == "line":
            seen[0] += 1
            if seen[0] == k:
                handler = signal.getsignal(signal.SIGINT)
                handler(signal.SIGINT, frame)  # default_int_handler raises, _hold records
        return local

    previous = sys.gettrace()
    sys.settrace(lambda frame, event, arg: local if frame.f_code.co_filename in files else None)
    try:
        fn()
    except KeyboardInterrupt:
        pass
    finally:
        sys.settrace(previous)
    return seen[0]


def test_an_interrupt_at_any_line_leaves_no_stuck_counter_hook_or_mode():
    lin, x = nn.Linear(4, 3), torch.randn(2, 4)

    def cell():
        with ampnb.trace_ops(), torch.autocast("cpu", dtype=torch.bfloat16):
            lin(x)
        with internal():
            torch.ones(1)
        ampnb.find_nonfinite(lambda: lin(x).sum().backward())

    before = putback_state.torch_state()
    total = _interrupt_at(0, cell)
    assert total > 50
    for k in range(1, total + 1):
        _interrupt_at(k, cell)
        assert putback_state.torch_state() == before, f"state changed after an interrupt at line {k}"
        assert not is_internal() and not _interrupt._pending, f"line {k}"
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
        with ampnb.trace_ops() as t:
            torch.ones(2) * 2
        assert t.rows, f"a trace after an interrupt at line {k} saw no ops"


def _step(model: nn.Module, x: torch.Tensor) -> None:
    model.zero_grad(set_to_none=True)  # each trace sees the same first backward
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(x).float().sum().backward()


def test_summary_detail_counts_what_the_full_trace_counts_without_module_hooks():
    from torch.nn.modules import module as nn_module
    model, x = _mlp()
    with ampnb.trace_ops() as full:
        _step(model, x)
    hooks = []
    with ampnb.trace_ops(detail="summary") as fast:
        hooks.append(len(nn_module._global_forward_pre_hooks) + len(nn_module._global_forward_hooks))
        _step(model, x)

    def without_module(t):
        out = {}
        for r, n in t.grouped.items():
            key = (r.op, r.phase, r.input_dtypes, r.output_dtype, r.cast_from, r.category)
            out[key] = out.get(key, 0) + n
        return out

    assert without_module(fast) == without_module(full) and fast.counts == full.counts
    assert fast.summary() == full.summary() and fast.rows == []
    assert {r.module for r in fast.grouped} == {""} and hooks == [0]
    with pytest.raises(ValueError, match="detail='full'"):
        fast.select(op="addmm")
    assert "rows keeps" not in fast.table()._repr_html_()


def test_trace_detail_must_be_one_of_the_named_ones():
    with pytest.raises(ValueError, match="allowed: full, summary") as e:
        ampnb.trace_ops(detail="short")
    assert "\n" not in str(e.value)
