"""Lightning 1.x's precision spellings: get_mode, explain_precision and --show-code read them."""

from __future__ import annotations

import pytest
import torch
from _magics_kit import amp as _amp
from _magics_kit import shell_with_ampnb

import ampnb
from ampnb.legacy import PRECISION, explain_precision, parse_call
from ampnb.modes import MODES, get_mode

# Lightning 1.x call -> the ampnb mode that runs what it meant.
CALLS = {
    "Trainer(gpus=1, precision=16)": "16-mixed",
    "Trainer(precision='16')": "16-mixed",
    "Trainer(precision='bf16')": "bf16-mixed",
    "Trainer(precision=32)": "32-true",
    "Trainer(precision=64)": "64-true",
    "Trainer(gpus=1, precision=16, amp_backend='apex')": "apex-O2",  # amp_level defaulted to O2
    "Trainer(gpus=1, precision=16, amp_backend='apex', amp_level='O1')": "apex-O1",
    "pl.Trainer(precision=16, amp_backend='apex', amp_level='O3')": "apex-O3",
    "Trainer(precision=16, amp_backend='native')": "16-mixed",
    "Trainer(tpu_cores=8, precision=16)": "bf16-true",  # XLA_USE_BF16: every float tensor bf16
    "Trainer(accelerator='tpu', precision='bf16')": "bf16-true",
    "precision=16, amp_backend='apex', amp_level='O0'": "apex-O0",
    "Fabric(precision='bf16-mixed')": "bf16-mixed",
}


@pytest.mark.parametrize("call", list(CALLS))
def test_get_mode_reads_a_lightning_1x_call(call):
    assert get_mode(call) is MODES[CALLS[call]]


def test_precision_16_means_16_mixed_today_and_bf16_on_a_tpu():
    gpu = explain_precision(gpus=1, precision=16)
    assert gpu.mode == "16-mixed" and 'precision="16-mixed"' in gpu.today
    assert 'accelerator="gpu", devices=1' in gpu.today
    tpu = explain_precision(tpu_cores=8, precision=16)
    assert tpu.mode == "bf16-true" and "bf16" in repr(tpu) and "TPU" in repr(tpu)
    assert "16-mixed" in PRECISION[16].today and "TPU" in PRECISION[16].note


def test_apex_o2_is_explained_with_its_master_weights():
    found = explain_precision(gpus=1, precision=16, amp_backend="apex", amp_level="O2")
    assert found.mode == "apex-O2"
    text = repr(found)
    assert "master weights" in text and "removed in Lightning 2.0" in text
    assert found.today == 'Trainer(accelerator="gpu", devices=1, precision="16-mixed")'
    assert ampnb.explain_precision is explain_precision


def test_apex_with_precision_32_is_ignored_as_lightning_1x_did():
    found = explain_precision(precision=32, amp_backend="apex")
    assert found.mode == "32-true" and "ignored" in repr(found)


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"amp_level": "O2"}, "without amp_backend='apex'"),
    ({"precision": 16, "amp_backend": "apex", "amp_level": "O4"}, "amp_level='O4'.*'O0', 'O1'"),
    ({"amp_backend": "deepspeed"}, "amp_backend='deepspeed'.*'native', 'apex'"),
    ({"precision": 8}, "precision=8 is not allowed"),
    ({"precison": 16}, "argument precison=16 is not allowed.*'precision'"),
])
def test_bad_arguments_name_the_value_and_the_allowed_ones(kwargs, match):
    with pytest.raises(ValueError, match=match):
        explain_precision(**kwargs)


@pytest.mark.parametrize("text", ["Trainer(16)", "Trainer(precision=x)", "Trainer(precision=",
                                  "__import__('os').system('true')"])
def test_parse_call_reads_literals_only(text):
    with pytest.raises(ValueError, match="cannot read"):
        parse_call(text)


def test_unknown_spelling_error_mentions_the_older_call_form():
    with pytest.raises(ValueError, match=r"unknown precision mode 'half'.*Trainer\(precision=16"):
        get_mode("half")


@pytest.fixture
def ip():
    yield from shell_with_ampnb()


def test_show_code_explains_an_older_spelling(ip):
    _amp(ip, "16 --show-code -o r", "y = lin(x)")
    code = ip.user_ns["r"].code
    assert "You wrote '16'" in code and 'precision="16-mixed"' in code and "TPU" in code
    _amp(ip, "16-mixed --show-code -o r", "y = lin(x)")
    assert "You wrote" not in ip.user_ns["r"].code  # today's spelling needs no explanation


def test_amp_cell_takes_a_trainer_call_and_shows_the_apex_code(ip):
    line = "\"Trainer(gpus=1, precision=16, amp_backend='apex', amp_level='O2')\" --show-code -o r"
    _amp(ip, line, "y = lin(x)")
    r = ip.user_ns["r"]
    assert r.mode == "apex-O2"
    assert 'amp.initialize(model, optimizer, opt_level="O2")' in r.code
    assert "masters = [p.detach().float()" in r.code and 'precision="16-mixed"' in r.code
    assert ip.user_ns["y"].dtype == torch.float32  # lin was not converted: %%amp says how
