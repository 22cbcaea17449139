"""A `%%amp` cell runs torch's recipe: autocast everywhere but backward, no stale autocast weights."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.overrides import _get_current_function_mode_stack

from ampnb.instruments.trace import trace_ops
from tests._magics_kit import amp, shell_with_ampnb

ip = pytest.fixture(shell_with_ampnb)

MIXED = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}


@pytest.mark.parametrize("mode", sorted(MIXED))
def test_an_in_place_update_is_seen_by_the_next_forward(ip, mode):
    ip.user_ns["h"] = torch.randn(4, 16)
    cell = ("a = lin(h)\n"
            "with torch.no_grad():\n"
            "    lin.weight.add_(1)\n"
            "b = lin(h)\n"
            "(a, b)")
    native = " --fp16-kernels native" if mode == "16-mixed" else ""  # the reference's kernels
    (a, b), _ = amp(ip, mode + native, cell)
    assert a.dtype == MIXED[mode]
    assert not torch.equal(a, b)
    with torch.no_grad(), torch.autocast("cpu", dtype=MIXED[mode]):
        expected = ip.user_ns["lin"](ip.user_ns["h"])  # the updated weight, cast afresh
    assert torch.equal(b, expected)


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(),
                         nn.Linear(64, 4))


LOOP = ("opt = torch.optim.SGD(net.parameters(), lr=0.05)\n"
        "for _ in range(20):\n"
        "    opt.zero_grad()\n"
        "    loss = torch.nn.functional.mse_loss(net(xs), ys)\n"
        "    loss.backward()\n"
        "    opt.step()\n")


def _recipe(net: nn.Module, xs: torch.Tensor, ys: torch.Tensor, dtype: torch.dtype) -> nn.Module:
    """torch's AMP recipe: autocast around forward and loss only."""
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    for _ in range(20):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=dtype):
            loss = nn.functional.mse_loss(net(xs), ys)
        loss.backward()
        opt.step()
    return net


def test_a_training_loop_in_one_cell_gives_the_recipes_weights(ip):
    net = _net()
    xs, ys = torch.randn(32, 16), torch.randn(32, 4)
    ref = _recipe(copy.deepcopy(net), xs, ys, torch.bfloat16)
    ip.user_ns.update(net=net, xs=xs, ys=ys)
    amp(ip, "bf16-mixed", LOOP)
    for p, q in zip(net.parameters(), ref.parameters(), strict=True):
        assert torch.equal(p, q)  # the same ops in the same order: bit for bit


def test_the_loop_on_ranks_free_code_matches_with_a_scaler(ip):
    """16-mixed with the user's own GradScaler: backward outside autocast, scaler steps as torch's."""
    net = _net()
    xs, ys = torch.randn(32, 16), torch.randn(32, 4)
    ref = copy.deepcopy(net)
    ip.user_ns.update(net=net, xs=xs, ys=ys)
    cell = ("opt = torch.optim.SGD(net.parameters(), lr=0.05)\n"
            "scaler = torch.amp.GradScaler('cpu')\n"
            "for _ in range(5):\n"
            "    opt.zero_grad()\n"
            "    loss = torch.nn.functional.mse_loss(net(xs), ys)\n"
            "    scaler.scale(loss).backward()\n"
            "    scaler.step(opt)\n"
            "    scaler.update()\n")
    amp(ip, "16-mixed --fp16-kernels native", cell)
    opt, scaler = torch.optim.SGD(ref.parameters(), lr=0.05), torch.amp.GradScaler("cpu")
    for _ in range(5):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = nn.functional.mse_loss(ref(xs), ys)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    for p, q in zip(net.parameters(), ref.parameters(), strict=True):
        assert torch.equal(p, q)
    ip.user_ns.pop("scaler", None)


def test_functional_ops_run_under_autocast_and_backward_does_not(ip):
    """`a @ b` is lowered; a region the cell runs with autocast off stays fp32 in backward too."""
    ip.user_ns.update(a=torch.randn(8, 8, requires_grad=True), b=torch.randn(8, 8))
    cell = ("y = a @ b\n"
            "with torch.autocast('cpu', enabled=False):\n"
            "    z = a @ b\n"
            "(y.float().sum() + z.sum()).backward()\n"
            "(y.dtype, z.dtype)\n")
    with trace_ops() as t:
        dtypes, _ = amp(ip, "bf16-mixed", cell)
    assert dtypes == (torch.bfloat16, torch.float32)
    backward_mm = {r.output_dtype for r in t.rows if r.phase == "backward" and r.op == "mm"}
    assert backward_mm == {"bfloat16", "float32"}  # each backward in its forward's dtype
    for name in ("a", "b", "y", "z"):
        ip.user_ns.pop(name, None)


class _Two(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(16, 16)
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.body(x)))


def test_a_kept_module_is_fp32_in_forward_and_backward(ip):
    torch.manual_seed(0)
    ip.user_ns.update(model=_Two(), xs=torch.randn(8, 16))
    cell = "model(xs).float().pow(2).mean().backward()\n"
    with trace_ops() as t:
        amp(ip, '16-mixed --keep-fp32 "head"', cell)
    head = [r for r in t.rows if r.module.startswith("head") and r.op in ("mm", "addmm")]
    assert {r.phase for r in head} == {"forward", "backward"}
    assert all(r.output_dtype == "float32" for r in head), head
    body = [r for r in t.rows if r.module.startswith("body") and r.op in ("mm", "addmm")]
    assert any(r.output_dtype == "float16" for r in body)  # the rest is fp16 as the mode says


def test_the_cell_leaves_autocast_and_the_mode_stack_as_they_were(ip):
    with pytest.raises(ZeroDivisionError):
        amp(ip, "bf16-mixed", "lin(x).sum().backward()\n1 / 0")
    assert _get_current_function_mode_stack() == []
    assert not torch.is_autocast_enabled("cpu") and torch.is_autocast_cache_enabled()


def test_an_error_in_backward_shows_no_ampnb_frame(ip):
    """The user's traceback ends in torch's engine call, as in a plain cell."""
    import re

    from IPython.utils.capture import capture_output

    ip.user_ns["t"] = torch.randn(3)  # needs no grad: backward raises inside the engine
    with capture_output() as out:
        ip.run_cell("%%amp bf16-mixed\ny = t * 2\ny.sum().backward()\n")
    shown = re.sub(r"\x1b\[[0-9;]*m", "", out.stdout + out.stderr)
    assert "does not require grad" in shown
    assert "ampnb" not in shown.replace("%%amp", "")
    for name in ("t", "y"):
        ip.user_ns.pop(name, None)


def test_a_shape_error_in_emulated_fp16_kernels_ends_in_the_users_code(ip):
    """16-mixed runs its products in ampnb's kernels; the user's own mistake shows as without them."""
    import re

    from IPython.utils.capture import capture_output

    ip.user_ns["bad"] = torch.randn(3, 5)  # lin takes 16 features
    with capture_output() as out:
        ip.run_cell("%%amp 16-mixed --fp16-kernels emulated\nlin(bad)\n")
    shown = re.sub(r"\x1b\[[0-9;]*m", "", out.stdout + out.stderr)
    assert "cannot be multiplied" in shown
    frames = [line for line in shown.splitlines() if line.startswith("File ")]
    assert frames and "ampnb" not in frames[-1] and "torch" in frames[-1], frames
    ip.user_ns.pop("bad", None)


def test_a_weight_used_twice_gets_the_recipes_gradient(ip):
    """The recipe casts a weight once per autocast region: the two uses' bf16 gradients are summed
    before the cast back; the cell caches the cast the same way, from forward to backward."""
    torch.manual_seed(0)
    lin, x = nn.Linear(16, 16), torch.randn(8, 16)
    ref = copy.deepcopy(lin)
    ip.user_ns.update(two=lin, xs=x)
    amp(ip, "bf16-mixed", "(two(xs) * two(3 * xs)).sum().backward()\n")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = (ref(x) * ref(3 * x)).sum()
    loss.backward()
    assert torch.equal(lin.weight.grad, ref.weight.grad)
    assert torch.equal(lin.bias.grad, ref.bias.grad)
    for name in ("two", "xs"):
        ip.user_ns.pop(name, None)


def test_a_loop_reusing_a_weight_matches_the_recipe_bit_for_bit(ip):
    torch.manual_seed(0)
    lin, x = nn.Linear(16, 16), torch.randn(8, 16)
    ref = copy.deepcopy(lin)
    ip.user_ns.update(two=lin, xs=x)
    cell = ("opt = torch.optim.SGD(two.parameters(), lr=0.01)\n"
            "for _ in range(3):\n"
            "    opt.zero_grad()\n"
            "    (two(xs) * two(3 * xs)).float().pow(2).mean().backward()\n"
            "    opt.step()\n")
    amp(ip, "bf16-mixed", cell)
    opt = torch.optim.SGD(ref.parameters(), lr=0.01)
    for _ in range(3):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = (ref(x) * ref(3 * x)).float().pow(2).mean()
        loss.backward()
        opt.step()
    for p, q in zip(lin.parameters(), ref.parameters(), strict=True):
        assert torch.equal(p, q)
    for name in ("two", "xs"):
        ip.user_ns.pop(name, None)


def test_deberta_v2_attention_trains_as_the_recipe_bit_for_bit(ip):
    """DeBERTa-v2 applies query_proj/key_proj to its relative embeddings too: weights used twice."""
    pytest.importorskip("transformers")
    from transformers import DebertaV2Config, DebertaV2ForSequenceClassification

    cfg = DebertaV2Config(vocab_size=64, hidden_size=32, num_hidden_layers=2,
                          num_attention_heads=2, intermediate_size=64, max_position_embeddings=32,
                          relative_attention=True, pos_att_type=["p2c", "c2p"], position_buckets=8,
                          max_relative_positions=16, share_att_key=True, num_labels=2,
                          hidden_dropout_prob=0.0,
                          attention_probs_dropout_prob=0.0)
    torch.manual_seed(0)
    net = DebertaV2ForSequenceClassification(cfg)
    ref = copy.deepcopy(net)
    ids, labels = torch.randint(0, 64, (4, 16)), torch.randint(0, 2, (4,))
    ip.user_ns.update(deb=net, ids=ids, labels=labels)
    cell = ("opt = torch.optim.SGD(deb.parameters(), lr=0.1)\n"
            "for _ in range(3):\n"
            "    opt.zero_grad()\n"
            "    deb(input_ids=ids, labels=labels).loss.backward()\n"
            "    opt.step()\n")
    amp(ip, "bf16-mixed", cell)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for _ in range(3):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = ref(input_ids=ids, labels=labels).loss
        loss.backward()
        opt.step()
    for (name, p), q in zip(net.named_parameters(), ref.parameters(), strict=True):
        assert torch.equal(p, q), name
    for name in ("deb", "ids", "labels"):
        ip.user_ns.pop(name, None)


def test_a_watch_sees_a_loop_run_in_a_cell_and_both_leave_the_mode_stack_as_it_was(ip):
    import ampnb

    net = _net()
    xs, ys = torch.randn(32, 16), torch.randn(32, 4)
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    ip.user_ns.update(net=net, xs=xs, ys=ys, opt=opt)
    cell = ("for _ in range(3):\n"
            "    opt.zero_grad()\n"
            "    torch.nn.functional.mse_loss(net(xs), ys).backward()\n"
            "    opt.step()\n")
    with ampnb.watch(net, opt) as w:
        amp(ip, "bf16-mixed", cell)
    assert [r.micro_batches for r in w.records] == [1, 1, 1]
    assert all(r.loss == r.loss and not r.nonfinite for r in w.records)
    assert _get_current_function_mode_stack() == []


def test_a_watch_opened_in_one_cell_sees_the_loop_of_the_next(ip):
    """The first cell's end leaves the watch's listener (and the mode that serves it) in place;
    closing the watch leaves the mode stack as it was."""
    import ampnb

    net = _net()
    ip.user_ns.update(net=net, xs=torch.randn(32, 16), ys=torch.randn(32, 4), ampnb=ampnb,
                      opt=torch.optim.SGD(net.parameters(), lr=0.05))
    amp(ip, "bf16-mixed", "w = ampnb.watch(net, opt)\n")
    amp(ip, "bf16-mixed", "for _ in range(3):\n"
                          "    opt.zero_grad()\n"
                          "    torch.nn.functional.mse_loss(net(xs), ys).backward()\n"
                          "    opt.step()\n")
    w = ip.user_ns.pop("w")
    w.close()
    assert [r.micro_batches for r in w.records] == [1, 1, 1]
    assert all(r.loss == r.loss for r in w.records)
    assert _get_current_function_mode_stack() == []
    ip.user_ns.pop("ampnb", None)
