"""Low-bit reports on any model: torch's NestedTensor fast path, and models that sample in eval."""

from __future__ import annotations

import random

import pytest
import torch
from torch import nn

from ampnb.fp8 import quantize_model, sqnr

MODES = ("nf4", "int8")


def _transformer() -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """nn.Transformer in eval mode with a padding mask: torch's encoder takes its NestedTensor
    fast path (its layers see nested tensors) unless that path is off."""
    torch.manual_seed(0)
    model = nn.Transformer(d_model=32, nhead=4, num_encoder_layers=2, num_decoder_layers=1,
                           dim_feedforward=64, batch_first=True).eval()
    g = torch.Generator().manual_seed(1)
    mask = torch.zeros(2, 6, dtype=torch.bool)
    mask[1, 4:] = True
    return model, dict(src=torch.randn(2, 6, 32, generator=g), tgt=torch.randn(2, 5, 32, generator=g),
                       src_key_padding_mask=mask)


def _outputs(model: nn.Module, inputs: dict, names: set[str], seed: int | None = None
             ) -> dict[str, torch.Tensor]:
    """Each named layer's output on one forward, with torch's own slow path (fast path off)."""
    found: dict[str, torch.Tensor] = {}
    hooks = [m.register_forward_hook(lambda _m, _i, o, n=n: found.__setitem__(n, o.detach()))
             for n, m in model.named_modules() if n in names]
    was = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        if seed is not None:
            torch.manual_seed(seed)
        with torch.no_grad():
            model(**inputs) if isinstance(inputs, dict) else model(inputs)
    finally:
        torch.backends.mha.set_fastpath_enabled(was)
        for h in hooks:
            h.remove()
    return found


def test_the_plant_takes_torchs_nested_tensor_fast_path():
    model, inputs = _transformer()
    seen = []
    layer = model.encoder.layers[1]
    h = layer.register_forward_pre_hook(lambda _m, args: seen.append(args[0].is_nested))
    with torch.no_grad():
        model(**inputs)
    h.remove()
    assert seen == [True]


@pytest.mark.parametrize("mode", MODES)
def test_a_transformer_on_its_fast_path_is_measured_layer_by_layer(mode):
    model, inputs = _transformer()
    assert torch.backends.mha.get_fastpath_enabled()
    q, report = quantize_model(model, mode, inputs=inputs)
    assert torch.backends.mha.get_fastpath_enabled()  # the caller's setting is put back
    rows = {e.name: e for e in report.layers}
    ffn = {n for n in rows if ".linear" in n}
    assert {"encoder.layers.0.linear1", "encoder.layers.1.linear2"} <= ffn
    # every layer compared, each against torch's own slow path computed here by hand
    want, got = _outputs(model, inputs, ffn), _outputs(q, inputs, ffn)
    for name in ffn:
        assert rows[name].output_sqnr_db == pytest.approx(sqnr(want[name], got[name]), rel=1e-6)


class SamplingVAE(nn.Module):
    """A VAE whose forward samples z = mu + sigma * noise, in eval mode as in training."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.enc = nn.Linear(16, 64)
        self.mu = nn.Linear(64, 8)
        self.logvar = nn.Linear(64, 8)
        self.from_z = nn.Linear(8, 64)
        self.out = nn.Linear(64, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.enc(x))
        mu, logvar = self.mu(h), self.logvar(h)
        z = mu + torch.randn_like(mu) * torch.exp(0.5 * logvar)
        return self.out(torch.relu(self.from_z(z)))


def test_output_sqnr_compares_the_same_draws_and_leaves_the_callers_rng():
    model = SamplingVAE().eval()
    x = torch.randn(32, 16, generator=torch.Generator().manual_seed(2))
    torch.manual_seed(123)
    random.seed(7)
    before, py_before = torch.get_rng_state(), random.getstate()
    q, report = quantize_model(model, "nf4", inputs=x)
    assert torch.equal(torch.get_rng_state(), before) and random.getstate() == py_before
    # the trusted reference: both forwards from the caller's state, the same noise drawn
    names = {"from_z", "out"}
    want, got = _outputs(model, x, names, seed=123), _outputs(q, x, names, seed=123)
    rows = {e.name: e for e in report.layers}
    for name in names:
        assert rows[name].output_sqnr_db == pytest.approx(sqnr(want[name], got[name]), rel=1e-6)
