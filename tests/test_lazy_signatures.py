"""A lazily exported name shows what it is: Shift-Tab and `inspect.signature` give the real
parameters and docstring of every public callable; every public entry point is a plain function
or a class."""

from __future__ import annotations

import importlib
import inspect
import pathlib
import subprocess
import sys

import pytest

import ampnb

ROOT = pathlib.Path(__file__).resolve().parents[1]
# Every package whose __init__ builds its names with the one lazy-export helper.
PACKAGES = sorted(".".join(p.parent.relative_to(ROOT).parts)
                  for p in (ROOT / "ampnb").rglob("__init__.py")
                  if "lazy_exports(" in p.read_text())
# Takes any Lightning 1.x Trainer keyword on purpose, and names the unknown ones.
BARE_BY_DESIGN = {("ampnb", "explain_precision")}


def _exports() -> list[tuple[str, str]]:
    found = []
    for name in PACKAGES:
        package = importlib.import_module(name)
        for attr, module in getattr(package, "_EXPORTS", {}).items():
            found.append((name, attr))
            assert module.startswith("ampnb."), (name, attr, module)
    return found


def test_the_lazy_packages_are_found():
    assert {"ampnb", "ampnb.fp8", "ampnb.lowbit", "ampnb.panels"} <= set(PACKAGES)


@pytest.mark.parametrize("package, name", _exports())
def test_a_lazy_name_is_the_object_its_module_defines(package, name):
    found = getattr(importlib.import_module(package), name)
    defined = getattr(importlib.import_module(importlib.import_module(package)._EXPORTS[name]), name)
    assert found is defined
    if callable(found) and not isinstance(found, type(inspect)):
        assert str(inspect.signature(found)) == str(inspect.signature(defined))
        assert inspect.getdoc(found) == inspect.getdoc(defined)


def _bare(sig: inspect.Signature) -> bool:
    kinds = [p.kind for p in sig.parameters.values()]
    return bool(kinds) and all(k in (k.VAR_POSITIONAL, k.VAR_KEYWORD) for k in kinds)


@pytest.mark.parametrize("package, name", [pn for pn in _exports() if pn not in BARE_BY_DESIGN])
def test_no_public_callable_shows_a_bare_star_args_signature(package, name):
    found = getattr(importlib.import_module(package), name)
    if callable(found) and not isinstance(found, type):
        assert not _bare(inspect.signature(found)), f"{package}.{name}{inspect.signature(found)}"


@pytest.mark.parametrize("package, name", _exports())
def test_public_entry_points_are_plain_functions_or_classes(package, name):
    """No module made callable, no function carrying others as attributes: what a function
    carried has its own public name (ampnb.diagnosis.replay, ampnb.watchlog.read_log)."""
    found = getattr(importlib.import_module(package), name)
    if callable(found):  # a cached function (functools.lru_cache) is a plain function too
        plain = inspect.isfunction(inspect.unwrap(found))
        assert plain or isinstance(found, type), f"{package}.{name}: {found!r}"
        carried = sorted(k for k in getattr(found, "__dict__", {}) if not k.startswith("_"))
        assert not inspect.isfunction(found) or not carried, f"{package}.{name} carries {carried}"


def test_watch_and_doctor_are_plain_functions():
    from ampnb.diagnosis.core import doctor
    from ampnb.watcher.core import watch

    assert ampnb.watch is watch and ampnb.doctor is doctor
    assert inspect.isfunction(ampnb.watch) and inspect.isfunction(ampnb.doctor)


@pytest.mark.parametrize("first", ["import ampnb", "import ampnb.watchlog.records",
                                   "from ampnb.watcher import Watch"])
def test_shift_tab_shows_watchs_parameters_however_watch_was_reached(first):
    code = (f"{first}\nimport ampnb\nfrom IPython.core.oinspect import Inspector\n"
            "info = Inspector(theme_name='nocolor').info(ampnb.watch)\n"
            "print(info['definition'].replace(chr(10), ' '))\nprint(info['docstring'].splitlines()[0])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True).stdout
    assert "model:" in out and "keep_overflow" in out and "*args" not in out
    assert "Record the user's own training loop" in out
