"""`%%amp --doctor` and `%%amp --profile`: the doctor and the profile on the step a cell writes.

The cell computes a loss from a model in the user's namespace (its value is the cell's last
expression, or a variable named `loss`); the doctor runs that code on a converted copy of the
model in every mode and does backward and the optimizer step itself.
"""

from __future__ import annotations

import ast
from typing import Any

import torch
from IPython.core.error import UsageError
from torch import nn

from ampnb.diagnosis.core import DoctorOptions, Progress, doctor_setup
from ampnb.diagnosis.why import Profiles, profile_step


def _names(code: Any) -> set[str]:
    found = set(code.co_names)
    for const in code.co_consts:
        if hasattr(const, "co_names"):
            found |= _names(const)
    return found


def _parse(shell: Any, cell: str) -> tuple[Any, Any, set[str]]:
    source = shell.transform_cell(cell) if shell is not None else cell
    try:
        tree = ast.parse(source)
    except SyntaxError as e:
        raise UsageError(f"the cell is not valid Python: {e.msg} (line {e.lineno})") from None
    last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
    body = compile(tree, "<%%amp --doctor>", "exec")
    expr = compile(ast.Expression(last.value), "<%%amp --doctor>", "eval") if last else None
    names = _names(body) | (_names(expr) if expr else set())
    return body, expr, names


def find_model(ns: dict[str, Any], names: set[str]) -> tuple[str, nn.Module]:
    """The outermost nn.Module the cell names (the one with the most parameters)."""
    mods = {n: ns[n] for n in sorted(names) if isinstance(ns.get(n), nn.Module)}
    mods = {n: m for n, m in mods.items() if any(p.requires_grad for p in m.parameters())}
    if not mods:
        raise UsageError("%%amp --doctor found no model with trainable parameters in the cell; "
                         "write the forward and loss of a model defined earlier, e.g. "
                         "`loss_fn(model(x), y)`")
    name = max(mods, key=lambda n: sum(p.numel() for p in mods[n].parameters()))
    return name, mods[name]


def find_optimizer(ns: dict[str, Any], names: set[str], model: nn.Module
                   ) -> torch.optim.Optimizer | None:
    """An optimizer the cell names whose parameters are the model's (None: AdamW)."""
    own = {id(p) for p in model.parameters()}
    for n in sorted(names):
        opt = ns.get(n)
        if isinstance(opt, torch.optim.Optimizer) and all(
                id(p) in own for g in opt.param_groups for p in g["params"]):
            return opt
    return None


def cell_step(shell: Any, cell: str) -> tuple[nn.Module, torch.optim.Optimizer | None, Any]:
    """(model, optimizer, step): step(net) runs the cell with the model's name bound to net."""
    ns = shell.user_ns if shell is not None else {}
    body, expr, names = _parse(shell, cell)
    name, model = find_model(ns, names)
    optimizer = find_optimizer(ns, names, model)

    def step(net: nn.Module) -> Any:
        scope = {**ns, name: net}
        exec(body, scope)
        loss = eval(expr, scope) if expr is not None else scope.get("loss")
        if any(p.grad is not None for p in net.parameters()):
            raise UsageError("for --doctor, leave backward() and optimizer.step() out of the "
                             "cell: the doctor runs them in every mode")
        if loss is None:
            raise UsageError("the cell gave no loss: end it with the loss expression or assign "
                             "it to `loss`")
        return loss

    return model, optimizer, step


def doctor_cell(shell: Any, cell: str, *, modes: Any = None, device: str | None = None,
                tolerance: Any = None, repeat: int = 3, profile: bool = True) -> Any:
    """What `%%amp --doctor` runs: the doctor on the cell's step (ValueError -> UsageError)."""
    model, optimizer, step = cell_step(shell, cell)
    try:
        options = DoctorOptions(optimizer=optimizer, device=device, modes=modes,
                                tolerance=tolerance, repeat=repeat, profile=profile,
                                progress=Progress())
        return doctor_setup(model, options, step=step)
    except ValueError as e:
        raise UsageError(str(e)) from None


def profile_cell(shell: Any, cell: str, *, modes: Any = ("32-true", "bf16-mixed", "16-mixed"),
                 device: str | None = None) -> Profiles:
    """What `%%amp --profile` runs: why each mode is (not) faster, on the cell's step."""
    model, optimizer, step = cell_step(shell, cell)
    try:
        return profile_step(model, None, optimizer=optimizer, device=device, modes=modes,
                            step=step)
    except ValueError as e:
        raise UsageError(str(e)) from None
