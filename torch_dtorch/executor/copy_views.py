"""Copy-views: views that could not keep their input's placements, kept equal to their base after in-place writes.

A view op whose rule needs its input moved (``y = x[1:3]`` with ``x`` on ``Shard(0)`` and rows from both devices)
runs on a redistributed *copy* ``C`` of the input (``C.copy_of`` is the input), so ``y`` views ``C``, not ``x``. In
torch a later in-place write to ``x`` (or to any other alias of ``x``'s storage) is seen by ``y``. Here every such
write *refreshes* ``C``: the executor re-issues the same redistribute of the view's input and copies the result
into ``C`` in place (``aten.copy_``), ordered after the write, so ``y`` and every view of ``y`` (local views of
``C``'s blob) read the new values. A refresh is itself a write to ``C``, so copy-views of ``y`` refresh in turn.

The registry (:class:`CopyViews`, one per eager executor) costs nothing while no copy-view lives: its hooks run
only when :attr:`CopyViews.records` is non-empty (one dict truthiness test per recorded call).

Lifetimes: a record lives while some *alias* of ``C`` does (the view op's outputs and views made of them later, by
operand id). Its source (the view op's input) is *pinned*: when the source's tensors die, the free of its blobs is
deferred until the last record reading it goes (as in torch, where a view keeps its base's storage alive), so a
refresh never reads a freed blob. When the last alias dies, ``C`` is freed and the source's deferred free runs.

Writes *through* a copy-view stay refused (``GraphConstructor``'s ``_check_write_reaches_base``): only refreshes
write ``C``.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from torch_dtorch.executor.constructor import RedistributeSpec, redistribute_spec
from torch_dtorch.graph import Operand

if TYPE_CHECKING:
    from torch_dtorch.executor.eager import EagerGraphExecutor

__all__ = ["CopyView", "CopyViews"]

_COPY_ = torch.ops.aten.copy_.default


class CopyView:
    """One redistributed copy ``copy`` that views read, and what it copies (``source``)."""

    __slots__ = ("copy", "source", "aliases", "refreshes", "spec")

    def __init__(self, copy: Operand, source: Operand) -> None:
        self.copy = copy
        self.source = source
        #: ids of the live operands that view ``copy`` (the view op's outputs, views of them)
        self.aliases: set[int] = set()
        #: how many times ``copy`` was refreshed (tests and debugging)
        self.refreshes = 0
        #: the redistribute from ``source`` to ``copy``'s placements, planned at the first refresh
        self.spec: RedistributeSpec | None = None

    def __repr__(self) -> str:
        return (
            f"CopyView({self.copy.describe()} of {self.source.describe()}, aliases={sorted(self.aliases)}, "
            f"refreshes={self.refreshes})"
        )


class CopyViews:
    """The live copy-views of one :class:`~torch_dtorch.executor.eager.EagerGraphExecutor` (see the module
    docstring).

    Args:
        executor: the owner; refreshes are recorded through it (its ``redistribute``, ``call`` and ``free``).
        dead: the executor's queue of operand ids to free (the registry appends copies and deferred sources).
    """

    def __init__(self, executor: EagerGraphExecutor, dead: deque[int]) -> None:
        self._ex = executor
        self._dead = dead
        self._lock = threading.Lock()
        #: copy id and alias ids -> their record; empty: no copy-view lives, every hook is skipped
        self.records: dict[int, CopyView] = {}
        #: root id of a record's source -> the records to refresh when that storage is written
        self.by_root: dict[int, list[CopyView]] = {}
        #: source operand id -> how many records read it (its free is deferred while > 0)
        self.pins: dict[int, int] = {}
        #: pinned ids whose tensors died meanwhile (released when unpinned)
        self.deferred: set[int] = set()

    # --- registration -------------------------------------------------------------------------------------------
    def add(self, copy: Operand, views: Sequence[Operand]) -> None:
        """``views`` (outputs of one view op) view ``copy``, a redistributed copy of the op's input."""
        source = copy.copy_of
        assert source is not None
        with self._lock:
            rec = self.records.get(copy.id)
            if rec is None:
                rec = CopyView(copy, source)
                self.records[copy.id] = rec
                self.by_root.setdefault(source.root_base.id, []).append(rec)
                self.pins[source.id] = self.pins.get(source.id, 0) + 1
            for v in views:
                rec.aliases.add(v.id)
                self.records[v.id] = rec

    def note_views(self, outputs: Sequence[Operand]) -> None:
        """New view operands: those of an alias of a recorded copy are aliases too."""
        records = self.records
        for o in outputs:
            b = o.base
            if b is not None and (rec := records.get(b.id)) is not None:
                with self._lock:
                    rec.aliases.add(o.id)
                    records[o.id] = rec

    # --- writes -------------------------------------------------------------------------------------------------
    def after_call(self, rule: Any, outputs: Sequence[Operand]) -> None:
        """Hook after an operator of ``rule`` with ``outputs`` was recorded (callers hold the executor's lock and
        checked that :attr:`records` is non-empty)."""
        if rule.output_is_input is not None or rule.writes_inputs:
            self.after_write(outputs)
        elif rule.view_of is not None:
            self.note_views(outputs)

    def after_write(self, written: Sequence[Operand]) -> None:
        """``written`` were just written in place: refresh every copy read from their storages, in order after the
        write (callers hold the executor's lock)."""
        seen: set[int] = set()
        for w in written:
            root = w.root_base.id
            if root in seen:
                continue
            seen.add(root)
            for rec in tuple(self.by_root.get(root, ())):
                if rec.aliases:
                    self._refresh(rec)

    def _refresh(self, rec: CopyView) -> None:
        """Re-issue ``rec``'s redistribute and copy its result into the copy in place (the ``copy_`` is a write to
        the copy: copy-views of its views refresh in turn, through the executor's hook)."""
        ex = self._ex
        copy = rec.copy
        assert copy.mesh is not None
        constructor = ex.constructor
        last = constructor.last_call  # what the caller planned (the fast path learns its template from it)
        try:
            spec = rec.spec
            if spec is None:
                mesh = copy.mesh
                spec = rec.spec = redistribute_spec(
                    rec.source, mesh, mesh.to_root_placements(copy.placements), user_mesh=mesh
                )
            with ex._lock:
                fresh = constructor.redistribute_by_spec(rec.source, spec)
            ex.call(_COPY_, copy, fresh)
            ex.release(fresh.id)
        finally:
            constructor.last_call = last
        rec.refreshes += 1

    # --- lifetimes ----------------------------------------------------------------------------------------------
    def on_release(self, operand_id: int) -> bool:
        """The last tensor of ``operand_id`` died. True: its free is deferred (a record's source); otherwise, if it
        was the last alias of a copy, the copy is queued for freeing (with any deferred source it pinned)."""
        with self._lock:
            if operand_id in self.pins:
                self.deferred.add(operand_id)
                return True
            rec = self.records.pop(operand_id, None)
            if rec is None:
                return False
            rec.aliases.discard(operand_id)
            if rec.aliases:
                return False
            unpinned = self._drop(rec)
        self._dead.append(rec.copy.id)
        for src in unpinned:  # the real release, outside the lock (it may drop further records)
            self._release(src)
        return False

    def _drop(self, rec: CopyView) -> list[int]:
        """Forget ``rec`` (callers hold the lock); returns the deferred sources it was the last to pin."""
        self.records.pop(rec.copy.id, None)
        root = rec.source.root_base.id
        recs = self.by_root.get(root)
        if recs is not None:
            recs.remove(rec)
            if not recs:
                del self.by_root[root]
        sid = rec.source.id
        n = self.pins[sid] - 1
        if n:
            self.pins[sid] = n
            return []
        del self.pins[sid]
        if sid in self.deferred:
            self.deferred.discard(sid)
            return [sid]
        return []

    def _release(self, operand_id: int) -> None:
        self._ex.release(operand_id)

    def __len__(self) -> int:
        """How many copies are kept fresh."""
        return sum(len(recs) for recs in self.by_root.values())
