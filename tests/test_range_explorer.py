"""RangeExplorer: setting widget values redraws the plot and table; the model is left as it was."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import ampnb
from ampnb import putback_state
from ampnb.instruments.coverage_stats import coverage_table
from ampnb.panels import RangeExplorer
from ampnb.panels import range_explorer as rx


def _demo():
    return ampnb.models.demo("mlp", width=16, batch_size=32, n_batches=1)


@pytest.fixture
def panel():
    return RangeExplorer(_demo())


def _gids(ax, prefix):
    return sorted(a.get_gid() for a in ax.get_children()
                  if (a.get_gid() or "").startswith(prefix))


def test_widgets_have_stable_classes_and_start_on_the_weight_summary(panel):
    assert "ampnb-range-layer" in panel.layer._dom_classes
    assert "ampnb-range-plot" in panel.out._dom_classes
    assert panel.kinds == ("weight", "activation", "gradient")
    assert panel.kind.value == "weight" and panel.layer.value == rx.ALL
    names = [n for n, _ in _demo().model.named_parameters()]
    assert list(panel.layer.options) == [rx.ALL, *names]
    assert _gids(panel.ax, "row:") == sorted(f"row:weight:{n}" for n in names)
    assert panel.draws == 1 and panel.message.value == ""
    legend = [t.get_text() for t in panel.ax.get_legend().get_texts()]
    assert legend == ["fp8_e4m3", "fp16", "bf16", "none holds it"]  # narrowest first


def test_picking_a_gradient_shows_its_histogram_and_the_coverage_of_the_real_gradient(panel):
    d = _demo()  # the same seed: a plain torch step gives the reference gradient
    x, y = d.batches[0]
    d.loss_fn(d.model(x), y).backward()
    grad = dict(d.model.named_parameters())["head.weight"].grad
    panel.kind.value = "gradient"
    assert set(panel.layer.options) == {rx.ALL, *(n for n, _ in d.model.named_parameters())}
    draws = panel.draws
    panel.layer.value = "head.weight"
    assert panel.draws == draws + 1
    assert panel.ax.get_title().startswith("head.weight (gradient)")
    fmts = panel.format_picker.value
    expected = coverage_table([ampnb.coverage(grad, f) for f in fmts])
    for row in expected.rows:
        assert "".join(f"<td>{c}</td>" for c in row) in panel.table.value
    counts = [a for a in panel.ax.get_children() if a.get_gid() == "histogram"][0]
    assert counts.get_data().values.tolist() == (
        ampnb.instruments.exponent_histogram(grad).tolist())


def test_formats_pick_changes_the_lanes_and_the_table(panel):
    panel.kind.value = "activation"
    panel.layer.value = panel.layer.options[1]
    panel.format_picker.value = ("fp8_e5m2",)
    assert _gids(panel.ax, "coverage:") == ["coverage:fp8_e5m2"]
    assert "<td>fp8_e5m2</td>" in panel.table.value and "<td>fp16</td>" not in panel.table.value
    panel.format_picker.value = ("fp16", "bf16")
    assert _gids(panel.ax, "coverage:") == ["coverage:bf16", "coverage:fp16"]


def test_callback_errors_are_shown_in_the_panel_and_cleared_after(panel, monkeypatch):
    panel.format_picker.value = ()
    assert "ValueError: formats is empty" in panel.message.value
    assert "ampnb-range-error" in panel.message.value and "Traceback" in panel.message.value
    assert 'class="ampnb-error ampnb-range-error"' in panel.message.value  # the one error box
    panel.format_picker.value = ("bf16",)
    assert "ampnb-range-error" not in panel.message.value

    def boom(*args, **kwargs):
        raise RuntimeError("plot exploded")
    monkeypatch.setattr(rx, "plot_tensor_histogram", boom)
    panel.layer.value = panel.layer.options[1]
    assert "RuntimeError: plot exploded" in panel.message.value


def test_the_model_grads_rng_mode_and_torch_state_are_left_as_they_were():
    d = _demo()
    d.model.eval()
    marker = [torch.full_like(p, 7.0) for p in d.model.parameters()]
    for p, m in zip(d.model.parameters(), marker):
        p.grad = m
    weights = copy.deepcopy(d.model.state_dict())
    state, rng = putback_state.torch_state(), torch.get_rng_state()
    with torch.no_grad():  # the panel turns grad mode on for its own step only
        panel = RangeExplorer(d)
    panel.recapture.click()
    assert "captured again" in panel.message.value
    assert all(p.grad is m for p, m in zip(d.model.parameters(), marker))
    assert all(torch.equal(v, d.model.state_dict()[k]) for k, v in weights.items())
    assert not d.model.training
    assert torch.equal(torch.get_rng_state(), rng) and putback_state.torch_state() == state
    assert all(not m._forward_hooks for m in d.model.modules())
    assert all(not p._post_accumulate_grad_hooks for p in d.model.parameters())
    assert panel.capture.get("head.weight", "gradient").amax < 7.0  # this batch's gradient


def test_a_users_model_without_loss_fn_shows_weights_and_activations():
    model = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.5), nn.ReLU(), nn.Linear(8, 2))
    x = torch.randn(5, 4)
    rng = torch.get_rng_state()
    panel = RangeExplorer(model, x)
    assert torch.equal(torch.get_rng_state(), rng)  # dropout drew from a forked RNG
    assert panel.kinds == ("weight", "activation")
    assert "pass loss_fn=" in panel.message.value
    panel.kind.value = "activation"
    assert list(panel.layer.options) == [rx.ALL, "0", "1", "2", "3", "(output)"]
    panel.layer.value = "3"
    assert panel.ax.get_title().startswith("3 (activation): 10 elements")


def test_shown_formats_default_to_captured_ones():
    assert RangeExplorer(nn.Linear(2, 2), formats=("bf16", "fp16")).format_picker.value == (
        "fp16", "bf16")
    panel = RangeExplorer(nn.Linear(2, 2), formats=("fp8_e5m2", "fp32"))
    assert panel.format_picker.value == ("fp8_e5m2", "fp32")


def test_no_parameters_and_no_batch_is_a_clear_empty_view():
    panel = RangeExplorer(nn.ReLU())
    assert list(panel.layer.options) == [] and panel.layer.value is None
    assert panel.ax.texts[0].get_text() == "no weight tensors were captured"
    assert panel.table.value == ""


def test_bad_input_is_one_clear_error_and_leaves_no_hooks():
    with pytest.raises(ValueError, match="nn.Module or an ampnb demo"):
        RangeExplorer("mlp")
    with pytest.raises(ValueError, match="fp12"):
        RangeExplorer(nn.Linear(2, 2), formats=("fp16", "fp12"))
    with pytest.raises(ValueError, match="'fp64' is not among formats"):
        RangeExplorer(nn.Linear(2, 2), shown=("fp64",))
    model = nn.Linear(3, 2)
    with pytest.raises(ValueError, match=r"a batch is \(inputs, targets\)"):
        RangeExplorer(model, torch.randn(2, 3), loss_fn=nn.MSELoss())
    with pytest.raises(RuntimeError):  # the user's own shape error, raised as is
        RangeExplorer(model, (torch.randn(2, 5), torch.randn(2, 2)), loss_fn=nn.MSELoss())
    assert not model._forward_hooks and model.weight.grad is None
    assert all(not p._post_accumulate_grad_hooks for p in model.parameters())


def test_a_failing_recapture_is_shown_and_the_old_capture_kept():
    model = nn.Linear(3, 2)
    panel = RangeExplorer(model, (torch.randn(2, 3), torch.randn(2, 2)), loss_fn=nn.MSELoss())
    before = panel.capture
    panel.batch = (torch.randn(2, 5), torch.randn(2, 2))
    panel.recapture.click()
    assert "RuntimeError" in panel.message.value and panel.capture is before
    assert not model._forward_hooks and model.weight.grad is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_cuda_model_gets_its_batch_moved_and_its_cuda_rng_kept():
    d = ampnb.models.demo("mlp", width=16, batch_size=32, n_batches=1, device="cuda")
    x, y = (t.cpu() for t in d.batches[0])  # the panel moves the batch to the model
    rng = torch.cuda.get_rng_state()
    panel = RangeExplorer(d.model, (x, y), loss_fn=d.loss_fn)
    assert torch.equal(torch.cuda.get_rng_state(), rng)
    ref = copy.deepcopy(d.model)
    ref.zero_grad()
    d.loss_fn(ref(x.cuda()), y.cuda()).backward()
    assert panel.capture.get("head.weight", "gradient").amax == (
        ref.head.weight.grad.abs().max().item())
    assert all(p.grad is None for p in d.model.parameters())


def _bits(model):
    return {k: v.detach().clone() for k, v in [*model.named_parameters(), *model.named_buffers()]}


def test_a_batchnorm_model_in_train_mode_is_left_bit_identical():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(),
                          nn.LazyLinear(2))
    x, y = torch.randn(4, 3, 8, 8), torch.randint(0, 2, (4,))
    model(x)  # materialise the lazy layer
    before = _bits(model)
    panel = RangeExplorer(model, (x, y), loss_fn=nn.functional.cross_entropy)
    panel.recapture.click()
    assert "captured again" in panel.message.value and model.training
    after = _bits(model)
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before), [
        k for k in before if not torch.equal(before[k], after[k])]
    # while the capture itself saw this batch's statistics (train-mode BatchNorm ran)
    assert panel.capture.get("1", "activation").amax > 0


class _OwnLoss(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb, self.head = nn.Embedding(10, 8), nn.Linear(8, 3)

    def forward(self, input_ids, labels=None):
        logits = self.head(self.emb(input_ids).mean(1))
        return {"loss": nn.functional.cross_entropy(logits, labels), "logits": logits}


def test_a_dict_batch_with_the_models_own_loss_shows_gradients():
    torch.manual_seed(0)
    model = _OwnLoss()
    batch = {"input_ids": torch.randint(0, 10, (4, 5)), "labels": torch.randint(0, 3, (4,))}
    panel = RangeExplorer(model, batch)
    assert panel.kinds == ("weight", "activation", "gradient")
    ref = copy.deepcopy(model)
    ref(**batch)["loss"].backward()
    assert panel.capture.get("head.weight", "gradient").amax == ref.head.weight.grad.abs().max().item()
    assert all(p.grad is None for p in model.parameters())


def test_each_view_is_drawn_once_and_its_labels_fit_the_figure(panel, monkeypatch):
    """No layout engine: rendering a view draws the figure once (constrained layout drew it
    twice, which doubled the time to open on models with many tensors); the tick labels and
    the legend still lie inside the figure."""
    from matplotlib.figure import Figure
    draws = []
    real = Figure.draw
    monkeypatch.setattr(Figure, "draw", lambda self, r: draws.append(1) or real(self, r))
    for layer in (rx.ALL, panel.layer.options[1]):
        panel.layer.value = layer
        draws.clear()
        panel.figure._repr_png_()
        assert draws == [1]
        r = panel.figure.canvas.get_renderer()
        box = panel.figure.bbox
        labels = [t.get_window_extent(r) for t in panel.ax.get_yticklabels() if t.get_text()]
        assert labels and all(b.x0 >= box.x0 for b in labels)  # the left margin holds them
        if panel.ax.get_legend():
            assert panel.ax.get_legend().get_window_extent(r).y1 <= box.y1


def test_block_view_draws_the_blocks_of_the_chosen_tensor():
    """blocks=: the histogram against each block scale's element range, and per-block flushed
    shares beside tensorwise FP8's; off again gives the plain histogram back."""
    p = RangeExplorer(_demo(), blocks=("mxfp8_e4m3", "nvfp4"))
    assert [v for _, v in p.block.options] == [None, "mxfp8_e4m3", "nvfp4"]
    p.kind.value = "activation"
    p.layer.value = p.layer.options[1]
    p.block.value = "mxfp8_e4m3"
    axes = p.figure.axes
    assert len(axes) == 2 and "blocks of 32" in axes[0].get_title()
    assert axes[1].get_ylabel() == "flushed to zero (%)"
    p.block.value = None
    assert len(p.figure.axes) == 1 and p.message.value == ""
    with pytest.raises(ValueError, match="allowed: mxfp8_e4m3"):
        RangeExplorer(_demo(), blocks=("fp16",))


def test_block_format_names_in_formats_go_to_the_block_view():
    """formats= accepts mxfp8_e4m3 / mxfp8_e5m2 / mxfp4 / nvfp4: they join the block view picker
    (a per-tensor coverage has no meaning for them), the rest stay per-tensor lanes."""
    p = RangeExplorer(_demo(), formats=("fp16", "bf16", "fp8_e4m3", "mxfp8_e4m3", "mxfp8_e5m2",
                                        "mxfp4", "nvfp4"))
    assert p.formats == ("fp16", "bf16", "fp8_e4m3")
    assert [v for _, v in p.block.options] == [None, "mxfp8_e4m3", "mxfp8_e5m2", "mxfp4",
                                               "nvfp4"]
    p.kind.value = "weight"
    p.layer.value = p.layer.options[1]
    p.block.value = "mxfp4"
    assert len(p.figure.axes) == 2 and p.message.value == ""
    with pytest.raises(ValueError, match="at least one per-tensor format"):
        RangeExplorer(_demo(), formats=("mxfp4",))
