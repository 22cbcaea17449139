"""Memory meter: saved-for-backward bytes against autograd's own saved tensors, state bytes
against a plain torch step."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import ampnb
from ampnb import putback_state
from ampnb.display import format_bytes
from ampnb.instruments.memory import memory_meter
from ampnb.models.mlp import MLP


def _mlp() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    return MLP(width=32, depth=2), torch.randn(16, 2), torch.randint(0, 3, (16,))


def _saved_by_autograd(loss: torch.Tensor) -> int:
    """Bytes of distinct non-parameter storages autograd's nodes hold (their `_saved_*`)."""
    seen, total, todo, nodes = set(), 0, [loss.grad_fn], set()
    while todo:
        n = todo.pop()
        if n is None or n in nodes:
            continue
        nodes.add(n)
        todo.extend(f for f, _ in n.next_functions)
        for name in dir(n):
            try:
                t = getattr(n, name) if name.startswith("_saved_") else None
            except RuntimeError:  # not saved in this graph
                continue
            if not isinstance(t, torch.Tensor):
                continue
            base = t._base if t._is_view() else t
            if base.is_leaf and base.requires_grad:
                continue
            key = t.untyped_storage().data_ptr()
            if key not in seen:
                seen.add(key)
                total += t.untyped_storage().nbytes()
    return total


@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
def test_saved_bytes_match_autograd_saved_tensors(dtype):
    model, x, y = _mlp()
    ctx = (lambda: torch.autocast("cpu", dtype=dtype)) if dtype else torch.enable_grad
    with ctx():
        expected = _saved_by_autograd(nn.functional.cross_entropy(model(x), y))
    with memory_meter() as m, ctx():
        loss = nn.functional.cross_entropy(model(x), y)
    assert m.peak_bytes == expected > 0
    loss.backward()
    assert m.live == 0  # backward freed every saved tensor


def test_frees_count_before_the_next_save_and_when_read():
    model, x, _ = _mlp()
    with memory_meter() as one:
        out = model(x).sum()
    with memory_meter() as m:
        for _ in range(3):  # each graph is freed before the next is built: one graph at most
            out = model(x).sum()
            assert m.live == one.peak_bytes
            del out
        assert m.live == 0
    assert m.peak_bytes == one.peak_bytes > 0 and m.tensors == 3 * one.tensors


def test_bf16_halves_saved_activations_and_true_halves_state():
    model, x, y = _mlp()
    before = [p.detach().clone() for p in model.parameters()]
    rng = torch.get_rng_state()
    snap = putback_state.torch_state()
    report = ampnb.memory_report(model, (x, y), nn.functional.cross_entropy)
    assert putback_state.torch_state() == snap and torch.equal(torch.get_rng_state(), rng)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))  # untouched
    fp32, mixed, true16 = report.stats
    assert [s.mode for s in report.stats] == ["32-true", "bf16-mixed", "bf16-true"]
    # references: the same step in plain torch
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(ref.parameters())
    nn.functional.cross_entropy(ref(x), y).backward()
    opt.step()
    params = sum(p.numel() * p.element_size() for p in ref.parameters())
    state = sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values())
    assert (fp32.param_bytes, fp32.grad_bytes, fp32.optimizer_bytes) == (params, params, state)
    assert true16.param_bytes * 2 == params == true16.grad_bytes * 2
    assert mixed.param_bytes == params  # mixed keeps fp32 weights
    with torch.autocast("cpu", dtype=torch.bfloat16):
        mixed_ref = _saved_by_autograd(nn.functional.cross_entropy(
            model(x.bfloat16()), y))
    assert mixed.saved_bytes == mixed_ref < fp32.saved_bytes
    assert true16.saved_bytes < fp32.saved_bytes
    assert fp32.total == fp32.saved_bytes + 2 * params + state
    text = repr(report)
    assert format_bytes(fp32.saved_bytes) in text and "vs 32-true" in text


def test_demo_gives_model_batch_loss_and_optimizer():
    demo = ampnb.models.demo("mlp")
    (s,) = ampnb.memory_report(demo, modes=["bf16-true"]).stats
    params = sum(p.numel() for p in demo.model.parameters())
    assert s.param_bytes == params * torch.finfo(torch.bfloat16).bits // 8
    assert s.saved_tensors > 0 and s.cuda_peak_bytes is None


def test_hooks_gone_after_an_exception():
    model, x, _ = _mlp()
    before = putback_state.torch_state()
    with pytest.raises(RuntimeError):
        with memory_meter():
            model(torch.randn(3, 7))
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
    assert putback_state.torch_state() == before


def test_bad_input_is_one_line_value_error():
    model, x, y = _mlp()
    with pytest.raises(ValueError, match="ReLU has no trainable parameters"):
        ampnb.memory_report(nn.ReLU(), x)
    with pytest.raises(ValueError, match="needs an nn.Module or a Demo, got str"):
        ampnb.instruments.measure_memory("model", x)
    with pytest.raises(ValueError, match="needs inputs"):
        ampnb.memory_report(model)
    with pytest.raises(ValueError, match="'17-true'"):
        ampnb.memory_report(model, x, modes=["17-true"])
    with pytest.raises(ValueError, match="at least one mode"):
        ampnb.memory_report(model, x, modes=[])
    with pytest.raises(ValueError, match=r"loss_fn=Tensor is not allowed.*\(inputs, targets\)"):
        ampnb.memory_report(model, x, y)  # the old form: inputs and targets apart


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_peak_is_measured():
    model, x, y = _mlp()
    (s,) = ampnb.memory_report(model, (x, y), nn.functional.cross_entropy,
                               modes=["bf16-mixed"], device="cuda").stats
    assert s.cuda_peak_bytes is not None and s.cuda_peak_bytes >= s.saved_bytes


class _HFLike(nn.Module):
    """Keyword inputs; returns a ModelOutput-like dict with its own loss when given labels."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.head = nn.Embedding(10, 16), nn.Linear(16, 3)

    def forward(self, input_ids, labels=None):
        logits = self.head(self.emb(input_ids).mean(1))
        loss = None if labels is None else nn.functional.cross_entropy(logits, labels)
        return {"loss": loss, "logits": logits}


def _hf_batch():
    gen = torch.Generator().manual_seed(0)
    return {"input_ids": torch.randint(0, 10, (4, 5), generator=gen),
            "labels": torch.randint(0, 3, (4,), generator=gen)}


def test_a_dict_batch_and_the_models_own_loss():
    torch.manual_seed(0)
    model, batch = _HFLike(), _hf_batch()
    (s,) = ampnb.memory_report(model, batch, modes=["32-true"]).stats
    with memory_meter() as hand:  # reference: the same forward, by hand
        model(**batch)["loss"].backward()
    assert s.saved_bytes == hand.peak_bytes > 0
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    assert s.grad_bytes == params  # the model's own loss reached every parameter


def test_the_optimizer_is_an_instance_copied_with_its_settings_and_state():
    model, x, y = _mlp()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    (s,) = ampnb.memory_report(model, (x, y), nn.functional.cross_entropy, optimizer=sgd,
                               modes=["32-true"]).stats
    assert s.optimizer_bytes == params  # one momentum buffer per parameter (AdamW would be 2x)
    assert sgd.state_dict()["state"] == {}  # the user's optimizer took no step
    amsgrad = torch.optim.Adam(model.parameters(), lr=1e-3, amsgrad=True)
    nn.functional.cross_entropy(model(x), y).backward()
    amsgrad.step()  # state exists already: it is copied, and stepped on the copy
    model.zero_grad()
    steps_before = amsgrad.state_dict()["state"][0]["step"].clone()
    (t,) = ampnb.memory_report(model, (x, y), nn.functional.cross_entropy, optimizer=amsgrad,
                               modes=["bf16-true"]).stats
    assert t.optimizer_bytes == 3 * params // 2 + 4 * len(list(model.parameters()))
    assert torch.equal(amsgrad.state_dict()["state"][0]["step"], steps_before)
    with pytest.raises(ValueError, match="allowed: a torch.optim.Optimizer instance"):
        ampnb.memory_report(model, (x, y), nn.functional.cross_entropy,
                            optimizer=torch.optim.AdamW)


def test_the_step_is_the_one_step_with_the_modes_scaler_on_the_copys_weights(monkeypatch):
    model, x, y = _mlp()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    stepped, step = [], torch.amp.GradScaler.step

    def spy(scaler, optimizer, *args, **kwargs):
        held = {id(p) for g in optimizer.param_groups for p in g["params"]}
        stepped.append((type(optimizer), held, float(scaler.get_scale())))
        return step(scaler, optimizer, *args, **kwargs)

    monkeypatch.setattr(torch.amp.GradScaler, "step", spy)
    (s,) = ampnb.memory_report(model, (x, y), nn.functional.cross_entropy, optimizer=sgd,
                               modes=["16-mixed"]).stats
    ((kind, held, scale),) = stepped  # the mode's GradScaler stepped a copy of the user's SGD
    assert kind is torch.optim.SGD and scale == 2.0 ** 16
    assert not held & {id(p) for p in model.parameters()}
    assert s.optimizer_bytes == params and sgd.state_dict()["state"] == {}
    # APEX O2 steps fp32 masters of the fp16 weights: momentum and masters are fp32
    (o2,) = ampnb.memory_report(model, (x, y), nn.functional.cross_entropy, optimizer=sgd,
                                modes=["apex-O2"]).stats
    assert o2.param_bytes * 2 == params and o2.optimizer_bytes == 2 * params


class _Fp32Buffer(nn.Module):
    """Builds an fp32 tensor in forward and multiplies it with its weight: under bf16-true the
    weight is bf16, and torch refuses (mat1 and mat2 must have the same dtype)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        extra = torch.ones(x.shape[0], 8, dtype=torch.float32, device=x.device)
        return torch.mm(extra, self.lin.weight.t()) + self.lin(x)


def test_a_mode_that_fails_gets_its_own_row_and_the_others_run():
    torch.manual_seed(0)
    model, x = _Fp32Buffer(), torch.randn(4, 8)
    with pytest.raises(RuntimeError, match="same dtype") as torch_says, torch.no_grad():
        torch.mm(torch.ones(4, 8), model.lin.weight.to(torch.bfloat16).t())  # what torch says
    before = putback_state.torch_state()
    report = ampnb.memory_report(model, x, modes=("32-true", "bf16-true", "bf16-mixed"))
    assert putback_state.torch_state() == before
    ok, bad, mixed = report.stats
    assert not ok.error and not mixed.error and ok.saved_bytes > 0 and mixed.saved_bytes > 0
    assert ok == ampnb.instruments.memory.measure_memory(model, x)  # the rows that ran are whole
    line = _Fp32Buffer.forward.__code__.co_firstlineno + 2
    assert bad.error == (f"RuntimeError: {str(torch_says.value).splitlines()[0]} "
                         f"(at forward, test_memory.py:{line}); under bfloat16")
    text = repr(report)
    assert "bf16-true" in text and "failed" in text and "same dtype" in text
    assert report.table().rows[1][1] == "failed" and report.table().rows[2][2].endswith("x")


def test_every_mode_failing_raises_the_first_error():
    model, x = _Fp32Buffer(), torch.randn(4, 8)
    with pytest.raises(RuntimeError, match="same dtype"):
        ampnb.memory_report(model, x, modes=("bf16-true",))


def test_compare_reports_the_failing_mode_in_its_row():
    torch.manual_seed(0)
    model, x = _Fp32Buffer(), torch.randn(4, 8)
    mode = ampnb.get_mode("bf16-true")

    def prepare(m):
        m.convert_module(model) if m.name == "bf16-true" else None
        return ""

    def restore():
        model.float()

    from ampnb.comparison import Work

    work = Work(lambda: model(x), prepare=prepare, restore=restore)
    c = ampnb.compare(work, ["bf16-true", "bf16-mixed"], repeat=1, model=model)
    bad, good = c.row("bf16-true"), c.row("bf16-mixed")
    assert bad.failed and "same dtype" in bad.note and "at forward, test_memory.py:" in bad.note
    assert not good.failed and good.result_dtypes == ("bfloat16",)
    assert mode.name in repr(c)
