"""What a cell needs from the notebook, packed to send to each rank (and unpacked there).

Values go by pickle; modules by name; functions and classes defined in the notebook (which
pickle cannot send: they live in the kernel's `__main__`) by their source, recompiled on the
rank under their own file name and line numbers so that tracebacks show their lines.
"""

from __future__ import annotations

import ast
import inspect
import io
import linecache
import pickle
import sys
import textwrap
import types
from dataclasses import dataclass, field
from typing import Any

import torch

from ampnb.device import TF32State, tf32_state
from ampnb.fp16_kernels import Fp16Kernels, emulates_fp16
from ampnb.step import StepSettings

# Names every rank gets from the launcher, and the shell's own, never sent.
INJECTED = frozenset({"rank", "world_size", "device", "mode"})
_SHELL = frozenset({"In", "Out", "get_ipython", "exit", "quit", "open"})
ALLOWED = ("picklable values (tensors, numbers, models of importable classes), modules, and "
           "functions or classes defined with def/class in the notebook; build anything else "
           "inside the cell")


@dataclass(frozen=True)
class Item:
    """One name for the rank: kind 'module' (data: module name), 'source' or 'pickle'."""

    kind: str
    name: str
    data: Any


@dataclass(frozen=True)
class RankSettings:
    """A cell's StepSettings as plain values, with what "as is" meant in the notebook.

    `fp16_kernels` is the notebook's decision ('emulated' or 'native'; None: the rank's own
    setting) and `flags` its TF32 flags, so that a rank runs the products the notebook would.
    """

    mode: str
    tf32: str | None = None
    fp16_kernels: str | None = None
    keep_fp32: tuple[str, ...] = ()
    flags: TF32State | None = None

    @classmethod
    def of(cls, s: StepSettings) -> RankSettings:
        """The settings of a cell run in this process, for its ranks: its Precision's mode by
        name (each rank binds it to its own device, `Precision.of(mode, device=...)`)."""
        p = s.precision
        kernels = Fp16Kernels.EMULATED if emulates_fp16(p.device, s.fp16_kernels) else Fp16Kernels.NATIVE
        return cls(p.mode.name, None if s.tf32 is None else s.tf32.value, kernels.value,
                   tuple(s.keep_fp32), tf32_state())


@dataclass(frozen=True)
class Payload:
    """The cell (statements + last expression), what it needs, and the settings to run it under."""

    body: str
    last: str | None
    filename: str
    items: tuple[Item, ...] = ()
    files: dict[str, str] = field(default_factory=dict)
    settings: RankSettings | None = None
    shared: bytes | None = None  # the values that share tensors (a model and its optimizer), together

    @property
    def mode(self) -> str | None:
        """The name of the mode the cell runs under (None: none, as plain code)."""
        return None if self.settings is None else self.settings.mode


def split_cell(source: str) -> tuple[str, str | None]:
    """(statements, last expression or None) of a cell, each keeping the cell's line numbers."""
    tree = ast.parse(source)
    if not tree.body or not isinstance(tree.body[-1], ast.Expr):
        return source, None
    last = tree.body[-1]
    lines = source.splitlines(keepends=True)
    head = lines[last.lineno - 1].encode()[:last.col_offset].decode()  # `a = 1; a`
    body = "".join(lines[:last.lineno - 1]) + head
    return body, "\n" * (last.lineno - 1) + (ast.get_source_segment(source, last) or "None")


def _loaded_names(code: types.CodeType) -> set[str]:
    found = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            found |= _loaded_names(const)
    return found


def _stored_names(source: str) -> set[str]:
    return {n.id for n in ast.walk(ast.parse(source))
            if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}


def _from_notebook(obj: Any) -> bool:
    return isinstance(obj, (type, types.FunctionType)) and getattr(obj, "__module__", None) == "__main__"


def _cell_files(cls: type) -> list[str]:
    """Where a class may be defined: its methods' files, else cells (newest first)."""
    files = [code.co_filename for value in vars(cls).values()
             if (code := getattr(getattr(value, "__func__", value), "__code__", None)) is not None]
    cells = [name for name, entry in reversed(list(linecache.cache.items()))
             if len(entry) == 4 and entry[1] is None]  # IPython's cells: no file behind them
    return list(dict.fromkeys(files + cells))


def _class_source(cls: type) -> tuple[str, int, str]:
    """(file, first line, source) of a class defined in a cell (inspect cannot find it on 3.11)."""
    for path in _cell_files(cls):
        text = "".join(linecache.getlines(path))
        try:
            tree = ast.parse(text)
        except SyntaxError:
            continue
        for node in tree.body:
            if isinstance(node, ast.ClassDef) and node.name == cls.__name__:
                start = min([node.lineno] + [d.lineno for d in node.decorator_list])
                lines = text.splitlines(keepends=True)[start - 1:node.end_lineno]
                return path, start, "".join(lines)
    raise OSError("its source is not available")


def source_of(obj: Any) -> tuple[str, int, str]:
    """(file, first line, dedented source) of a notebook function or class."""
    if isinstance(obj, type):
        return _class_source(obj)
    if obj.__name__ == "<lambda>":
        raise OSError("a lambda has no source of its own; define it with def")
    lines, start = inspect.getsourcelines(obj)
    return inspect.getsourcefile(obj) or obj.__code__.co_filename, max(start, 1), \
        textwrap.dedent("".join(lines))


class _Finder(pickle.Pickler):
    """A pickler that notes the notebook functions and classes a value refers to, and its tensors."""

    def __init__(self, buffer: io.BytesIO, found: list[Any], tensors: set[int]) -> None:
        super().__init__(buffer, protocol=pickle.HIGHEST_PROTOCOL)
        self.found, self.tensors = found, tensors

    def reducer_override(self, obj: Any) -> Any:
        if _from_notebook(obj):
            self.found.append(obj)
        elif isinstance(obj, torch.Tensor):
            self.tensors.add(id(obj))
        return NotImplemented


def _dumps(value: Any) -> tuple[bytes, list[Any], set[int]]:
    buffer, found, tensors = io.BytesIO(), [], set()
    _Finder(buffer, found, tensors).dump(value)
    return buffer.getvalue(), found, tensors


_SHELL_CALLS = {"run_line_magic": "%", "run_cell_magic": "%%", "system": "!", "getoutput": "!"}


def _shell_line(node: ast.AST) -> str | None:
    """`%time`, `%%timeit`, `!ls` for IPython's transformed `get_ipython().…(…)` call; else None."""
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
        return None
    on = node.func.value
    if not (isinstance(on, ast.Call) and isinstance(on.func, ast.Name) and on.func.id == "get_ipython"):
        return None
    prefix = _SHELL_CALLS.get(node.func.attr)
    first = node.args[0] if node.args else None
    if prefix is None or not (isinstance(first, ast.Constant) and isinstance(first.value, str)):
        return f"get_ipython().{node.func.attr}"
    return prefix + first.value.split()[0] if first.value.strip() else prefix


def ipython_lines(source: str) -> list[str]:
    """The lines of (transformed) cell code that need IPython: magics, shell escapes, get_ipython()."""
    tree = ast.parse(source)
    found: dict[int, str] = {}
    for node in ast.walk(tree):
        said = _shell_line(node)
        if said is not None:
            found[node.lineno] = said
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and node.id == "get_ipython":
            found.setdefault(node.lineno, "get_ipython()")
    return [f"line {n} `{found[n]}`" for n in sorted(found)]


def _refuse_ipython(cell: str) -> None:
    """ValueError naming the cell's lines that need IPython, which the ranks do not run."""
    shell_only = ipython_lines(cell)
    if shell_only:
        need = "needs" if len(shell_only) == 1 else "need"
        raise ValueError(f"{', '.join(shell_only)} {need} IPython, which the ranks (plain Python "
                         "processes) do not run; write it in Python or run it in a cell "
                         "without --nproc")


def pack(body: str, last: str | None, filename: str, ns: dict[str, Any],
         mode: str | RankSettings | None = None, extra: dict[str, Any] | None = None,
         source: str | None = None) -> Payload:
    """The payload for a cell that may use names from ns (ValueError: a name cannot be sent, or a
    line needs IPython). `mode`: a mode's name or the cell's RankSettings; `source`: the cell's
    whole text (for its tracebacks' lines); `extra` names are sent whatever their name."""
    cell = body + ("\n" + last.lstrip("\n") if last else "")
    _refuse_ipython(source if source is not None else cell)  # the cell's line numbers
    wanted = _loaded_names(compile(cell, filename, "exec")) | set(extra or ())
    optional = _stored_names(cell)  # bound by the cell itself: sent if possible, else skipped
    ns = {**ns, **(extra or {})}
    items: list[Item] = []
    files = {filename: source if source is not None else cell}
    done: set[str] = set()
    owner: dict[int, str] = {}  # tensor id -> the first name whose value holds it
    linked: set[str] = set()    # names whose values share a tensor with another name's

    def visit(name: str, value: Any) -> None:
        if name in done:
            return
        done.add(name)
        if isinstance(value, types.ModuleType):
            items.append(Item("module", name, value.__name__))
            return
        try:
            if _from_notebook(value):
                path, start, src = source_of(value)
                files.setdefault(path, "".join(linecache.getlines(path)) or src)
                deps = _loaded_names(compile(src, path, "exec"))
                for dep in sorted(deps - done):
                    if dep in ns and _sendable_name(dep) and ns[dep] is not value:
                        visit(dep, ns[dep])
                items.append(Item("source", name, (path, start, src, value.__name__)))
                return
            data, found, held = _dumps(value)
        except (pickle.PicklingError, TypeError, AttributeError, OSError, SyntaxError) as e:
            if name in optional:
                return
            reason = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise ValueError(f"`{name}` ({type(value).__name__}) cannot be sent to the ranks "
                             f"({reason}); a cell on --nproc ranks may use {ALLOWED}") from None
        for obj in found:
            if obj.__qualname__ == obj.__name__:
                visit(obj.__name__, obj)
        for t in held:
            first = owner.setdefault(t, name)
            if first != name:
                linked.update((first, name))
        items.append(Item("pickle", name, data))

    for name in sorted(wanted):
        if name in ns and (name in (extra or {}) or _sendable_name(name)):
            visit(name, ns[name])
    settings = RankSettings(mode) if isinstance(mode, str) else mode
    # Pickled one by one, an optimizer would step copies of its model's parameters: the values
    # that share tensors also go in one pickle, which keeps them shared.
    shared = pickle.dumps({n: ns[n] for n in sorted(linked)}, protocol=pickle.HIGHEST_PROTOCOL) \
        if linked else None
    return Payload(body, last, filename, tuple(items), files, settings, shared)


def _sendable_name(name: str) -> bool:
    return not name.startswith("_") and name not in INJECTED and name not in _SHELL


def unpack(payload: Payload, ns: dict[str, Any]) -> None:
    """Rebuild the names in ns (a rank's `__main__` namespace), in the order they were packed."""
    for path, text in payload.files.items():
        lines = text.splitlines(keepends=True)
        linecache.cache[path] = (len(text), None, lines, path)
    for item in payload.items:
        if item.kind == "module":
            __import__(item.data)
            ns[item.name] = sys.modules[item.data]
        elif item.kind == "source":
            path, start, src, defined = item.data
            exec(compile("\n" * (start - 1) + src, path, "exec"), ns)
            ns[item.name] = ns[defined]
        else:
            ns[item.name] = pickle.loads(item.data)
    if payload.shared is not None:  # once every class is defined: the values, still sharing
        ns.update(pickle.loads(payload.shared))
