"""The memory check's ledger: bytes counted as planned that a free figure may not show yet, per pool, and what makes
them go (:class:`~torch_dtorch.executor.memory_check.MemoryGuard` reads and checks them).

Every counted allocation belongs to an operand: the output of a fast-path hit (:meth:`PlannedLedger.track_hit`) or
a tensor a planned call, an upload or a redistribute allocates (:meth:`PlannedLedger.track`). Its bytes go

* when the operand dies (:meth:`released`): its buffer is freed in stream order before any later allocation, so it
  no longer needs room (an eager step's activations die op after op: without this, the bytes of outputs long dead
  piled up until the check settled -- once per eager FLUX step in thread mode, 17 times in process mode, on an H100,
  2026-12-06 -- and each settle drained the GPU);
* when every worker has run the batch it was submitted in (live figures, thread mode: :meth:`mark` at each flush,
  :meth:`forget_finished`): the figure shows the allocation by then;
* when its pool's figure is new (:meth:`forget_pool`: a worker process's report, idle workers) or the executor
  settled (:meth:`clear`).

Bytes counted by a check before their operand exists (``check`` then ``track``) are kept in the per-pool totals of
the batch marks; an operand tracked after a mark lowers that mark when it dies, one counted before is forgotten
with it (never subtracted twice).
"""

from __future__ import annotations

import collections
from collections.abc import Iterable, Sequence

__all__ = ["PlannedLedger"]

#: batches whose planned bytes are remembered (:meth:`PlannedLedger.mark`); older ones are forgotten later
MAX_MARKS = 256

#: (pool index, bytes) pairs
Counted = tuple[tuple[int, int], ...]


class PlannedLedger:
    """Planned bytes per pool (``planned``: the fast path adds a hit's bytes to it inline, so the list is only ever
    changed in place) and the operands they belong to. ``live[i]``: pool ``i``'s figure is read live (batch marks
    apply), not reported. Callers hold the guard's lock."""

    def __init__(self, live: Sequence[bool]) -> None:
        self._live = tuple(live)
        self.planned = [0] * len(self._live)
        #: per pool, the part of ``planned`` that hits' outputs hold (in ``_hits``)
        self._hit_bytes = [0] * len(self._live)
        #: operand id -> (sequence number, counted): outputs of hits, in counting order
        self._hits: collections.OrderedDict[int, tuple[int, Counted]] = collections.OrderedDict()
        #: operand id -> (sequence number, counted): tensors a check counted, in counting order
        self._checked: collections.OrderedDict[int, tuple[int, Counted]] = collections.OrderedDict()
        #: (batch number, checked bytes per pool at its flush, sequence number then)
        self._marks: collections.deque[tuple[int, tuple[int, ...], int]] = collections.deque()
        self._seq = 0

    @property
    def tracking(self) -> bool:
        """Whether any live operand is counted (else :meth:`released` has nothing to do)."""
        return bool(self._hits) or bool(self._checked)

    @property
    def has_marks(self) -> bool:
        return bool(self._marks)

    def add(self, counted: Iterable[tuple[int, int]]) -> None:
        for i, n in counted:
            self.planned[i] += n

    def track(self, operand_id: int, counted: Counted) -> None:
        """``operand_id`` holds bytes a check counted (already in ``planned``)."""
        if any(self.planned[i] for i, _ in counted):
            self._checked[operand_id] = (self._seq, counted)
            self._seq += 1

    def track_hit(self, operand_id: int, counted: tuple[tuple[int, int], ...]) -> None:
        """A hit's new bytes (already in ``planned``; ``counted``: its plan's ``HitBytes.per_pool``, shared) belong
        to its output ``operand_id`` (an in-place op's written input: added to what it holds). The eager fast
        path's per-op cost: called without the guard's lock (under the executor's), an estimate like the inline
        ``planned`` add."""
        hits = self._hits
        if operand_id in hits:
            counted = hits.pop(operand_id)[1] + counted
        hits[operand_id] = (self._seq, counted)
        self._seq += 1
        hb = self._hit_bytes
        for i, n in counted:
            hb[i] += n

    def mark(self, batch: int) -> None:
        """Batch ``batch`` was submitted with everything counted so far."""
        if len(self._marks) >= MAX_MARKS:
            self._marks.popleft()  # (forgetting later is safe: it only settles sooner)
        checked = tuple(max(0, p - h) for p, h in zip(self.planned, self._hit_bytes, strict=True))
        self._marks.append((batch, checked, self._seq))

    def forget_finished(self, done: int) -> None:
        """Every worker ran batch ``done`` and the ones before: forget what was counted before the newest of them
        (live pools)."""
        newest: tuple[int, tuple[int, ...], int] | None = None
        marks = self._marks
        while marks and marks[0][0] <= done:
            newest = marks.popleft()
        if newest is None:
            return
        _, base, seq = newest
        planned, live = self.planned, self._live
        for i, n in enumerate(base):
            if live[i] and n:
                planned[i] = max(0, planned[i] - n)
        self._marks = collections.deque(
            (b, tuple(max(0, m[i] - base[i]) if live[i] else m[i] for i in range(len(m))), q)
            for b, m, q in marks
        )
        checked = self._checked
        while checked and next(iter(checked.values()))[0] < seq:
            checked.popitem(last=False)
        hits, hb = self._hits, self._hit_bytes
        while hits and next(iter(hits.values()))[0] < seq:
            _, (_, counted) = hits.popitem(last=False)
            for i, n in counted:
                if live[i]:
                    planned[i] = max(0, planned[i] - n)
                    hb[i] = max(0, hb[i] - n)

    def released(self, operand_ids: Iterable[int]) -> None:
        """``operand_ids`` died: what they were counted for is no longer planned."""
        planned, hb = self.planned, self._hit_bytes
        hits, checked = self._hits, self._checked
        lowered: list[tuple[int, int, int]] = []  # (sequence number, pool, bytes) of checked operands
        for oid in operand_ids:
            entry = hits.pop(oid, None)
            if entry is not None:
                for i, n in entry[1]:
                    planned[i] = max(0, planned[i] - n)
                    hb[i] = max(0, hb[i] - n)
                continue
            entry = checked.pop(oid, None)
            if entry is not None:
                seq, counted = entry
                for i, n in counted:
                    planned[i] = max(0, planned[i] - n)
                    lowered.append((seq, i, n))
        if lowered and self._marks:
            # a mark taken after these bytes were counted includes them: lower it too, or forgetting it later
            # would subtract them a second time
            self._marks = collections.deque((b, _lowered(m, q, lowered), q) for b, m, q in self._marks)

    def forget_pool(self, pool: int) -> None:
        """Pool ``pool``'s figure shows everything counted so far (a new report, idle workers)."""
        self.planned[pool] = 0
        self._hit_bytes[pool] = 0
        if not any(self.planned):
            self.clear()
            return
        for entries in (self._hits, self._checked):
            for oid, (seq, counted) in list(entries.items()):
                if any(i == pool for i, _ in counted):
                    rest = tuple((i, n) for i, n in counted if i != pool)
                    if rest:
                        entries[oid] = (seq, rest)
                    else:
                        del entries[oid]
        self._marks = collections.deque(
            (b, tuple(0 if i == pool else n for i, n in enumerate(m)), q) for b, m, q in self._marks
        )

    def clear(self) -> None:
        """Nothing counted is unallocated (the executor settled, or every pool's figure is new)."""
        self.planned[:] = [0] * len(self.planned)
        self._hit_bytes[:] = [0] * len(self._hit_bytes)
        self._hits.clear()
        self._checked.clear()
        self._marks.clear()


def _lowered(mark: tuple[int, ...], seq: int, lowered: list[tuple[int, int, int]]) -> tuple[int, ...]:
    """``mark`` (checked bytes per pool, taken at sequence number ``seq``) less the released bytes it counted
    (those tracked before it)."""
    out = list(mark)
    for s, i, n in lowered:
        if s < seq:
            out[i] = max(0, out[i] - n)
    return tuple(out)
