"""Every layer a conversion leaves out carries its true reason (#40)."""

from __future__ import annotations

import torch
from torch import nn

from ampnb.fp8 import convert_to_fp8, quantize_model

READ = "NonDynamicallyQuantizableLinear"


def _block() -> nn.Module:
    torch.manual_seed(0)
    return nn.TransformerEncoderLayer(32, 4, 64, batch_first=True)


def test_attentions_out_proj_is_a_linear_its_parent_never_calls():
    """The plant as torch shows it: out_proj has Linear's own forward, yet the attention reads
    its weight directly (F.multi_head_attention_forward), so no call of it is ever made."""
    block = _block()
    out_proj = block.self_attn.out_proj
    assert type(out_proj).__name__ == READ and type(out_proj).forward is nn.Linear.forward
    calls = []
    out_proj.register_forward_hook(lambda *_: calls.append(1))
    block(torch.randn(2, 5, 32))  # training mode: torch's slow path
    assert calls == []


def _notes(table) -> list[str]:
    return [n for n in table.notes if n.startswith("left out")]


def test_fp8_and_low_bit_reports_give_out_proj_its_own_reason():
    _, fp8 = convert_to_fp8(_block(), backend="ampnb")
    _, low = quantize_model(_block(), "nf4")
    for notes in (_notes(fp8.table()), _notes(low.table())):
        mine = [n for n in notes if READ in n]
        assert len(mine) == 1 and "reads its weight directly" in mine[0], notes
        assert "multi_head_attention_forward" in mine[0]
        assert not any(READ in n and "not Linear or Conv1D" in n for n in notes)
    fp8_notes = _notes(fp8.table())
    # the others are left out for what they are: not Linear or Conv1D
    assert any("not Linear or Conv1D" in n and "LayerNorm" in n for n in fp8_notes)
