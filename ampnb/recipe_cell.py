"""A `%%amp` cell's own lines as plain torch code: under autocast, with its backward outside.

Used by `--show-code`. Lines the change does not touch stay as the user wrote them. Pure core.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator, Mapping

from ampnb.recipe_code import autocast_call

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
