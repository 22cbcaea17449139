"""The IPython extension: `%load_ext ampnb` registers %%amp and %amp; unload removes them."""

from __future__ import annotations

from typing import Any

_LOADED: dict[int, Any] = {}  # id(shell) -> the AmpMagics instance registered on it


def load_ipython_extension(ipython: Any) -> None:
    """Register %%amp and %amp on the shell."""
    from ampnb.magics.amp import load

    unload_ipython_extension(ipython)
    _LOADED[id(ipython)] = load(ipython)


def unload_ipython_extension(ipython: Any) -> None:
    """Remove every magic and config entry that load_ipython_extension added."""
    from ampnb.magics.amp import unload

    magics = _LOADED.pop(id(ipython), None)
    if magics is not None:
        unload(ipython, magics)
