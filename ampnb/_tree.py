"""The one container walker: tensors inside any nested input or result, on torch's pytree.

torch's pytree knows lists, tuples, dicts, namedtuples and what libraries register with it
(transformers registers every `ModelOutput`). Dataclasses and other mappings it does not know
are opened here too, so a dict, a namedtuple, a dataclass or a ModelOutput is handled alike
everywhere in ampnb.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict, defaultdict
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch.utils import _pytree as pytree

_PLAIN_DICTS = (dict, OrderedDict, defaultdict)


def _known(x: Any) -> bool:
    return pytree._get_node_type(x) in pytree.SUPPORTED_NODES


def _unknown_container(x: Any) -> bool:
    """A dataclass instance or a Mapping that pytree would treat as a leaf."""
    if isinstance(x, torch.Tensor) or _known(x):
        return False
    return isinstance(x, Mapping) or (dataclasses.is_dataclass(x) and not isinstance(x, type))


def _children(x: Any) -> list[tuple[str, Any]] | None:
    """(path text, child) for each child of a container; None for a leaf."""
    if isinstance(x, torch.Tensor):
        return None
    if _known(x):
        if pytree.tree_is_leaf(x):
            return None
        flat, _ = pytree.tree_flatten_with_path(x, is_leaf=lambda y: y is not x)
        attr = isinstance(x, Mapping) and type(x) not in _PLAIN_DICTS  # a ModelOutput
        return [(_key(path[0], attr), v) for path, v in flat]
    if isinstance(x, Mapping):
        return [(f"[{k!r}]", v) for k, v in x.items()]
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return [(f".{f.name}", getattr(x, f.name)) for f in dataclasses.fields(x)]
    return None


def _key(k: Any, attr: bool) -> str:
    if isinstance(k, pytree.SequenceKey):
        return f"[{k.idx}]"
    if isinstance(k, pytree.MappingKey):
        return f".{k.key}" if attr and isinstance(k.key, str) else f"[{k.key!r}]"
    if isinstance(k, pytree.GetAttrKey):
        return f".{k.name}"
    return str(k)


def named_leaves(obj: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """(path, leaf) for every leaf, e.g. ('out.logits', tensor), ('out[0]', 3)."""
    kids = _children(obj)
    if kids is None:
        yield prefix, obj
        return
    for key, value in kids:
        yield from named_leaves(value, prefix + key)


def named_tensors(obj: Any, prefix: str = "") -> list[tuple[str, torch.Tensor]]:
    """(path, tensor) for every tensor inside obj, in order."""
    return [(k, v) for k, v in named_leaves(obj, prefix) if isinstance(v, torch.Tensor)]


def tensors(obj: Any) -> list[torch.Tensor]:
    """Every tensor inside obj, in order (fast path for the plain containers of op arguments)."""
    if isinstance(obj, torch.Tensor):  # the commonest case, without a tree walk
        return [obj]
    found = []
    for leaf in pytree.tree_leaves(obj, is_leaf=_unknown_container):
        if isinstance(leaf, torch.Tensor):
            found.append(leaf)
        elif _unknown_container(leaf):
            found.extend(tensors([v for _, v in _children(leaf)]))
    return found


def map_tensors(fn: Callable[[torch.Tensor], Any], obj: Any) -> Any:
    """obj with fn applied to every tensor inside it; containers keep their types."""
    if isinstance(obj, torch.Tensor):  # the commonest case, without a tree walk
        return fn(obj)

    def one(leaf: Any) -> Any:
        if isinstance(leaf, torch.Tensor):
            return fn(leaf)
        if isinstance(leaf, Mapping):
            mapped = {k: map_tensors(fn, v) for k, v in leaf.items()}
            try:
                return type(leaf)(mapped)
            except TypeError:  # a mapping type that cannot be built from a dict
                return mapped
        if dataclasses.is_dataclass(leaf) and not isinstance(leaf, type):
            changes = {f.name: map_tensors(fn, getattr(leaf, f.name))
                       for f in dataclasses.fields(leaf) if f.init}
            return dataclasses.replace(leaf, **changes)
        return leaf

    return pytree.tree_map(one, obj, is_leaf=_unknown_container)


def plain(obj: Any) -> Any:
    """obj with every container made a dict, list or tuple (a namedtuple a tuple; a dataclass,
    a ModelOutput or any Mapping a dict of its fields): what a data-only file can hold."""
    if isinstance(obj, torch.Tensor):
        return obj
    if isinstance(obj, list):
        return [plain(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(plain(v) for v in obj)
    kids = _children(obj)
    if kids is None:
        return obj
    if isinstance(obj, Mapping):
        return {k: plain(v) for k, v in obj.items()}
    if dataclasses.is_dataclass(obj):
        return {f.name: plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    return tuple(plain(v) for _, v in kids)  # another pytree node: its children in order
