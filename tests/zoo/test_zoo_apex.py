"""APEX O2 (fp16 weights but batch norm, fp32 masters) on every zoo model, through the Workbench."""

from __future__ import annotations

import warnings

import torch
from zoo_models import Case

from ampnb.apex import is_batchnorm, master_of
from ampnb.workbench import Workbench


def test_apex_o2_trains_fp32_masters_and_carries_them_back(case: Case):
    wb = Workbench(case.model, case.optimizer(), case.loss_fn, [case.batch], mode="apex-O2")
    record = wb.step()
    norms = {id(p) for m in wb.model.modules() if is_batchnorm(m) for p in m.parameters()}
    for p in wb.model.parameters():
        assert p.dtype == (torch.float32 if id(p) in norms else torch.float16)
    assert record.skipped or torch.isfinite(torch.tensor(record.loss))
    masters = {n: master_of(p).detach().clone() for n, p in wb.model.named_parameters()}
    assert all(m.dtype == torch.float32 for m in masters.values())
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the masters are carried: nothing lost to warn about
        wb.set(mode="32-true")
    assert all(torch.equal(p.detach(), masters[n]) for n, p in wb.model.named_parameters())
