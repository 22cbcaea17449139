"""Take-home code for a recommendation: torch.amp with fp32 islands, Lightning, Accelerate."""

from __future__ import annotations

from ampnb import recipe_code as rc
from ampnb.modes import get_mode

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
    lines = ["import torch", "", *rc.tf32_lines("on" if tf32 else None), *rc.model_lines(m)]
    if keep:
        cast = rc.cast_dtype(m)
        lines += _ISLANDS.format(dev=dev, names=list(keep),
                                 widen="    module.float()\n" if cast else "",
                                 back=f", back_to={rc.dtype_code(cast)}" if cast else "").splitlines()
        lines.append("")
    lines += [*rc.scaler_lines(m, f'"{dev}"'), "", *rc.step_lines(m, rc.Loop(f'"{dev}"'))]
    return "\n".join(lines)


def lightning(mode: str, keep: tuple[str, ...]) -> str:
    """Lightning's Trainer (and Fabric) precision string."""
    line = f'trainer = L.Trainer(precision="{rc.lightning_precision(get_mode(mode))}")'
    if keep:
        line += ("  # and in configure_model(): wrap " + ", ".join(keep)
                 + " with fp32_forward as in the torch.amp code")
    return line


def accelerate(mode: str, keep: tuple[str, ...]) -> str:
    """Accelerate's mixed_precision argument (true modes: cast the model yourself)."""
    call, todo = rc.accelerator_call(get_mode(mode))
    notes = [f"{mode}: {todo}"] if todo else []
    notes += ["then wrap " + ", ".join(keep) + " with fp32_forward"] if keep else []
    return f"accelerator = {call}" + ("  # " + "; ".join(notes) if notes else "")


def code(mode: str, keep: tuple[str, ...], device: str, tf32: bool = False) -> str:
    """All three: torch.amp, Lightning, Accelerate."""
    return "\n".join([f"# torch.amp ({mode})", torch_amp(mode, keep, device, tf32), "",
                      "# Lightning", "import lightning as L", lightning(mode, keep), "",
                      "# Accelerate", "from accelerate import Accelerator", accelerate(mode, keep)])
