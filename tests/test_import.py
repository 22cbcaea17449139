"""`import ampnb` and the pure core stay light: no IPython, ipywidgets, matplotlib, no probing."""

from __future__ import annotations

import ast
import json
import pathlib
import re
import subprocess
import sys
import textwrap

import pytest

import ampnb

JUPYTER_SIDE = ("IPython", "ipywidgets", "matplotlib")


def run_fresh(code: str, report: bool = False) -> dict:
    """Run code in a fresh interpreter and return the JSON it prints last."""
    code = textwrap.dedent(code) + (REPORT if report else "")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True,
                         text=True, timeout=120, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


REPORT = f"""
import json, sys
heavy = sorted(m for m in sys.modules if m.split(".")[0] in {set(JUPYTER_SIDE)!r})
ours = sorted(m for m in sys.modules if m == "ampnb" or m.startswith("ampnb."))
print(json.dumps({{"heavy": heavy, "ours": ours}}))
"""


def test_bare_import_loads_only_the_package_init():
    found = run_fresh("import ampnb", report=True)
    assert found["ours"] == ["ampnb", "ampnb._lazy"]  # the one lazy-export helper, stdlib only
    assert found["heavy"] == []


def test_first_public_use_stays_in_the_pure_core():
    found = run_fresh("""
        import ampnb
        fmt = ampnb.get_format("bf16")
        assert fmt.mantissa_bits == 7
    """, report=True)
    assert "ampnb.formats" in found["ours"]
    assert found["heavy"] == []


@pytest.mark.parametrize("modules", ["ampnb.modes, ampnb.device, ampnb.formats", "ampnb.device"])
def test_core_modules_do_not_import_the_jupyter_side(modules):
    found = run_fresh(f"import {modules}", report=True)
    assert found["heavy"] == []


def test_using_the_device_module_stays_in_the_pure_core():
    found = run_fresh("""
        import ampnb
        repr(ampnb.support_table())
        with ampnb.tf32(True):
            pass
        ampnb.device.matmul_throughput("cpu", "fp32", 32)
    """, report=True)
    assert found["heavy"] == []


def test_importing_the_core_probes_no_hardware():
    found = run_fresh("""
        import json, torch
        calls = []
        def spy(name, real):
            def probe(*args, **kwargs):
                calls.append(name)
                return real(*args, **kwargs)
            return probe
        torch.cuda.is_available = spy("cuda.is_available", torch.cuda.is_available)
        torch.cuda.device_count = spy("cuda.device_count", torch.cuda.device_count)
        torch.backends.mps.is_available = spy("mps.is_available", torch.backends.mps.is_available)
        torch.backends.cpu.get_cpu_capability = spy("cpu capability",
                                                    torch.backends.cpu.get_cpu_capability)
        import ampnb, ampnb.device, ampnb.modes, ampnb.formats
        at_import = list(calls)
        ampnb.device.devices()
        print(json.dumps({"at_import": at_import, "after_use": calls}))
    """)
    assert found["at_import"] == []
    assert "cuda.is_available" in found["after_use"]  # the spy works: devices() does probe


# The public API of the package (docs/design.md): every name stays, resolved lazily.
PUBLIC = {"FloatFormat", "FORMATS", "get_format", "quantize", "PrecisionMode", "MODES", "get_mode",
          "devices", "support", "support_table", "tf32", "set_tf32", "coverage", "capture",
          "trace_ops", "find_nonfinite", "memory_report", "Workbench", "ScalerStepper", "compare",
          "doctor", "keep_fp32", "run_distributed",
          "formats", "modes", "device", "models", "instruments", "plots", "panels", "fp8",
          "lowbit", "distributed"}


def test_every_public_name_is_listed_and_resolves():
    found = run_fresh("""
        import ampnb, json
        kinds = {n: type(getattr(ampnb, n)).__name__ for n in ampnb.__all__}
        print(json.dumps({"all": ampnb.__all__, "dir": dir(ampnb), "kinds": kinds}))
    """)
    assert PUBLIC <= set(found["all"]) and found["dir"] == found["all"]
    submodules = {"formats", "modes", "device", "models", "instruments", "plots", "panels", "fp8",
                  "lowbit", "distributed", "integrations", "watcher", "watchlog", "diagnosis"}
    assert {n for n, kind in found["kinds"].items() if kind == "module"} == submodules
    with pytest.raises(AttributeError, match="module 'ampnb' has no attribute 'nope'"):
        ampnb.nope  # noqa: B018


def test_the_package_has_one_lazy_export_helper():
    source = (ROOT / "__init__.py").read_text()
    assert "lazy_exports(" in source and "importlib" not in source


# ---------------------------------------------------------------- no import cycles

ROOT = pathlib.Path(ampnb.__file__).parent

def _modules() -> dict[str, pathlib.Path]:
    found = {}
    for path in ROOT.rglob("*.py"):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _import_nodes(name: str, path: pathlib.Path) -> list[tuple[str, tuple[str, ...] | None, int]]:
    """(module, names imported from it or None for `import module`, line) for every import in
    the file at any depth, relative ones resolved against the module's package."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: list[tuple[str, tuple[str, ...] | None, int]] = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(a.name, None, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*up, base] if base else up)
            found.append((base, tuple(a.name for a in node.names), node.lineno))
    return found


def _import_sites(name: str, path: pathlib.Path, modules: dict) -> list[tuple[str, int]]:
    """(ampnb module, line) for every import in the file: module or function level, relative ones
    resolved, and under `if TYPE_CHECKING:` too (a cycle for the type checker is still a cycle of
    the design)."""
    found: list[tuple[str, int]] = []
    for base, names, line in _import_nodes(name, path):
        found += [(base, line)] if names is None else [
            (f"{base}.{n}" if f"{base}.{n}" in modules else base, line) for n in names]
    return [(m, line) for m, line in found if m in modules and m != name]


def _imports(name: str, path: pathlib.Path, modules: dict) -> set[str]:
    """ampnb modules imported anywhere in the file (see `_import_sites`)."""
    return {m for m, _ in _import_sites(name, path, modules)}


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the graph as a path a -> ... -> a, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def walk(v: str) -> list[str] | None:
        state[v] = 1
        path.append(v)
        for w in sorted(graph[v]):
            if state.get(w) == 1:
                return path[path.index(w):] + [w]
            if w not in state and (found := walk(w)):
                return found
        state[v] = 2
        path.pop()
        return None

    for v in sorted(graph):
        if v not in state and (found := walk(v)):
            return found
    return None


def test_the_graph_sees_module_and_function_level_imports():
    graph = import_graph()
    assert "ampnb.cpu" in graph["ampnb.fp16_kernels"]          # module level
    assert "ampnb.magics" in graph["ampnb"]                           # inside a function
    assert "ampnb.fp8.te" in graph["ampnb.modes.transformer_engine"]  # inside a method
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_the_graph_counts_imports_for_the_type_checker_too(tmp_path):
    source = tmp_path / "typed.py"
    source.write_text(textwrap.dedent("""
        import typing
        from typing import TYPE_CHECKING
        if TYPE_CHECKING:
            from ampnb.modes import PrecisionMode
        if typing.TYPE_CHECKING:
            import ampnb.formats
    """))
    found = _imports("ampnb.typed", source, _modules())
    assert found == {"ampnb.modes", "ampnb.formats"}


def test_no_import_cycle_in_ampnb():
    graph = import_graph()
    cycle = _cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


# ---------------------------------------------------------------- rooms

def _room(module: str) -> str | None:
    """The room a module lives in: the top-level module or package directly under ampnb/
    (`ampnb.diagnosis.replay` -> 'diagnosis'); None for the package's own __init__."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


def room_imports() -> dict[tuple[str, str], list[str]]:
    """(importing room, imported room) -> every 'file:line' where that import is written."""
    modules = _modules()
    found: dict[tuple[str, str], list[str]] = {}
    for name, path in sorted(modules.items()):
        for target, line in _import_sites(name, path, modules):
            a, b = _room(name), _room(target)
            if a and b and a != b:
                where = f"{path.relative_to(ROOT.parent)}:{line}"
                found.setdefault((a, b), []).append(where)
    return found


def _reachable(edges: set[tuple[str, str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for a, b in edges:
            if a == todo[-1] and b not in seen:
                seen.add(b)
                todo.insert(0, b)
        todo.pop()
    return seen


def rooms_importing_each_other(imports: dict[tuple[str, str], list[str]]) -> list[str]:
    """Each pair of rooms that reach each other through imports (at any depth), with the imports
    between rooms of that tangle: the lines to move."""
    edges = set(imports)
    reach = {r: _reachable(edges, r) for r in sorted({r for e in edges for r in e})}
    lines = []
    for a in reach:
        for b in sorted(reach[a]):
            if a < b and a in reach[b]:
                lines.append(f"{a} <-> {b}")
    tangled = {r for r in reach if r in reach[r]}
    for (a, b), where in sorted(imports.items()):
        if a in tangled and b in tangled and a in reach[b]:
            lines.append(f"  {a} -> {b}: {', '.join(sorted(set(where), key=_site))}")
    return lines


def _site(where: str) -> tuple[str, int]:
    path, line = where.rsplit(":", 1)
    return path, int(line)


def test_the_room_graph_sees_function_level_and_relative_imports(tmp_path):
    imports = room_imports()
    assert "ampnb/fp8/__init__.py:5" in imports[("fp8", "_lazy")]   # module level, absolute
    assert ("magics", "magics") not in imports                      # inside a room: not counted
    fake = {("a", "b"): ["a.py:1"], ("b", "c"): ["b.py:2"], ("c", "a"): ["c.py:3"],
            ("c", "d"): ["c.py:4"]}
    found = rooms_importing_each_other(fake)
    assert found[:3] == ["a <-> b", "a <-> c", "b <-> c"] and "  c -> d: c.py:4" not in found
    assert "  c -> a: c.py:3" in found
    assert rooms_importing_each_other({("a", "b"): ["a.py:1"]}) == []
    source = tmp_path / "rel.py"
    source.write_text("def f():\n    from .. import formats\n    from ..device import hardware\n")
    sites = _import_sites("ampnb.watcher.rel", source, _modules())
    assert ("ampnb.formats", 2) in sites and ("ampnb.device.hardware", 3) in sites


def test_no_two_rooms_import_each_other():
    """The rooms (modules and packages directly under ampnb/) form layers: no two reach each
    other through imports at any depth, function-level ones included."""
    found = rooms_importing_each_other(room_imports())
    assert not found, "rooms importing each other:\n" + "\n".join(found)


# A lazy-export table imports its modules on first use; these entries name a room that imports
# the table's own room (so they are not counted as imports above). Add none: move the code.
LAZY_NAMES_FROM_ABOVE = {("fp8", "comparison"), ("fp8", "lowbit")}


def test_lazy_tables_name_no_room_above_their_own_but_the_known():
    modules, imports = _modules(), room_imports()
    reach = {r: _reachable(set(imports), r) for r in {r for e in imports for r in e}}
    found = set()
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and node.value in modules:
                a, b = _room(name), _room(node.value)
                if a and b and a != b and a in reach.get(b, ()):
                    found.add((a, b))
    assert found == LAZY_NAMES_FROM_ABOVE


def test_the_design_page_names_every_public_name():
    design = (pathlib.Path(__file__).resolve().parents[1] / "docs" / "design.md").read_text()
    surface = design.split("## Public surface", 1)[1].split("\n## ", 1)[0]
    missing = sorted(n for n in PUBLIC if not re.search(rf"\b{re.escape(n)}\b", surface))
    assert not missing, f"docs/design.md's public surface does not name {missing}"


DISPLAY_LAYER = ("ampnb.panels", "ampnb.magics", "ampnb.plots", "ampnb.display")
FORBIDDEN_IN_CORE = (*DISPLAY_LAYER[:3], *JUPYTER_SIDE)


def _in(name: str, packages: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in packages)


def _every_import(name: str, path: pathlib.Path) -> list[tuple[str, int]]:
    """(module, line) of every import in the file, at any depth, relative ones resolved."""
    found: list[tuple[str, int]] = []
    for base, names, line in _import_nodes(name, path):
        found += [(base, line)] + [(f"{base}.{n}", line) for n in names or ()]
    return found


# The package's own `__init__` is IPython's door (`%load_ext ampnb` calls its
# `load_ipython_extension`), so it may name the magics; nothing else in the core may.
JUPYTER_DOOR = "ampnb"


def core_imports_of_display() -> list[str]:
    """'file:line -> module' for each core module's import of the display or Jupyter side."""
    return sorted(f"{path.relative_to(ROOT.parent)}:{line} -> {imported}"
                  for name, path in _modules().items()
                  if not _in(name, DISPLAY_LAYER) and name != JUPYTER_DOOR
                  for imported, line in _every_import(name, path)
                  if _in(imported, FORBIDDEN_IN_CORE))


def test_the_core_check_sees_nested_function_level_imports(tmp_path):
    path = tmp_path / "x.py"
    path.write_text("def f():\n    def g():\n        from ..plots import doctor\n"
                    "        import matplotlib.pyplot\n")
    found = {m for m, _ in _every_import("ampnb.diagnosis.x", path)}
    assert {"ampnb.plots.doctor", "matplotlib.pyplot"} <= found


def test_the_core_imports_no_display_or_jupyter_side():
    assert core_imports_of_display() == []


def test_every_view_the_core_names_resolves_in_the_display_layer():
    from ampnb.display import VIEWS, view

    for name, target in VIEWS.items():
        assert _in(target.partition(":")[0], DISPLAY_LAYER[:3])
        assert callable(view(name))
    with pytest.raises(ValueError, match="unknown view 'nope'"):
        view("nope")
