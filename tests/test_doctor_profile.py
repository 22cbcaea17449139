"""The doctor's profile reads kineto's raw events: the same ops, dtypes, calls and self times as
torch's own FunctionEvent tree, which it no longer builds (several steps' time on a transformer)."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile

from ampnb.diagnosis.profile import aten_ops


def test_aten_ops_match_torchs_function_events():
    torch.manual_seed(0)
    model = nn.TransformerEncoderLayer(32, 4, 64, batch_first=True)
    opt = torch.optim.AdamW(model.parameters())
    x = torch.randn(2, 8, 32)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        with torch.autocast("cpu", dtype=torch.bfloat16):  # re-dispatches ops: nested twice
            loss = model(x).float().pow(2).mean()
        loss.backward()
        opt.step()
    mine, calls = Counter(), Counter()
    for op in aten_ops(prof):
        mine[(op.name, op.input_dtypes[:1], tuple(map(tuple, op.input_shapes[:1])))] += op.self_s
        calls[op.name] += 1
    ref, ref_calls = Counter(), Counter()
    for e in prof.events():
        if e.name.startswith("aten::"):
            key = (e.name, tuple(e.input_dtypes[:1]), tuple(map(tuple, e.input_shapes[:1])))
            ref[key] += e.self_cpu_time_total * 1e-6
            ref_calls[e.name] += 1
    assert calls == ref_calls
    assert set(mine) == set(ref)
    for key in ref:
        assert mine[key] == pytest.approx(ref[key], abs=1e-9), key
    assert any(dt == ("c10::BFloat16",) for _, dt, _ in mine)
