"""A map keyed by a tensor's identity that holds no tensor alive and runs no code when one dies.

torch's WeakIdKeyDictionary removes dead keys from a weakref callback: Python code that runs
in a finalizer, where a KeyboardInterrupt is printed and lost. Here the weak references have no
callback; dead entries are dropped when the map has doubled since the last sweep.
"""

from __future__ import annotations

import weakref
from typing import Any

_SWEEP_MIN = 1024


class WeakIdMap:
    """`m[t] = v`, `m.get(t)`, `t in m`, `m.pop(t)`: keys by identity, never kept alive."""

    __slots__ = ("_items", "_sweep_at")

    def __init__(self) -> None:
        self._items: dict[int, tuple[weakref.ref, Any]] = {}
        self._sweep_at = _SWEEP_MIN

    def get(self, key: Any, default: Any = None) -> Any:
        found = self._items.get(id(key))
        return found[1] if found is not None and found[0]() is key else default

    def __contains__(self, key: Any) -> bool:
        found = self._items.get(id(key))
        return found is not None and found[0]() is key

    def __setitem__(self, key: Any, value: Any) -> None:
        self._items[id(key)] = (weakref.ref(key), value)
        if len(self._items) >= self._sweep_at:  # amortized: one sweep per doubling
            self._items = {k: v for k, v in self._items.items() if v[0]() is not None}
            self._sweep_at = max(_SWEEP_MIN, 2 * len(self._items))

    def pop(self, key: Any, default: Any = None) -> Any:
        found = self.get(key, self)
        if found is self:
            return default
        del self._items[id(key)]
        return found

    def __len__(self) -> int:
        return sum(1 for ref, _ in self._items.values() if ref() is not None)

    def __bool__(self) -> bool:
        return bool(self._items)
