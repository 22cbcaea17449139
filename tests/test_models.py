"""ampnb.models: demos are deterministic, small, train visibly, and run in low precision."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from ampnb import putback_state
from ampnb.formats import get_format
from ampnb.models import DEMOS, MLP, Demo, SmallCNN, TinyGPT, bars, corpus, demo, spirals

NAMES = sorted(DEMOS)
N_CLASSES = {"mlp": 3, "cnn": 4, "gpt": corpus().vocab_size}


def _train(d: Demo, steps: int, dtype: torch.dtype | None = None) -> list[float]:
    """A plain training loop (optionally under CPU autocast): the reference the demos must pass."""
    model, opt, loss_fn, batches = d
    losses = []
    for i in range(steps):
        x, y = batches[i % len(batches)]
        with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
            loss = loss_fn(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _input(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return x.to(dtype) if x.is_floating_point() else x


def test_registry_has_the_three_demos():
    assert set(DEMOS) == {"mlp", "cnn", "gpt"}
    assert {type(demo(n).model) for n in NAMES} == {MLP, SmallCNN, TinyGPT}


def test_unknown_demo_lists_the_names():
    with pytest.raises(ValueError, match="'resnet'.*mlp, cnn, gpt"):
        demo("resnet")


@pytest.mark.parametrize("kw", [{"width": 0}, {"width": 2.5}, {"batch_size": True},
                                {"lr": -1.0}, {"seq_len": 16}])
def test_bad_knobs_raise_one_line_valueerror(kw):
    # seq_len is a GPT knob; the MLP has no sequence, so it must be refused, not ignored.
    with pytest.raises(ValueError) as err:
        demo("mlp", **kw)
    msg = str(err.value)
    assert "\n" not in msg and "allowed" in msg and next(iter(kw)) in msg


def test_demo_unpacks_as_workbench_arguments_and_is_frozen():
    d = demo("mlp")
    model, opt, loss_fn, batches = d
    assert (model, opt, loss_fn, batches) == (d.model, d.optimizer, d.loss_fn, d.batches)
    assert {id(p) for g in opt.param_groups for p in g["params"]} == \
        {id(p) for p in model.parameters()}
    with pytest.raises(dataclasses.FrozenInstanceError):
        d.model = None  # type: ignore[misc]
    assert "MLP" in repr(d) and f"{d.n_params:,}" in repr(d)


@pytest.mark.parametrize("name", NAMES)
def test_same_seed_same_demo_other_seed_differs(name):
    a, b, c = demo(name, seed=3), demo(name, seed=3), demo(name, seed=4)
    for (k, v), w in zip(a.model.state_dict().items(), b.model.state_dict().values()):
        assert torch.equal(v, w), k
    assert all(torch.equal(x, y) and torch.equal(t, u)
               for (x, t), (y, u) in zip(a.batches, b.batches))
    assert not torch.equal(a.batches[0][0], c.batches[0][0])
    assert any(not torch.equal(v, w) for v, w in
               zip(a.model.state_dict().values(), c.model.state_dict().values())
               if v.is_floating_point())


def test_building_a_demo_leaves_global_rng_and_torch_state_alone():
    before, rng = putback_state.torch_state(), torch.random.get_rng_state()
    demo("gpt", seed=7)
    assert putback_state.torch_state() == before
    assert torch.equal(torch.random.get_rng_state(), rng)


@pytest.mark.parametrize("name,kw", [
    ("mlp", dict(width=16, depth=3, batch_size=5, n_batches=2)),
    ("cnn", dict(width=4, batch_size=6, n_batches=3)),
    ("gpt", dict(width=32, depth=1, n_head=2, batch_size=3, n_batches=2, seq_len=10)),
])
def test_shapes_follow_the_knobs(name, kw):
    d = demo(name, **kw)
    assert len(d.batches) == kw["n_batches"]
    x, y = d.batches[0]
    out = d.model(x)
    assert x.shape[0] == y.shape[0] == out.shape[0] == kw["batch_size"]
    assert out.shape[-1] == N_CLASSES[name]
    assert int(y.max()) < N_CLASSES[name] and int(y.min()) >= 0
    if name == "gpt":
        assert x.shape == y.shape == (kw["batch_size"], kw["seq_len"])
        assert out.shape == (kw["batch_size"], kw["seq_len"], N_CLASSES[name])
    if name == "mlp":
        assert sum(isinstance(m, torch.nn.Linear) for m in d.model.modules()) == kw["depth"] + 1


@pytest.mark.parametrize("name,steps", [("mlp", 60), ("cnn", 40), ("gpt", 60)])
def test_loss_starts_near_chance_and_falls(name, steps):
    losses = _train(demo(name, seed=0), steps)
    # An untrained classifier is close to a uniform guess: loss ≈ log(number of classes).
    assert abs(losses[0] - math.log(N_CLASSES[name])) < 0.35 * math.log(N_CLASSES[name])
    assert sum(losses[-5:]) / 5 < 0.7 * losses[0]


@pytest.mark.parametrize("name", NAMES)
def test_bf16_mixed_training_tracks_fp32(name):
    # The same plain torch.amp loop as the fp32 reference; bf16 rounding moves losses a little.
    ref = _train(demo(name, seed=1), 8)
    amp = _train(demo(name, seed=1), 8, torch.bfloat16)
    assert all(math.isfinite(v) for v in amp)
    assert abs(amp[0] - ref[0]) < 0.05 * ref[0]
    assert amp[-1] < amp[0]


@pytest.mark.parametrize("name", NAMES)
def test_forward_under_autocast_bf16_matches_fp32_to_bf16_precision(name):
    d = demo(name, seed=2, n_batches=1)
    x, _ = d.batches[0]
    with torch.no_grad():
        ref = d.model(x)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = d.model(x)
    assert out.dtype == torch.bfloat16 and out.shape == ref.shape
    # A few roundings of relative size eps per layer; far looser would hide a wrong dtype path.
    tol = 32 * get_format("bf16").eps * ref.abs().max().item()
    torch.testing.assert_close(out.float(), ref, atol=tol, rtol=0)


@pytest.mark.parametrize("name", NAMES)
def test_forward_after_casting_the_model_to_bf16(name):
    d = demo(name, seed=0, n_batches=1)
    model = d.model.to(torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    out = model(_input(d.batches[0][0], torch.bfloat16))
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()


def test_gpt_is_causal_and_weight_tied():
    d = demo("gpt", seed=0, n_batches=1)
    x = d.batches[0][0][:2].clone()
    changed = x.clone()
    changed[:, 20:] = (changed[:, 20:] + 1) % N_CLASSES["gpt"]
    with torch.no_grad():
        a, b = d.model(x), d.model(changed)
    assert torch.equal(a[:, :20], b[:, :20])  # earlier positions never see later tokens
    assert not torch.allclose(a[:, 20:], b[:, 20:])
    assert d.model.head.weight is d.model.tok.weight
    with pytest.raises(ValueError, match="seq_len"):
        d.model(torch.zeros(1, d.model.seq_len + 1, dtype=torch.long))


def test_corpus_round_trips_and_targets_are_the_next_characters():
    text = corpus()
    assert len(text.text) > 2000 and text.text.isascii()
    assert text.decode(text.encode(text.text)) == text.text
    (x, y), = text.batches(1, 4, 16, generator=torch.Generator().manual_seed(0))
    assert torch.equal(x[:, 1:], y[:, :-1])
    for row_x, row_y in zip(x, y):
        assert text.decode(torch.cat([row_x, row_y[-1:]])) in text.text
    with pytest.raises(ValueError, match="not in the corpus"):
        text.encode("€")


def test_synthetic_datasets_are_balanced_enough_and_seeded():
    g = torch.Generator().manual_seed(0)
    pts, labels = spirals(3000, generator=g)
    assert pts.shape == (3000, 2) and torch.bincount(labels).min() > 900
    imgs, labels = bars(400, generator=torch.Generator().manual_seed(0))
    assert imgs.shape == (400, 1, 16, 16) and torch.bincount(labels, minlength=4).min() > 70
    again, _ = bars(400, generator=torch.Generator().manual_seed(0))
    assert torch.equal(imgs, again)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", NAMES)
def test_demo_on_cuda(name):
    d = demo(name, device="cuda")
    assert {p.device.type for p in d.model.parameters()} == {"cuda"}
    assert all(x.is_cuda and y.is_cuda for x, y in d.batches)
    assert _train(d, 3)[-1] < float("inf")


def test_gpt_generate_extends_the_prompt_reproducibly():
    d = demo("gpt", seed=0, n_batches=1)
    text = corpus()
    prompt = text.encode("The keeper").unsqueeze(0)
    before = putback_state.torch_state()
    a = d.model.generate(prompt, 40, generator=torch.Generator().manual_seed(1))
    b = d.model.generate(prompt, 40, generator=torch.Generator().manual_seed(1))
    assert putback_state.torch_state() == before
    assert a.shape == (1, prompt.shape[1] + 40) and torch.equal(a, b)
    assert text.decode(a[0]).startswith("The keeper")


def test_demo_for_a_cpu_is_the_tutorials_demo():
    from ampnb.models import demo_for

    a, b = demo_for("cpu"), demo("gpt")
    assert a.n_params == b.n_params and all(torch.equal(p, q) for p, q in
                                            zip(a.model.parameters(), b.model.parameters()))
    assert demo_for("cpu", "mlp", width=8).model.head.in_features == 8


def test_demo_for_a_gpu_is_sized_for_its_tensor_cores(monkeypatch):
    """Built on the meta device: the sizes a GPU gets, without a GPU; kw still overrides."""
    from ampnb.models import SIZED_FOR, demo_for, demos

    asked = []
    monkeypatch.setattr(demos, "demo", lambda name, **kw: asked.append((name, kw)))
    demo_for("cuda:0")
    demo_for("cuda", "gpt", depth=2)
    assert asked[0] == ("gpt", dict(seed=0, lr=None, device="cuda:0", **SIZED_FOR[("gpt", "cuda")]))
    assert asked[1][1]["depth"] == 2 and asked[1][1]["width"] == 1024
    with torch.device("meta"):  # >= 100M parameters: matmuls, not launches, set the step time
        big = TinyGPT(corpus().vocab_size, **{k: v for k, v in SIZED_FOR[("gpt", "cuda")].items()
                                              if k in ("width", "depth", "n_head", "seq_len")})
    assert sum(p.numel() for p in big.parameters()) > 100e6 > 900 * demo("gpt").n_params
