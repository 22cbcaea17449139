"""`Precision.of(...)`'s step and hooks against torch's own AMP recipes, written out by hand:
one optimizer (a VAE-like loss on fp16 outputs, a LayerNorm-first model), several optimizers
(torch's "multiple models, losses and optimizers" recipe), and the scalers torch disables."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import ampnb


class _Vae(nn.Module):
    """An encoder to (mu, logvar) and a decoder: a KL term computed from the fp16 outputs."""

    def __init__(self) -> None:
        super().__init__()
        self.enc, self.dec = nn.Linear(8, 32), nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        mu, logvar = self.enc(x).chunk(2, dim=-1)
        return self.dec(mu), mu, logvar


def _vae_loss(out: tuple[torch.Tensor, ...], x: torch.Tensor) -> torch.Tensor:
    recon, mu, logvar = out
    kl = -0.5 * (1 + logvar - mu * mu - logvar.exp()).sum()  # mu * mu overflows in fp16
    return ((recon - x) ** 2).sum() + kl


def _vae() -> nn.Module:
    torch.manual_seed(0)
    m = _Vae()
    with torch.no_grad():
        m.enc.weight[0, 0] = 300.0  # mu[0] = 300 * x[0]: 300**2 is past fp16's max
    return m


def _vae_batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(4, 8, generator=g) for _ in range(4)]
    for i, x in enumerate(xs):
        x[:, 0] = 1.0 if i == 0 else 0.1  # only the first batch overflows
    return xs


def _recipe(model, opt, scaler, batches, loss_fn, dtype):
    """torch.amp's recipe as its documentation writes it: (losses, skipped steps)."""
    losses, skipped = [], []
    for x, y in batches:
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=dtype):
            loss = loss_fn(model(x), y)
        if scaler is None:
            loss.backward()
            opt.step()
            skipped.append(False)
        else:
            before = scaler.get_scale()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            skipped.append(scaler.get_scale() < before)
        losses.append(loss.detach())
    return losses, skipped


def _same(a: nn.Module, b: nn.Module) -> bool:
    return all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))


def test_the_step_is_the_recipe_bit_for_bit_on_a_loss_computed_from_fp16_outputs():
    xs = _vae_batches()
    ref, mine = _vae(), _vae()
    opt_r = torch.optim.SGD(ref.parameters(), lr=1e-4)
    opt_m = torch.optim.SGD(mine.parameters(), lr=1e-4)
    losses, skipped = _recipe(ref, opt_r, torch.amp.GradScaler("cpu", init_scale=1.0),
                              [(x, x) for x in xs], _vae_loss, torch.float16)
    p = ampnb.Precision.of("16-mixed", model=mine, scaler=torch.amp.GradScaler("cpu", init_scale=1.0))
    outs = [p.step(mine, opt_m, (x, x), _vae_loss) for x in xs]
    assert skipped[0] and not any(skipped[1:])  # the recipe skips the overflowing step only
    assert [o.skipped for o in outs] == skipped
    for o, loss in zip(outs, losses, strict=True):
        assert torch.equal(o.loss, loss) and o.loss.dtype == loss.dtype
    assert _same(ref, mine)


@pytest.mark.parametrize("mode,dtype", [("bf16-mixed", torch.bfloat16), ("16-mixed", torch.float16)])
def test_mixed_modes_do_not_cast_inputs_a_layernorm_first_model_is_the_recipe(mode, dtype):
    def model() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.LayerNorm(8), nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 2))

    g = torch.Generator().manual_seed(2)
    batches = [(torch.randn(4, 8, generator=g) * 3 + 1, torch.randint(0, 2, (4,), generator=g))
               for _ in range(3)]
    ref, mine = model(), model()
    opt_r = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    opt_m = torch.optim.AdamW(mine.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu") if mode == "16-mixed" else None
    losses, _ = _recipe(ref, opt_r, scaler, batches, nn.functional.cross_entropy, dtype)
    p = ampnb.Precision.of(mode, model=mine)
    for (x, y), loss in zip(batches, losses, strict=True):
        assert torch.equal(p.step(mine, opt_m, (x, y), nn.functional.cross_entropy).loss, loss)
    assert _same(ref, mine)


def test_a_true_mode_casts_inputs_as_fabric_does():
    torch.manual_seed(0)
    model = nn.Linear(8, 2).to(torch.bfloat16)
    seen = []
    model.register_forward_pre_hook(lambda m, args: seen.append(args[0].dtype))
    p = ampnb.Precision.of("bf16-true", model=model)
    p.step(model, torch.optim.SGD(model.parameters(), lr=0.1), (torch.randn(4, 8), torch.randn(4, 2)),
           nn.functional.mse_loss)
    assert seen == [torch.bfloat16]


# ----- several optimizers: torch's recipe, one update per iteration --------------------------


def _two() -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    a, b = nn.Linear(8, 4), nn.Linear(8, 4)
    with torch.no_grad():
        a.weight[0, 0] = 6.0  # A's gradients overflow at the first step's scale; B's do not
    return a, b


def _two_batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return [torch.randn(4, 8, generator=g) for _ in range(3)]


def _two_losses(a: nn.Module, b: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return a(x).float().pow(2).mean(), b(x).float().pow(2).mean()


def test_two_optimizers_step_as_torchs_multi_optimizer_recipe_one_update_per_iteration():
    ref_a, ref_b = _two()
    a, b = _two()
    opts_r = [torch.optim.SGD(m.parameters(), lr=1e-2) for m in (ref_a, ref_b)]
    opts = [torch.optim.SGD(m.parameters(), lr=1e-2) for m in (a, b)]
    scaler = torch.amp.GradScaler("cpu")
    p = ampnb.Precision.of("16-mixed", model=a)
    stepped, both = [], []
    for x in _two_batches():
        before = [t.clone() for t in (*ref_a.parameters(), *ref_b.parameters())]
        # https://pytorch.org/docs/stable/notes/amp_examples.html, "Working with Multiple Models,
        # Losses, and Optimizers": each optimizer's step, then one update
        with torch.autocast("cpu", dtype=torch.float16):
            la, lb = _two_losses(ref_a, ref_b, x)
        scaler.scale(la).backward()
        scaler.scale(lb).backward()
        for o in opts_r:
            scaler.step(o)
        scaler.update()
        for o in opts_r:
            o.zero_grad()
        after = (*ref_a.parameters(), *ref_b.parameters())
        both.append(not any(torch.equal(t, u) for t, u in zip(before, after, strict=True)))
        with p.forward_context():
            la, lb = _two_losses(a, b, x)
        p.backward(la)
        p.backward(lb)
        stepped.append(p.optimizer_step(opts))
        for o in opts:
            o.zero_grad()
    assert stepped == both and not both[0] and any(both)  # A's first step skipped, B's not
    assert p.scaler.get_scale() == scaler.get_scale()
    assert _same(ref_a, a) and _same(ref_b, b)


def test_a_second_optimizer_stepped_after_the_update_is_refused_before_anything_changes():
    a, b = _two()
    opts = [torch.optim.SGD(m.parameters(), lr=1e-2) for m in (a, b)]
    p = ampnb.Precision.of("16-mixed", model=a)
    with p.forward_context():
        la, lb = _two_losses(a, b, _two_batches()[0])
    p.backward(la)
    p.backward(lb)
    p.optimizer_step(opts[0])
    before = [t.clone() for t in b.parameters()]
    scale = p.scaler.get_scale()
    with pytest.raises(ValueError, match=r"optimizer_step\(\[opt_a, opt_b\]\)"):
        p.optimizer_step(opts[1])
    assert all(torch.equal(t, u) for t, u in zip(b.parameters(), before, strict=True))
    assert p.scaler.get_scale() == scale


# ----- scalers torch disabled ---------------------------------------------------------------


@pytest.mark.skipif(torch.cuda.is_available(), reason="torch disables a CUDA scaler only without CUDA")
def test_a_cuda_scaler_on_a_cpu_only_machine_is_refused_naming_the_device_and_the_scaler():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's own warning that it disabled the scaler
        scaler = torch.amp.GradScaler()  # CUDA by default
    model = nn.Linear(4, 2)
    with pytest.raises(ValueError, match=r"GradScaler\('cuda'.*disabled.*cpu.*GradScaler\('cpu'\)"):
        ampnb.Precision.of("16-mixed", model=model, scaler=scaler)


def test_a_disabled_scaler_or_one_for_another_device_is_refused():
    with pytest.raises(ValueError, match=r"GradScaler\('cpu', enabled=False\).*disabled"):
        ampnb.Precision.of("16-mixed", model=nn.Linear(4, 2),
                           scaler=torch.amp.GradScaler("cpu", enabled=False))
    if torch.cuda.is_available():
        with pytest.raises(ValueError, match=r"GradScaler\('cuda'\).*runs on cpu \(where the model's parameters"):
            ampnb.Precision.of("16-mixed", model=nn.Linear(4, 2), scaler=torch.amp.GradScaler("cuda"))
