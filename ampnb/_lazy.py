"""Lazy public names for a package: each resolved from a name -> module table on first use."""

from __future__ import annotations

import importlib
import inspect
import sys
import types
from collections.abc import Callable, Iterable
from typing import Any


def lazy_exports(package: str, exports: dict[str, str], submodules: Iterable[str] = ()
                 ) -> tuple[Callable[[str], Any], Callable[[], list[str]], list[str]]:
    """`__getattr__`, `__dir__` and `__all__` for a package whose names live in submodules.

    `exports` maps a public name to the module defining it; `submodules` are names of the
    package's own modules, imported when first touched. Keeps `import package` cheap: nothing
    below it (matplotlib, ipywidgets) loads until used.
    """
    modules = frozenset(submodules)
    names = sorted({*exports, *modules})

    def __getattr__(name: str) -> Any:
        if name in exports:
            return getattr(importlib.import_module(exports[name]), name)
        if name in modules:
            return importlib.import_module(f"{package}.{name}")
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    def __dir__() -> list[str]:
        return list(names)

    return __getattr__, __dir__, names


def callable_package(package: str, function: Callable[..., Any]) -> None:
    """Make the (imported) package `package` callable as `function`, with its signature and doc.

    For a public name that is both a function and a package (`ampnb.watch(...)`,
    `ampnb.watch.records`): however the package was first reached, `inspect.signature` and
    Jupyter's Shift-Tab show the function's parameters and docstring, not `(*args, **kwargs)`.
    """
    module = sys.modules[package]

    def __call__(self: types.ModuleType, *args: Any, **kwargs: Any) -> Any:
        return function(*args, **kwargs)

    signature = inspect.signature(function)
    this = inspect.Parameter("self", inspect.Parameter.POSITIONAL_ONLY)
    __call__.__doc__ = function.__doc__
    __call__.__signature__ = signature.replace(parameters=[this, *signature.parameters.values()])
    kind = type(f"Callable{function.__name__.title()}Package", (types.ModuleType,),
                {"__call__": __call__, "__module__": __name__})
    module.__class__ = kind
    module.__signature__ = signature  # what inspect.signature(module) returns
    docs = (inspect.getdoc(function), inspect.cleandoc(module.__doc__ or ""))
    module.__doc__ = "\n\n".join(filter(None, docs))
