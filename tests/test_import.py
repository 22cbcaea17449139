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
                  "lowbit", "distributed", "integrations"}
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


def _imports(name: str, path: pathlib.Path, modules: dict) -> set[str]:
    """ampnb modules imported anywhere in the file: module or function level, and under
    `if TYPE_CHECKING:` too (a cycle for the type checker is still a cycle of the design)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*up, base] if base else up)
            for a in node.names:
                found.add(f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text()))
    return {m for m in found if m in modules and m != name}


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
    assert "ampnb.device.cpu" in graph["ampnb.fp16_kernels"]          # module level
    assert "ampnb.magics" in graph["ampnb"]                           # inside a function
    assert "ampnb.fp8.te" in graph["ampnb.modes"]                     # inside a method
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


def test_the_design_page_names_every_public_name():
    design = (pathlib.Path(__file__).resolve().parents[1] / "docs" / "design.md").read_text()
    surface = design.split("## Public surface", 1)[1].split("\n## ", 1)[0]
    missing = sorted(n for n in PUBLIC if not re.search(rf"\b{re.escape(n)}\b", surface))
    assert not missing, f"docs/design.md's public surface does not name {missing}"
