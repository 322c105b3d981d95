"""dtorch tensors <-> operands.

A dtorch tensor is a storage-less PrivateUse1 tensor with the global shape. Every tensor our kernels return gets a
fresh (0-byte) storage, so the storage identifies the operand: ``detach()``, ``nn.Parameter(t)``, ``.data`` and
``alias`` make new tensor objects over the same storage without calling the backend, and resolve for free. The
table is keyed by the storage's Python object (stable for the storage's lifetime), never by ``id(tensor)``; a
weak reference to the storage frees the operand's blobs on the workers when the last tensor over it dies.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch

from torch_dtorch._compat import create_empty_tensor
from torch_dtorch.device import native
from torch_dtorch.errors import DTorchError
from torch_dtorch.graph import Operand

__all__ = ["DEVICE_NAME", "NativeTable", "StaleTensorError", "TensorTable", "is_dtorch"]

DEVICE_NAME = "dtorch"


class StaleTensorError(DTorchError, RuntimeError):
    """A dtorch tensor from a worker pool that was shut down or restarted."""


def is_dtorch(t: object) -> bool:
    return isinstance(t, torch.Tensor) and t.device.type == DEVICE_NAME


_create = create_empty_tensor


class _Entry(weakref.ref):  # type: ignore[type-arg]
    """A live storage's table entry: a weak reference to the storage (cheaper than ``weakref.finalize``) that
    knows its key, operand and free callback."""

    __slots__ = ("key", "on_free", "operand", "generation", "shape", "layout")
    key: int
    #: what :meth:`TensorTable.tokens_valid` checks: the entry itself (a rebinding replaces it)
    token = property(lambda self: self)
    on_free: Callable[[Operand], None]
    operand: Operand
    generation: int
    shape: tuple[int, ...]
    #: interned (mesh, placements, shape, stride, dtype) id, filled lazily by the eager fast path
    layout: int | None


def _checked(t: torch.Tensor, generation: int, found: tuple[Operand, int, tuple[int, ...]] | None) -> Operand:
    """The operand of ``found`` (operand, generation, shape of ``t``'s table entry), or the typed error that says why
    ``t`` cannot be used."""
    if found is None:
        raise StaleTensorError(
            f"this dtorch tensor (shape {tuple(t.shape)}) is not known to the running workers; it was made "
            "by a worker pool that has been shut down or restarted — recreate it"
        )
    operand, gen, shape = found
    if gen != generation:
        raise StaleTensorError(
            f"this dtorch tensor (shape {tuple(t.shape)}) belongs to a worker pool that was restarted "
            "(init_device_mesh with other settings, or shutdown); recreate it on the new mesh"
        )
    if tuple(t.shape) != shape:
        raise DTorchError(
            f"a dtorch tensor of shape {tuple(t.shape)} shares storage with one of shape {shape}: it was "
            "made by an aliasing op dtorch did not see (as_strided / set_ / resize_), which is not supported"
        )
    return operand


class TensorTable:
    """Maps storages of live dtorch tensors to operands; calls ``on_free(operand)`` when a storage dies.

    This is the pure-Python table (``DTORCH_NATIVE=0``, or no C++ compiler); :class:`NativeTable` has the same
    interface over the C++ extension."""

    native = False

    def __init__(self) -> None:
        self._entries: dict[int, _Entry] = {}
        self._lock = threading.Lock()
        self._dead_cb = self._dead

    def wrap(
        self,
        operand: Operand,
        generation: int,
        on_free: Callable[[Operand], None],
        layout: int | None = None,
        *,
        view: bool = False,
    ) -> torch.Tensor:
        """A new dtorch tensor standing for ``operand`` (``view``: it is a view of another dtorch tensor)."""
        if view:
            return self.wrap_view(operand, generation, on_free, layout)
        t = _create(operand.shape, operand.dtype)
        storage = t.untyped_storage()
        key = id(storage)
        e = _Entry(storage, self._dead_cb)
        e.key = key
        e.on_free = on_free
        e.operand = operand
        e.generation = generation
        e.shape = operand.shape
        e.layout = layout
        # one dict store: atomic under the GIL, so the hot path takes no lock
        self._entries[key] = e
        return t

    def wrap_view(
        self, operand: Operand, generation: int, on_free: Callable[[Operand], None], layout: int | None = None
    ) -> torch.Tensor:
        """:meth:`wrap` for the output of a view op."""
        if torch.is_inference_mode_enabled():
            # autograd's view bookkeeping links a view to its base's version counter, which an inference tensor
            # lacks: a view of a normal tensor made under inference_mode must be a normal tensor (as in torch)
            with torch.inference_mode(False):
                return self.wrap(operand, generation, on_free, layout)
        return self.wrap(operand, generation, on_free, layout)

    def bind(
        self, t: torch.Tensor, operand: Operand, generation: int, on_free: Callable[[Operand], None]
    ) -> None:
        """Attach ``operand`` to ``t``'s storage (replacing what it held: a copy into the tensor)."""
        storage = t.untyped_storage()
        key = id(storage)
        # a new entry object (the old one's callback then finds itself replaced and frees nothing): holders of
        # entries (the compile backend's call-key memo) detect a rebinding by identity
        e = _Entry(storage, self._dead_cb)
        e.key = key
        e.on_free = on_free
        e.operand = operand
        e.generation = generation
        e.shape = tuple(t.shape)
        e.layout = None
        with self._lock:
            self._entries[key] = e

    def _dead(self, e: _Entry) -> None:
        # the storage is being destroyed, so nothing can rebind its key meanwhile; single dict ops, no lock
        entries = self._entries
        if entries.get(e.key) is e:
            del entries[e.key]
            e.on_free(e.operand)

    def entry(self, t: torch.Tensor) -> _Entry | None:
        """The raw entry of ``t``'s storage, or ``None`` (the eager fast path checks generation/shape itself)."""
        return self._entries.get(id(t.untyped_storage()))

    def set_layout(self, t: torch.Tensor, entry: Any, layout: int) -> None:
        """Remember the interned layout id of ``entry`` (``t``'s)."""
        entry.layout = layout

    def tokens_valid(self, tensors: Sequence[torch.Tensor], tokens: Sequence[Any]) -> bool:
        """Whether every ``tokens[i]`` (an entry's ``token``) still stands for ``tensors[i]``'s binding: false after
        a rebinding (``copy_`` into it) or once its storage died."""
        get = self._entries.get
        return all(get(e.key) is e for e in tokens)

    def drain(self) -> int:
        """Free what died (the native table queues frees; here weak-reference callbacks ran already)."""
        return 0

    def set_runtime(self, generation: int, on_free: Callable[[Operand], None] | None) -> None:
        """The running pool's generation and free callback (``None``: none runs); the native table's hits need
        them, this table does not."""

    def lookup(self, t: torch.Tensor, generation: int) -> Operand:
        e = self._entries.get(id(t.untyped_storage()))
        return _checked(t, generation, None if e is None else (e.operand, e.generation, e.shape))

    def __len__(self) -> int:
        return len(self._entries)


class _EntryView:
    """A native entry as :class:`TensorTable` shows its entries (a snapshot; ``layout`` is written back through
    :meth:`NativeTable.set_layout`)."""

    __slots__ = ("operand", "generation", "shape", "layout", "token")

    def __init__(
        self, operand: Operand, generation: int, shape: tuple[int, ...], layout: int | None, token: int
    ):
        self.operand, self.generation, self.shape, self.layout, self.token = (
            operand,
            generation,
            shape,
            layout,
            token,
        )


class NativeTable:
    """:class:`TensorTable`'s interface over the C++ table of ``torch_dtorch/device/_native.cpp``: the entry lives in
    the storage's ``DataPtr`` context, and its deleter queues the free, run with the GIL at the next op or
    :meth:`drain`."""

    native = True

    def __init__(self, module: Any) -> None:
        self._m = module
        self._wrap = module.wrap
        self._lookup = module.lookup

    def wrap(
        self,
        operand: Operand,
        generation: int,
        on_free: Callable[[Operand], None],
        layout: int | None = None,
        *,
        view: bool = False,
    ) -> torch.Tensor:
        """A new dtorch tensor standing for ``operand`` (``view``: it is a view of another dtorch tensor, so it is a
        normal tensor even under ``inference_mode``)."""
        return self._wrap(
            operand, on_free, generation, -1 if layout is None else layout, operand.shape, operand.dtype, view
        )

    def wrap_view(
        self, operand: Operand, generation: int, on_free: Callable[[Operand], None], layout: int | None = None
    ) -> torch.Tensor:
        return self.wrap(operand, generation, on_free, layout, view=True)

    def bind(
        self, t: torch.Tensor, operand: Operand, generation: int, on_free: Callable[[Operand], None]
    ) -> None:
        if not self._m.bind(t, operand, on_free, generation):
            raise DTorchError(
                f"internal: a dtorch tensor of shape {tuple(t.shape)} has a storage dtorch did not make; it cannot "
                "be rebound (please report how it was created)"
            )

    def entry(self, t: torch.Tensor) -> _EntryView | None:
        r = self._lookup(t)
        return None if r is None else _EntryView(*r)

    def set_layout(self, t: torch.Tensor, entry: Any, layout: int) -> None:
        entry.layout = layout
        self._m.set_layout(t, layout)

    def tokens_valid(self, tensors: Sequence[torch.Tensor], tokens: Sequence[Any]) -> bool:
        return bool(self._m.same_serials(tensors, tokens))

    def lookup(self, t: torch.Tensor, generation: int) -> Operand:
        r = self._lookup(t)
        return _checked(t, generation, None if r is None else r[:3])

    def drain(self) -> int:
        return int(self._m.drain())

    def set_runtime(self, generation: int, on_free: Callable[[Operand], None] | None) -> None:
        """Cached native templates go; tensors of another generation stop hitting."""
        self._m.set_runtime(generation if on_free is not None else -1, on_free)

    def __len__(self) -> int:
        self._m.drain()
        return int(self._m.live())


def _make_table() -> TensorTable | NativeTable:
    module = native.load()
    return TensorTable() if module is None else NativeTable(module)


#: the process's tensor table (native when the extension is available)
TABLE: TensorTable | NativeTable = _make_table()
