"""The doctor's streamed error figures against a direct float64 computation."""

from __future__ import annotations

import math

import pytest
import torch

from ampnb.diagnosis import errors
from ampnb.diagnosis.errors import compare


@pytest.fixture(autouse=True)
def _small_chunks(monkeypatch):
    monkeypatch.setattr(errors, "CHUNK", 7)  # several chunks, one ragged


def test_errors_match_float64_norms_across_chunks():
    g = torch.Generator().manual_seed(0)
    ref = torch.randn(5, 9, generator=g)
    got = ref.bfloat16().float()
    want = float((got.double() - ref.double()).norm() / ref.double().norm())
    e = compare(got, ref)
    assert e.rel == pytest.approx(want, rel=1e-12)
    assert e.sqnr_db == pytest.approx(-20 * math.log10(want), rel=1e-12)


def test_the_references_own_inf_nan_compare_equal_and_a_nonfinite_run_is_inf():
    ref = torch.arange(20, dtype=torch.float32)
    got = ref + 0.5
    ref_bad = ref.clone()
    ref_bad[3], ref_bad[15] = math.inf, math.nan
    got_same = got.clone()
    got_same[3], got_same[15] = 7.0, 8.0  # where the reference is inf/NaN: counted as equal
    keep = torch.ones(20, dtype=torch.bool)
    keep[[3, 15]] = False
    want = float((got_same[keep].double() - ref[keep].double()).norm()
                 / torch.cat([ref[keep].double(), got_same[~keep].double()]).norm())
    assert compare(got_same, ref_bad).rel == pytest.approx(want, rel=1e-12)
    got_bad = got.clone()
    got_bad[10] = math.inf
    assert compare(got_bad, ref).rel == math.inf
    assert compare(got_bad, ref_bad).rel == math.inf
