"""A small, fast tree map for op arguments (tuples, lists, dicts of scalars and tensors).

``torch.utils._pytree`` is general and costs tens of µs per op call; op arguments only ever nest tuples, lists and
dicts, so the hot paths (every eager op) use this instead.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")

__all__ = ["any_leaf", "map_only"]


def map_only(cls: type[T] | tuple[type, ...], fn: Callable[[T], Any], tree: Any) -> Any:
    """``tree`` with every leaf that is an instance of ``cls`` replaced by ``fn(leaf)`` (containers rebuilt)."""
    if isinstance(tree, cls):
        return fn(tree)  # type: ignore[arg-type]
    t = type(tree)
    if t is tuple:
        return tuple([map_only(cls, fn, x) for x in tree])
    if t is list:
        return [map_only(cls, fn, x) for x in tree]
    if t is dict:
        return {k: map_only(cls, fn, v) for k, v in tree.items()}
    return tree


def any_leaf(cls: type | tuple[type, ...], tree: Any) -> bool:
    if isinstance(tree, cls):
        return True
    t = type(tree)
    if t is tuple or t is list:
        return any(any_leaf(cls, x) for x in tree)
    if t is dict:
        return any(any_leaf(cls, v) for v in tree.values())
    return False
