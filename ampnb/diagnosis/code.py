"""Take-home code for a recommendation: torch.amp with fp32 islands, Lightning, Accelerate."""

from __future__ import annotations

from ampnb.modes import get_mode

LIGHTNING = {"32-true": "32-true", "bf16-mixed": "bf16-mixed", "16-mixed": "16-mixed",
             "bf16-true": "bf16-true", "16-true": "16-true",
             "transformer-engine": "transformer-engine"}
ACCELERATE = {"32-true": '"no"', "bf16-mixed": '"bf16"', "16-mixed": '"fp16"',
              "transformer-engine": '"fp8"'}

_ISLANDS = '''
def fp32_forward(forward, back_to=None):
    """The module's forward with autocast off and fp32 inputs (outputs cast to back_to)."""
    def run(*args, **kwargs):
        wide = lambda t: t.float() if torch.is_tensor(t) and t.is_floating_point() else t
        with torch.autocast("{dev}", enabled=False):
            out = forward(*map(wide, args), **{{k: wide(v) for k, v in kwargs.items()}})
        return out if back_to is None else out.to(back_to)
    return run

for name in {names!r}:  # kept in fp32: the doctor measured them overflowing or imprecise
    module = model.get_submodule(name)
{widen}    module.forward = fp32_forward(module.forward{back})
'''


def torch_amp(mode: str, keep: tuple[str, ...], device: str = "cuda", tf32: bool = False) -> str:
    """A plain PyTorch training step in the mode, with the kept modules in fp32."""
    m = get_mode(mode)
    dev = "cuda" if device.startswith("cuda") else device.split(":")[0]
    lines = ["import torch", ""]
    if tf32:
        lines += ['torch.set_float32_matmul_precision("high")  # TF32 matmuls on Ampere+', ""]
    if not m.is_mixed and mode != "32-true":
        lines += [f"model = model.to({m.param_dtype})  # {mode}: weights, gradients, optimizer "
                  "state in one dtype"]
    if keep:
        true = not m.is_mixed and mode != "32-true"
        lines += _ISLANDS.format(dev=dev, names=list(keep),
                                 widen="    module.float()\n" if true else "",
                                 back=f", back_to={m.param_dtype}" if true else "").splitlines()
    if m.uses_scaler:
        lines += [f'scaler = torch.amp.GradScaler("{dev}")']
    lines += ["", "for inputs, targets in loader:"]
    if m.is_mixed:
        lines += [f'    with torch.autocast("{dev}", dtype={m.autocast_dtype}):',
                  "        loss = loss_fn(model(inputs), targets)"]
    elif mode != "32-true":
        lines += [f"    loss = loss_fn(model(inputs.to({m.param_dtype})), targets)"]
    else:
        lines += ["    loss = loss_fn(model(inputs), targets)"]
    if m.uses_scaler:
        lines += ["    scaler.scale(loss).backward()", "    scaler.step(optimizer)",
                  "    scaler.update()"]
    else:
        lines += ["    loss.backward()", "    optimizer.step()"]
    lines += ["    optimizer.zero_grad()"]
    return "\n".join(lines)


def lightning(mode: str, keep: tuple[str, ...]) -> str:
    """Lightning's Trainer (and Fabric) precision string."""
    line = f'trainer = L.Trainer(precision="{LIGHTNING.get(mode, mode)}")'
    if keep:
        line += ("  # and in configure_model(): wrap " + ", ".join(keep)
                 + " with fp32_forward as in the torch.amp code")
    return line


def accelerate(mode: str, keep: tuple[str, ...]) -> str:
    """Accelerate's mixed_precision argument (true modes: cast the model yourself)."""
    if mode not in ACCELERATE:
        return (f'accelerator = Accelerator(mixed_precision="no")  # {mode}: '
                f"model.to({get_mode(mode).param_dtype}) before accelerator.prepare")
    line = f"accelerator = Accelerator(mixed_precision={ACCELERATE[mode]})"
    return line + ("  # then wrap " + ", ".join(keep) + " with fp32_forward" if keep else "")


def code(mode: str, keep: tuple[str, ...], device: str, tf32: bool = False) -> str:
    """All three: torch.amp, Lightning, Accelerate."""
    return "\n".join([f"# torch.amp ({mode})", torch_amp(mode, keep, device, tf32), "",
                      "# Lightning", "import lightning as L", lightning(mode, keep), "",
                      "# Accelerate", "from accelerate import Accelerator", accelerate(mode, keep)])
