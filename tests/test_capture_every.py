"""capture(every=N): one forward call in N (with its backward) is captured, the rest run bare."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import ampnb
from ampnb import putback_state
from ampnb.instruments import summaries
from ampnb.models.mlp import MLP


def _setup() -> tuple[nn.Module, list[torch.Tensor], torch.optim.Optimizer]:
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    model = MLP(width=8, depth=2)
    return model, [torch.randn(16, 2, generator=g) for _ in range(7)], \
        torch.optim.SGD(model.parameters(), lr=0.1)


def _hooks_on(model: nn.Module) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules()) + sum(
        len(getattr(p, "_post_accumulate_grad_hooks", None) or {}) for p in model.parameters())


def test_every_third_call_is_captured_with_its_backward_and_weights():
    model, xs, opt = _setup()
    seen = {}  # what a hand-written loop sees at each step
    with ampnb.capture(model, every=3) as cap:
        for i, x in enumerate(xs):
            weights = {n: p.detach().clone() for n, p in model.named_parameters()}
            opt.zero_grad()
            out = model(x)
            out.pow(2).mean().backward()
            seen[i] = (weights, out.detach().clone(), {n: p.grad.clone()
                                                       for n, p in model.named_parameters()})
            opt.step()
    assert cap.forwards == 7
    weights, out, grads = seen[6]  # calls 0, 3 and 6 were captured; the last one shows
    assert cap.get("(output)", "activation").amax == out.abs().max().item()
    assert cap.get("(output)", "activation").calls == 3
    for name in grads:
        g, w = cap.get(name, "gradient"), cap.get(name, "weight")
        assert g.coverage("fp16") == ampnb.coverage(grads[name], "fp16")
        assert w.coverage("bf16") == ampnb.coverage(weights[name], "bf16")
        assert w.amax == weights[name].abs().max().item()


def test_between_captured_calls_only_the_counting_hook_stays():
    model, xs, _ = _setup()
    with ampnb.capture(model, every=2):
        armed = _hooks_on(model)
        model(xs[0])  # call 0: captured
        assert _hooks_on(model) == armed > 1
        model(xs[1])  # call 1: not captured
        assert _hooks_on(model) == 1
        model(xs[2])  # call 2: captured again
        assert _hooks_on(model) == armed
    assert _hooks_on(model) == 0


def test_a_container_output_is_copied_and_summarized_once(monkeypatch):
    model, xs, _ = _setup()
    sizes = []
    real = summaries.segment_counts

    def spy(parts, fmts, **kw):
        sizes.extend(p.numel() for p in parts)
        return real(parts, fmts, **kw)

    monkeypatch.setattr(summaries, "segment_counts", spy)
    with ampnb.capture(model, kinds=["activation"]) as cap:
        out = model(xs[0])
    body, last = cap.get("body", "activation"), cap.get(f"body.{len(model.body) - 1}",
                                                         "activation")
    assert body.histogram == last.histogram and body.coverages == last.coverages
    head, root = cap.get("head", "activation"), cap.get("(output)", "activation")
    assert root.amax == head.amax == out.abs().max().item()
    assert len(sizes) == len(cap.records) - 2  # body = its last child, output = head


def test_bad_every_and_an_exception_mid_loop_leave_nothing_behind():
    model, xs, _ = _setup()
    for bad in (0, -1, 1.5, True, "2"):
        with pytest.raises(ValueError, match="every must be a positive int"):
            ampnb.capture(model, every=bad)
    before = putback_state.torch_state()
    with pytest.raises(RuntimeError):
        with ampnb.capture(model, every=2):
            model(xs[0])
            model(xs[1])
            model(torch.randn(3, 5))  # wrong width: raises inside a captured call
    assert _hooks_on(model) == 0 and putback_state.torch_state() == before


def test_activation_gradients_come_from_the_captured_calls_only():
    model, xs, _ = _setup()
    with ampnb.capture(model, kinds=["activation_gradient"], modules="head", every=2) as cap:
        grads = []
        for x in xs[:4]:  # calls 0 and 2 are captured
            out = model(x)
            out.retain_grad()
            out.pow(2).mean().backward()
            grads.append(out.grad.clone())
    s = cap.get("head", "activation_gradient")
    assert s.calls == 2
    assert s.coverage("fp16") == ampnb.coverage(grads[2], "fp16")
    assert s.amax == grads[2].abs().max().item() != grads[3].abs().max().item()


def test_a_container_output_kept_is_copied_once(monkeypatch):
    """keep=True: the container's record shares its last child's exact copy; no second copy."""
    from ampnb.instruments import tensor_capture

    model, xs, _ = _setup()
    copies = []
    real = tensor_capture.exact_copy
    monkeypatch.setattr(tensor_capture, "exact_copy", lambda x: copies.append(x) or real(x))
    with ampnb.capture(model, kinds=["activation"], keep=True) as cap:
        out = model(xs[0])
    body, last = cap.get("body", "activation"), cap.get(f"body.{len(model.body) - 1}",
                                                         "activation")
    assert body.tensor is last.tensor and cap.get("(output)", "activation").tensor is \
        cap.get("head", "activation").tensor
    assert len(copies) == len(cap.records) - 2  # body = its last child, output = head
    assert torch.equal(cap.get("(output)", "activation").tensor, out)
