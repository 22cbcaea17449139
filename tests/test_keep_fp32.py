"""keep_fp32: matched modules run in fp32 under any mode, as a hand-written autocast(enabled=False)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ampnb import putback_state
from ampnb.instruments.trace import trace_ops
from ampnb.selective import keep_fp32, matching_modules


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 32))
        self.norm = nn.LayerNorm(32)
        self.head = nn.Linear(32, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.body(x)))


class HandWritten(Net):
    """The same network with the head in a hand-written fp32 region."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.body(x))
        with torch.autocast("cpu", enabled=False):
            return self.head(h.float())


def _pair():
    torch.manual_seed(0)
    a = Net()
    b = HandWritten()
    b.load_state_dict(a.state_dict())
    return a, b


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_same_outputs_and_gradients_as_a_hand_written_region_bit_for_bit(dtype):
    a, b = _pair()
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(1))
    with keep_fp32(a, "head"), torch.autocast("cpu", dtype=dtype):
        ya = a(x)
    ya.sum().backward()
    with torch.autocast("cpu", dtype=dtype):
        yb = b(x)
    yb.sum().backward()
    assert ya.dtype == yb.dtype == torch.float32 and torch.equal(ya, yb)
    for (n, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(pa.grad, pb.grad), n


def test_the_tracer_shows_dtypes_change_only_inside_the_matched_modules():
    a, _ = _pair()
    x = torch.randn(4, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16), trace_ops() as plain:
        a(x)
    with keep_fp32(a, "head"), torch.autocast("cpu", dtype=torch.bfloat16), trace_ops() as kept:
        a(x)
    lowered = {r.module for r in plain.select(category="lowered")}
    assert "head" in lowered
    assert {r.module for r in kept.select(category="lowered")} == lowered - {"head"}
    assert all(r.output_dtype == "float32" for r in kept.select(op="addmm", module="head"))


def test_in_a_true_mode_the_module_keeps_fp32_weights_with_casts_at_its_boundary():
    a, _ = _pair()
    a.to(torch.bfloat16)
    x = torch.randn(4, 16).bfloat16()
    with keep_fp32(a, "head"):
        assert a.head.weight.dtype == torch.float32 and a.body[0].weight.dtype == torch.bfloat16
        y = a(x)
    assert y.dtype == torch.bfloat16  # cast back at the boundary: the rest of the model is bf16
    assert a.head.weight.dtype == torch.bfloat16
    with torch.no_grad():
        h = a.norm(a.body(x))
        expected = nn.functional.linear(h.float(), a.head.weight.float(),
                                        a.head.bias.float()).bfloat16()
    assert torch.equal(y.detach(), expected)


def test_globs_match_paths_and_only_the_outermost_match_is_wrapped():
    a, _ = _pair()
    assert list(matching_modules(a, "body.*")) == ["body.0", "body.1", "body.2"]
    assert list(matching_modules(a, "body,body.0")) == ["body"]
    assert list(matching_modules(a, ["head", "*norm"])) == ["norm", "head"]


def test_a_pattern_that_matches_nothing_is_a_one_line_error_and_changes_nothing():
    a, _ = _pair()
    with pytest.raises(ValueError, match="'lm_head' matches no module of Net; module paths look like: body"):
        with keep_fp32(a, "lm_head,head"):
            pass
    assert "forward" not in a.head.__dict__
    with pytest.raises(ValueError, match="module paths or globs"):
        with keep_fp32(a, ""):
            pass


def test_everything_is_undone_also_when_the_body_raises():
    a, _ = _pair()
    own = a.norm.forward  # a bound method, not an instance attribute
    a.head.forward = lambda x: nn.Linear.forward(a.head, x) * 1  # the user's own instance forward
    user_forward = a.head.forward
    before = putback_state.torch_state()
    with pytest.raises(RuntimeError, match="boom"), keep_fp32(a, "head,norm"):
        raise RuntimeError("boom")
    assert a.head.forward is user_forward and "forward" not in a.norm.__dict__
    assert a.norm.forward == own and putback_state.torch_state() == before


class Tied(nn.Module):
    """A language-model head tied to the embedding (`head.weight = emb.weight`)."""

    def __init__(self, vocab: int = 12, hidden: int = 8) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(vocab, hidden)
        self.body = nn.Linear(hidden, hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.body(self.emb(ids))))


def test_a_kept_head_tied_to_the_embedding_computes_in_fp32_and_leaves_the_embedding_bf16():
    model = Tied().to(torch.bfloat16)
    ids = torch.randint(0, 12, (2, 5), generator=torch.Generator().manual_seed(1))
    with keep_fp32(model, "head"), trace_ops() as trace:
        assert model.emb.weight.dtype == torch.bfloat16 and model.head.weight is model.emb.weight
        out = model(ids)
        out.float().sum().backward()
    assert out.dtype == torch.bfloat16  # cast back at the head's boundary
    head_ops = trace.select(op="mm", module="head")
    assert head_ops and all(r.output_dtype == "float32" for r in head_ops)
    assert model.head.weight is model.emb.weight and model.emb.weight.dtype == torch.bfloat16
    grad = model.emb.weight.grad
    assert grad is not None and grad.dtype == torch.bfloat16
    # the head's share of the gradient reaches the shared weight: compare with a hand-written fp32 head
    ref = Tied().to(torch.bfloat16)
    h = torch.tanh(ref.body(ref.emb(ids)))
    nn.functional.linear(h.float(), ref.emb.weight.float()).bfloat16().float().sum().backward()
    assert torch.equal(grad, ref.emb.weight.grad)


def test_widening_kept_modules_for_good_leaves_a_tied_embedding_narrow():
    """What a true mode's Workbench does to kept modules: the tied weight keeps its dtype."""
    from ampnb.selective import widen_kept

    model = Tied().to(torch.bfloat16)
    model.head.bias = nn.Parameter(torch.zeros(12, dtype=torch.bfloat16))
    widen_kept(model, "head")
    assert model.head.bias.dtype == torch.float32  # the head's own parameter is widened
    assert model.emb.weight.dtype == torch.bfloat16 and model.head.weight is model.emb.weight
    with keep_fp32(model, "head"):
        out = model(torch.randint(0, 12, (2, 5)))
    out.float().sum().backward()
    assert model.emb.weight.grad.dtype == torch.bfloat16 and model.head.bias.grad is not None
    assert model.head.bias.dtype == torch.float32  # still widened for good


def test_the_workbench_keeps_a_head_tied_to_the_embedding_in_fp32():
    """bf16-true with the tied head kept: the step runs; the embedding stays bf16."""
    from ampnb import Workbench

    class Tied(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = torch.nn.Embedding(32, 16)
            self.head = torch.nn.Linear(16, 32, bias=False)
            self.head.weight = self.emb.weight

        def forward(self, ids):
            return self.head(self.emb(ids))

    torch.manual_seed(0)
    model = Tied()
    ids = torch.randint(0, 32, (4, 8))
    batches = [(ids, ids)]
    loss_fn = lambda out, y: torch.nn.functional.cross_entropy(out.flatten(0, 1), y.flatten())  # noqa: E731
    wb = Workbench(model, torch.optim.SGD(model.parameters(), lr=0.1), loss_fn, batches)
    wb.set(mode="bf16-true", keep_fp32="head")
    record = wb.step()
    assert wb.model.emb.weight.dtype == torch.bfloat16
    assert wb.model.head.weight is wb.model.emb.weight
    assert record.nonfinite == () and record.loss == record.loss
