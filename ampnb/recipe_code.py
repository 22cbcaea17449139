"""The code ampnb hands out for a mode, written from the mode's own attributes.

One place for torch's AMP recipe as code (the model and input casts of true modes, the
GradScaler, the step: autocast around forward and loss only, then backward, unscale_, clip,
step, update outside it) and for the mode's Lightning / Accelerate spelling. `--show-code`,
the doctor's take-home code and the distributed scripts all write through it. Pure core.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

import torch

from ampnb import legacy
from ampnb.modes import PrecisionMode, TransformerEngine

# Accelerate's `mixed_precision` names autocast dtypes; it has no pure low-precision setting.
ACCELERATE: dict[torch.dtype, str] = {torch.float16: "fp16", torch.bfloat16: "bf16"}


def dtype_code(dtype: torch.dtype) -> str:
    """A dtype as code: torch.bfloat16."""
    return f"torch.{str(dtype).removeprefix('torch.')}"


def cast_dtype(mode: PrecisionMode) -> torch.dtype | None:
    """The dtype a true mode casts the model and its inputs to (None: mixed modes and fp32)."""
    return None if mode.is_mixed or mode.param_dtype == torch.float32 else mode.param_dtype


def lightning_precision(mode: PrecisionMode) -> str:
    """Lightning's `precision=` string for the mode (APEX levels: what replaced them)."""
    if mode.name in legacy.APEX_MODES:
        level = mode.name.removeprefix("apex-")
        return legacy.APEX[level].today.split("=", 1)[1].strip('"')
    return mode.name


def accelerate_precision(mode: PrecisionMode) -> str:
    """Accelerate's `mixed_precision=` string ("no" for true modes: see `accelerate_cast`)."""
    if isinstance(mode, TransformerEngine):
        return "fp8"
    return ACCELERATE.get(mode.autocast_dtype, "no")


def accelerate_cast(mode: PrecisionMode) -> torch.dtype | None:
    """The dtype to cast the model to yourself under Accelerate (a true mode), else None."""
    return None if isinstance(mode, TransformerEngine) else cast_dtype(mode)


def accelerator_call(mode: PrecisionMode) -> tuple[str, str]:
    """`Accelerator(mixed_precision=...)` and what else to do ('' when nothing)."""
    cast = accelerate_cast(mode)
    todo = "" if cast is None else (f"model.to({dtype_code(cast)}) yourself before accelerator."
                                    "prepare: Accelerate has no pure low-precision setting")
    return f'Accelerator(mixed_precision="{accelerate_precision(mode)}")', todo


def tf32_lines(tf32: str | None) -> list[str]:
    """The TF32 switch as code: 'on', 'off', 'emulate' (ampnb's teaching aid) or None (as is)."""
    if tf32 is None:
        return []
    if tf32 == "emulate":
        return ["# --tf32 emulate is an ampnb teaching aid (matmul/conv inputs rounded to TF32).",
                "# On an NVIDIA Ampere+ GPU the real switch is:",
                "# torch.backends.cuda.matmul.allow_tf32 = True; torch.backends.cudnn.allow_tf32 = True",
                ""]
    flag = "True" if tf32 == "on" else "False"
    return [f"torch.backends.cuda.matmul.allow_tf32 = {flag}  # TF32 matmuls (NVIDIA Ampere+ only)",
            f"torch.backends.cudnn.allow_tf32 = {flag}  # TF32 convolutions",
            ""]


def model_lines(mode: PrecisionMode, model: str = "model") -> list[str]:
    """A true mode's model cast (parameters, gradients, optimizer state in one dtype)."""
    cast = cast_dtype(mode)
    lines = []
    if isinstance(mode, TransformerEngine):
        lines.append("# FP8: Transformer Engine's layers (te.Linear, te.LayerNorm) and "
                     "te.fp8_autocast() around the forward; Lightning swaps and enters them for you")
    if cast is not None:
        lines.append(f"{model} = {model}.to({dtype_code(cast)})  # {mode.name}: parameters, "
                     "gradients and optimizer state in one dtype")
    return lines


def scaler_lines(mode: PrecisionMode, device_type: str, note: str = "") -> list[str]:
    """The GradScaler, made once next to the optimizer, for modes that use one.

    `device_type` is an expression: '"cuda"' or 'device.type'.
    """
    if not mode.uses_scaler:
        return []
    return [f"scaler = torch.amp.GradScaler({device_type})" + (f"  # {note}" if note else "")]


def autocast_call(device_type: str, dtype: torch.dtype | None = None, **flags: bool) -> str:
    """`torch.autocast(device_type=..., dtype=...)` as code; flags such as enabled=False."""
    parts = [f"device_type={device_type}"] + ([f"dtype={dtype_code(dtype)}"] if dtype else [])
    return f"torch.autocast({', '.join(parts + [f'{k}={v}' for k, v in flags.items()])})"


@dataclass(frozen=True)
class Loop:
    """How a caller's training loop names things, and its comments per stage.

    `device_type` is an expression (as in scaler_lines); `to_device`, an expression too, moves
    the inputs and targets first. `notes` keys: loop, inputs, forward, backward, scaler.step,
    optimizer.step.
    """

    device_type: str = '"cuda"'
    inputs: str = "inputs"
    targets: str = "targets"
    to_device: str | None = None
    notes: Mapping[str, str] = field(default_factory=dict)
    clip: float | None = None  # max_norm; None shows where clipping goes, as a comment


def _noted(line: str, note: str | None) -> str:
    return f"{line}  # {note}" if note else line


def step_lines(mode: PrecisionMode, loop: Loop = Loop(), *, autocast: bool = True) -> list[str]:
    """torch's AMP recipe for one step per batch: autocast around forward and loss only;
    backward, unscale_, clip, step, update and zero_grad outside it.

    `autocast=False` leaves autocast out (FSDP2's MixedPrecisionPolicy casts parameters itself).
    """
    x, y, notes = loop.inputs, loop.targets, loop.notes
    cast = cast_dtype(mode)
    lines = [_noted(f"for {x}, {y} in loader:", notes.get("loop"))]
    to = ", ".join(filter(None, (loop.to_device, cast and dtype_code(cast))))
    if to:
        moved = f"{x}, {y} = {x}.to({to}), {y}.to({loop.to_device})" if loop.to_device \
            else f"{x} = {x}.to({to})"
        lines.append(_noted(f"    {moved}",
                            notes.get("inputs", "inputs in the parameters' dtype" if cast else "")))
    forward = f"loss = loss_fn(model({x}), {y})"
    if mode.is_mixed and autocast:
        lines += [_noted(f"    with {autocast_call(loop.device_type, mode.autocast_dtype)}:",
                         notes.get("forward", "forward and loss only")),
                  f"        {forward}"]
    else:
        lines.append(_noted(f"    {forward}", notes.get("forward")))
    clip = f"torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm={loop.clip or 1.0})"
    clip = f"    {clip}" if loop.clip else f"    # {clip}  # to clip"
    outside = "outside autocast" if mode.is_mixed and autocast else ""
    if mode.uses_scaler:
        lines += [_noted("    scaler.scale(loss).backward()", notes.get("backward", outside)),
                  "    scaler.unscale_(optimizer)  # the gradients' true size: clip them here",
                  clip,
                  _noted("    scaler.step(optimizer)",
                         notes.get("scaler.step", "skipped when a gradient is inf/NaN")),
                  "    scaler.update()"]
    else:
        lines += [_noted("    loss.backward()", notes.get("backward", outside)), clip,
                  _noted("    optimizer.step()", notes.get("optimizer.step"))]
    return lines + ["    optimizer.zero_grad()"]


def recipe(mode: PrecisionMode, loop: Loop = Loop()) -> list[str]:
    """The whole recipe: model cast, GradScaler, and the step loop."""
    head = [*model_lines(mode), *scaler_lines(mode, loop.device_type)]
    return [*head, *([""] if head else []), *step_lines(mode, loop)]


# ----- a cell's own lines under autocast, with its backward outside -----------------------------

_AUTOGRAD = frozenset({"torch.autograd.backward", "torch.autograd.grad", "autograd.backward",
                       "autograd.grad"})
_OUTSIDE = "backward outside autocast, as in torch's recipe"


def _dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value)
        return f"{base}.{node.attr}" if base else ""
    return ""


def _backward_inputs(node: ast.AST) -> list[ast.expr] | None:
    """The tensors a backward call takes (Tensor.backward, torch.autograd.backward / grad), or
    None when node is no such call."""
    if not isinstance(node, ast.Call):
        return None
    args = [*node.args, *(k.value for k in node.keywords)]
    if _dotted(node.func) in _AUTOGRAD:
        return args
    if isinstance(node.func, ast.Attribute) and node.func.attr == "backward":
        return [node.func.value, *args]
    return None


def _plain(node: ast.AST) -> bool:
    """An expression that runs no autocast-listed op: a name, an attribute, a constant, an index
    by those, or GradScaler.scale of one (a multiply, the same in and out of autocast)."""
    if isinstance(node, (ast.Name, ast.Constant)):
        return True
    if isinstance(node, (ast.Attribute, ast.Starred)):
        return _plain(node.value)
    if isinstance(node, ast.Subscript):
        return _plain(node.value) and _plain(node.slice)
    if isinstance(node, (ast.Tuple, ast.List)):
        return all(map(_plain, node.elts))
    f = getattr(node, "func", None)
    return (isinstance(f, ast.Attribute) and f.attr == "scale" and _plain(f.value)
            and len(node.args) == 1 and not node.keywords and _plain(node.args[0]))


def _simple_statements(body: list[ast.stmt]) -> Iterator[ast.stmt]:
    for s in body:
        inner = [getattr(s, a, []) for a in ("body", "orelse", "finalbody")]
        inner += [h.body for h in getattr(s, "handlers", [])]
        inner += [c.body for c in getattr(s, "cases", [])]
        if any(inner):
            for b in inner:
                yield from _simple_statements(b)
        else:
            yield s


def _backward_statements(tree: ast.Module) -> list[tuple[ast.stmt, list[ast.expr]]]:
    """Each simple statement that runs a backward, with the inputs to compute before it."""
    found = []
    for s in _simple_statements(tree.body):
        calls = [i for i in map(_backward_inputs, ast.walk(s)) if i is not None]
        if calls:
            hoist = [e for inputs in calls for e in inputs if not _plain(e)]
            inside = {id(n) for e in hoist for n in ast.walk(e) if n is not e}
            found.append((s, [e for e in hoist if id(e) not in inside]))
    return found


class _Text:
    """The cell's text, addressed by ast's (line, byte column) positions."""

    def __init__(self, cell: str) -> None:
        self.lines = cell.split("\n")
        self.raw = [line.encode() for line in self.lines]

    def before(self, line: int, col: int) -> str:
        return self.raw[line - 1][:col].decode()

    def after(self, line: int, col: int) -> str:
        return self.raw[line - 1][col:].decode()

    def span(self, node: ast.AST,
             holes: Mapping[tuple[int, int], tuple[int, int, str]] | None = None) -> str:
        """node's source, with the spans starting at each hole's (line, col) replaced."""
        out, (line, col) = [], (node.lineno, node.col_offset)
        end = (node.end_lineno, node.end_col_offset)
        for start, (end_line, end_col, name) in sorted((holes or {}).items()):
            out.append(self._between((line, col), start))
            out.append(name)
            line, col = end_line, end_col
        out.append(self._between((line, col), end))
        return "".join(out)

    def _between(self, a: tuple[int, int], b: tuple[int, int]) -> str:
        if a[0] == b[0]:
            return self.raw[a[0] - 1][a[1]:b[1]].decode()
        mid = [self.raw[i].decode() for i in range(a[0], b[0] - 1)]
        return "\n".join([self.raw[a[0] - 1][a[1]:].decode(), *mid,
                          self.raw[b[0] - 1][:b[1]].decode()])


def _alone(text: _Text, s: ast.stmt) -> bool:
    """The statement has its lines to itself, and no string spans lines inside it."""
    rest = text.after(s.end_lineno, s.end_col_offset).strip()
    return (not text.before(s.lineno, s.col_offset).strip() and (not rest or rest[0] == "#")
            and not any(isinstance(n, ast.Constant) and isinstance(n.value, str)
                        and n.lineno != n.end_lineno for n in ast.walk(s)))


def backward_outside_autocast(cell: str, device_type: str) -> tuple[str, bool] | None:
    """The cell's code with each statement that runs autograd's backward under autocast off (its
    tensor inputs computed just before, still under autocast), and whether there was one.

    None when the cell is not plain Python (IPython syntax). Lines the change does not touch stay
    as written; a cell with such a statement sharing a line is rewritten from its syntax tree.
    """
    try:
        tree = ast.parse(cell)
    except SyntaxError:
        return None
    text = _Text(cell)
    found = _backward_statements(tree)
    if not all(_alone(text, s) for s, _ in found):
        cell = ast.unparse(tree)  # one statement per line, strings on one line
        tree, text = ast.parse(cell), _Text(cell)
        found = _backward_statements(tree)
    used = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    names = (n for n in (f"_loss{i or ''}" for i in range(len(used) + 2)) if n not in used)
    off = f"with {autocast_call(device_type, enabled=False)}:  # {_OUTSIDE}"
    out, done = [], 0
    for s, hoist in found:
        out += text.lines[done:s.lineno - 1]
        indent = text.before(s.lineno, s.col_offset)
        holes = {}
        for e in hoist:
            name, code = next(names), text.span(e)
            out.append(f"{indent}{name} = " + (f"({code})" if "\n" in code else code))
            holes[(e.lineno, e.col_offset)] = (e.end_lineno, e.end_col_offset, name)
        body = (text.span(s, holes) + text.after(s.end_lineno, s.end_col_offset)).split("\n")
        out += [f"{indent}{off}", f"{indent}    {body[0]}", *(f"    {b}" for b in body[1:])]
        done = s.end_lineno
    return "\n".join(out + text.lines[done:]), bool(found)
