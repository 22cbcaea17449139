"""Emulated bitsandbytes Adam8bit: fp32 equivalence, 8-bit state, min_8bit_size, embedding override, bytes."""

from __future__ import annotations

import copy
import itertools
import math

import pytest
import torch
from torch import nn

from ampnb.instruments.memory import measure_memory
from ampnb.lowbit import Adam8bit, compare_optimizers, dynamic_map, param_groups
from ampnb.lowbit.blockwise import dequantize_blockwise
from ampnb.lowbit.optim_compare import RUNS


def grads(n: int, shape: tuple[int, ...], seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*shape, generator=g) * 10.0 ** -k for k in range(n)]


def run(opt_cls, p: torch.Tensor, gs: list[torch.Tensor], **kw) -> tuple[torch.Tensor, torch.optim.Optimizer]:
    p = nn.Parameter(p.clone())
    opt = opt_cls([p], lr=1e-2, **kw)
    for g in gs:
        p.grad = g.clone()
        opt.step()
    return p.detach(), opt


def test_32bit_state_is_torch_adam():
    p0 = torch.randn(64, 80, generator=torch.Generator().manual_seed(1))
    gs = grads(5, p0.shape)
    ours, opt = run(Adam8bit, p0, gs, optim_bits=32)
    ref, ref_opt = run(torch.optim.Adam, p0, gs)
    torch.testing.assert_close(ours, ref, rtol=1e-6, atol=1e-7)
    m, v = opt.moments(opt.param_groups[0]["params"][0])
    state = next(iter(ref_opt.state.values()))
    torch.testing.assert_close(m, state["exp_avg"]) and torch.testing.assert_close(v, state["exp_avg_sq"])


def argmin_state(x: torch.Tensor, signed: bool, blocksize: int = 256) -> torch.Tensor:
    """Brute-force block-wise dynamic quantization, dequantized (the reference round trip)."""
    code = dynamic_map(signed)
    flat = torch.cat([x.reshape(-1), x.new_zeros((-x.numel()) % blocksize)]).reshape(-1, blocksize)
    absmax = flat.abs().amax(1, keepdim=True)
    idx = ((flat * (1 / absmax)).clamp(-1, 1)[..., None] - code).abs().argmin(-1)
    return (code[idx] * absmax).reshape(-1)[: x.numel()].reshape(x.shape)


def test_8bit_state_is_the_dynamic_map_round_trip_of_each_step():
    p0 = torch.randn(64, 80, generator=torch.Generator().manual_seed(2))  # 5120 >= 4096
    gs = grads(3, p0.shape, seed=3)
    p, m, v = p0.clone(), torch.zeros_like(p0), torch.zeros_like(p0)
    b1, b2, lr, eps = 0.9, 0.999, 1e-2, 1e-8
    for t, g in enumerate(gs, 1):  # bitsandbytes' update on the dequantized moments, in fp32
        m, v = m * b1 + (1 - b1) * g, v * b2 + (1 - b2) * g * g
        p = p - lr / (1 - b1 ** t) * m / (v.sqrt() / math.sqrt(1 - b2 ** t) + eps)
        m, v = argmin_state(m, True), argmin_state(v, False)
    ours, opt = run(Adam8bit, p0, gs)
    state = next(iter(opt.state.values()))
    assert state["exp_avg_codes"].dtype == torch.uint8 and "exp_avg" not in state
    om, ov = opt.moments(opt.param_groups[0]["params"][0])
    torch.testing.assert_close(om, m, rtol=1e-6, atol=0)
    torch.testing.assert_close(ov, v, rtol=1e-6, atol=0)
    torch.testing.assert_close(ours, p, rtol=1e-6, atol=1e-7)
    ref, _ = run(torch.optim.Adam, p0, gs)
    assert not torch.equal(ours, ref)  # 8 bits of state do change the trajectory


def test_small_tensors_keep_fp32_state_min_8bit_size():
    big, small = nn.Parameter(torch.randn(4096)), nn.Parameter(torch.randn(4095))
    opt = Adam8bit([big, small])
    big.grad, small.grad = torch.ones(4096), torch.ones(4095)
    opt.step()
    assert "exp_avg_codes" in opt.state[big] and opt.state[small]["exp_avg"].dtype == torch.float32


class Emb(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(100, 64)
        self.head = nn.Linear(64, 100)

    def forward(self, ids):
        return self.head(self.tok(ids))


def test_embedding_override_keeps_its_state_in_32_bits():
    model = Emb()
    opt = Adam8bit(param_groups(model, (nn.Embedding,)))
    model(torch.randint(0, 100, (4, 8))).sum().backward()
    opt.step()
    assert opt.state[model.tok.weight]["exp_avg"].dtype == torch.float32
    assert opt.state[model.head.weight]["exp_avg_codes"].dtype == torch.uint8
    by_name = param_groups(model, ("tok",))
    assert by_name[1]["optim_bits"] == 32 and by_name[1]["params"] == [model.tok.weight]
    with pytest.raises(ValueError, match="keep_32bit entry 3 is not allowed.*nn.Module type"):
        param_groups(model, (3,))
    with pytest.raises(ValueError, match="optim_bits=4 is not allowed; allowed: 8 or 32"):
        Adam8bit(model.parameters(), optim_bits=4)


def test_state_bytes_measured_by_the_memory_meter():
    model = Emb()
    batch = torch.randint(0, 100, (4, 8))
    assert [p.numel() for p in model.parameters()] == [6400, 6400, 100]
    fp32 = measure_memory(model, batch, optimizer=torch.optim.Adam(model.parameters())).optimizer_bytes
    eight = measure_memory(model, batch, optimizer=Adam8bit(model.parameters())).optimizer_bytes
    kept = measure_memory(model, batch, optimizer=Adam8bit(param_groups(model))).optimizer_bytes
    step = 4  # one float32 step counter per tensor, as torch's Adam keeps it
    assert fp32 == sum(8 * p.numel() + step for p in model.parameters())
    big = 2 * (6400 + 4 * math.ceil(6400 / 256)) + step  # uint8 codes + fp32 absmax per 256, twice
    assert eight == 2 * big + (8 * 100 + step)  # the 100-value bias is under min_8bit_size
    assert kept == (8 * 6400 + step) + big + (8 * 100 + step)


def test_load_state_dict_keeps_the_uint8_codes():
    model = Emb()
    opt = Adam8bit(model.parameters())
    model(torch.randint(0, 100, (2, 3))).sum().backward()
    opt.step()
    twin = copy.deepcopy(model)
    new = Adam8bit(twin.parameters())
    new.load_state_dict(copy.deepcopy(opt.state_dict()))
    s = new.state[twin.head.weight]
    assert s["exp_avg_codes"].dtype == torch.uint8 and s["exp_avg_absmax"].dtype == torch.float32
    m_old, _ = opt.moments(model.head.weight)
    assert torch.equal(new.moments(twin.head.weight)[0], m_old)
    assert torch.equal(dequantize_blockwise(s["exp_avg_sq_codes"], s["exp_avg_sq_absmax"],
                                            dynamic_map(False), 256), opt.moments(model.head.weight)[1])


def test_compare_optimizers_same_start_less_state():
    r = compare_optimizers("gpt", steps=3, width=128, depth=1, n_head=2, batch_size=2, n_batches=2,
                           seq_len=8)
    first = {losses[0] for losses in r.losses.values()}
    assert len(first) == 1 and all(len(v) == 3 for v in r.losses.values())
    fp32, eight, kept = r.state_bytes.values()
    assert eight < kept < fp32 and "tok.weight" in r.eight_bit["Adam8bit"]
    assert "tok.weight" not in r.eight_bit["Adam8bit, embeddings 32-bit"]
    assert "optimizer state" in repr(r)


def test_optimizer_loss_plot_has_one_line_per_run():
    from types import SimpleNamespace

    from ampnb.plots import plot_optimizer_losses

    result = SimpleNamespace(losses={"Adam": (3.0, 2.0, 1.0), "Adam8bit": (3.0, 2.5, 1.5)})
    ax = plot_optimizer_losses(result, smooth=2)
    assert [line.get_label() for line in ax.lines] == ["Adam", "Adam8bit"]
    assert list(ax.lines[1].get_ydata()) == [2.75, 2.0]


def test_compare_optimizers_trains_like_a_hand_written_loop():
    """Each run is the one step (32-true): the same losses as a plain torch loop."""
    from ampnb.models import demo
    from ampnb.models.demos import DEMOS

    kw = dict(width=32, depth=1, n_head=2, batch_size=2, n_batches=2, seq_len=8)
    r = compare_optimizers("gpt", steps=3, runs={"Adam": RUNS["Adam (fp32 state)"]}, **kw)
    model, _, loss_fn, batches = demo("gpt", seed=0, **kw)
    opt = torch.optim.Adam(model.parameters(), lr=DEMOS["gpt"].lr)
    want = []
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        for x, y in itertools.islice(itertools.cycle(batches), 3):
            loss = loss_fn(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            want.append(loss.item())
    assert list(r.losses["Adam"]) == want


def test_rows_that_agree_say_why():
    """The demo's embeddings are under min_8bit_size: both Adam8bit runs keep them fp32."""
    from ampnb.lowbit.optim import MIN_8BIT_SIZE
    from ampnb.lowbit.optim_compare import compare_optimizers

    r = compare_optimizers("gpt", steps=1)
    same = set(r.eight_bit["Adam8bit"]) == set(r.eight_bit["Adam8bit, embeddings 32-bit"])
    text = repr(r)
    assert same == ("rows agree" in text)
    if same:
        assert f"min_8bit_size={MIN_8BIT_SIZE:,}" in text and "tok.weight" in text
