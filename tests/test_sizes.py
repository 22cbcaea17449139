"""Small files with one purpose: functions <= 60 lines, modules <= 400 lines (#43)."""

from __future__ import annotations

import ast
import pathlib

import ampnb

ROOT = pathlib.Path(ampnb.__file__).parent
MAX_FUNCTION, MAX_MODULE = 60, 400


def too_long(path: pathlib.Path, root: pathlib.Path = ROOT.parent) -> list[str]:
    """'file[:line name] N lines' for the module and each function or method over the limit."""
    text = path.read_text()
    where = path.relative_to(root)
    found = [f"{where} {n} lines"] if (n := len(text.splitlines())) > MAX_MODULE else []
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            start = min([node.lineno, *(d.lineno for d in node.decorator_list)])
            if (n := node.end_lineno - start + 1) > MAX_FUNCTION:
                found.append(f"{where}:{node.lineno} {node.name} {n} lines")
    return found


def test_the_size_check_counts_nested_functions_with_decorators_and_long_modules(tmp_path):
    body = "    x = 1\n" * (MAX_FUNCTION - 2)
    (tmp_path / "ok.py").write_text(f"@property\ndef f():\n{body}")
    (tmp_path / "long.py").write_text(f"class C:\n  @staticmethod\n  def g():\n{body}    y = 2\n")
    (tmp_path / "big.py").write_text("x = 1\n" * (MAX_MODULE + 1))
    assert too_long(tmp_path / "ok.py", tmp_path) == []
    assert too_long(tmp_path / "long.py", tmp_path) == [f"long.py:3 g {MAX_FUNCTION + 1} lines"]
    assert too_long(tmp_path / "big.py", tmp_path) == [f"big.py {MAX_MODULE + 1} lines"]


def test_every_function_and_module_is_small():
    assert [hit for path in sorted(ROOT.rglob("*.py")) for hit in too_long(path)] == []
