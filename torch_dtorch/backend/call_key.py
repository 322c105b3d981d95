"""The per-call key of a compiled graph: the layout id of every input, and the inputs' operand ids.

A compiled model is called with its parameters as graph inputs (a FLUX.1-dev transformer: about a thousand), so
deriving the key input by input (storage -> table entry -> layout) cost ~3 µs per input and call.
:class:`CallKeyMemo` remembers the last call's inputs (weakly), their table entries and layout ids: the next call
re-derives only the inputs that are not the same tensor objects, then checks in one pass (``TABLE.tokens_valid``)
that no remembered binding changed (a ``copy_`` into a parameter, a freed storage).
"""

from __future__ import annotations

import operator
import threading
import weakref
from collections.abc import Sequence
from typing import Any

from torch import Tensor

from torch_dtorch.device.fastpath import layout_of
from torch_dtorch.device.tensors import TABLE

__all__ = ["CallKeyMemo", "fast_key"]

Key = tuple[tuple[int, ...], list[int]]


def _entry(generation: int, a: Any) -> Any | None:
    """The table entry of a live, bound dtorch tensor of this generation; else ``None``."""
    if not isinstance(a, Tensor):
        return None
    try:
        e = TABLE.entry(a)
    except RuntimeError:  # a tensor without storage
        return None
    if e is None or e.generation != generation or a.shape != e.shape or e.operand.mesh is None:
        return None
    if e.layout is None:
        TABLE.set_layout(a, e, layout_of(e.operand))
    return e


def fast_key(generation: int, args: Sequence[Any]) -> Key | None:
    """``((generation, layout id per input), operand ids)`` when every input is a live, bound dtorch tensor of
    this runtime generation; else ``None`` (the slow path handles scalars, unbound tensors and errors)."""
    key = [generation]
    ids: list[int] = []
    for a in args:
        e = _entry(generation, a)
        if e is None:
            return None
        key.append(e.layout)
        ids.append(e.operand.id)
    return tuple(key), ids


class CallKeyMemo:
    """:func:`fast_key` of the last call's inputs, updated incrementally (one per compiled graph). A call that
    finds another thread inside computes the key from scratch."""

    __slots__ = ("_generation", "_ids", "_key", "_lids", "_lock", "_refs", "_tokens")

    def __init__(self) -> None:
        self._generation = -1
        self._refs: list[Any] = []
        self._tokens: list[Any] = []
        self._lids: list[int] = []
        self._ids: list[int] = []
        self._key: tuple[int, ...] | None = None
        self._lock = threading.Lock()

    def key(self, generation: int, args: Sequence[Any]) -> Key | None:
        if not self._lock.acquire(blocking=False):
            return fast_key(generation, args)
        try:
            return self._key_locked(generation, args)
        finally:
            self._lock.release()

    def _key_locked(self, generation: int, args: Sequence[Any]) -> Key | None:
        n = len(args)
        if generation != self._generation or len(self._refs) != n:
            return self._rebuild(generation, args)
        refs = self._refs
        same = list(map(operator.is_, args, [r() for r in refs]))
        if not all(same):
            tokens, lids, ids = self._tokens, self._lids, self._ids
            for i in [i for i, s in enumerate(same) if not s]:
                a = args[i]
                e = _entry(generation, a)
                if e is None:
                    self._generation = -1
                    return None
                refs[i], tokens[i] = weakref.ref(a), e.token
                if lids[i] != e.layout:
                    lids[i] = e.layout
                    self._key = None
                ids[i] = e.operand.id
        if not TABLE.tokens_valid(args, self._tokens):  # rebound (a copy_ into an input) or freed
            return self._rebuild(generation, args)
        if self._key is None:
            self._key = (generation, *self._lids)
        return self._key, list(self._ids)

    def _rebuild(self, generation: int, args: Sequence[Any]) -> Key | None:
        self._generation = -1
        refs, tokens, lids, ids = [], [], [], []
        for a in args:
            e = _entry(generation, a)
            if e is None:
                return None
            refs.append(weakref.ref(a))
            tokens.append(e.token)
            lids.append(e.layout)
            ids.append(e.operand.id)
        self._refs, self._tokens, self._lids, self._ids = refs, tokens, lids, ids
        self._key = (generation, *lids)
        self._generation = generation
        return self._key, list(ids)
