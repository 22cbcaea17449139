"""Lazy public names for a package: each resolved from a name -> module table on first use."""

from __future__ import annotations

import importlib
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
