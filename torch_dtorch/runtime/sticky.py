"""Sticky errors: the one protocol by which a failure on a worker reaches every output it touches, and no peer hangs.

Every executor of local work — :class:`~torch_dtorch.runtime.op_runner.OpRunner` for eager operators and
redistributes, the compiled backend's per-rank programs (``backend/program.py``) — follows the same five steps:

1. **poisoned input** — an input blob that holds an error (or no data at all) makes the call's error; the call's own
   compute is skipped;
2. **zeros** — a step that *communicates* (a collective, a communicating kernel) runs anyway, on zeros of the right
   local shape, so the peers waiting for this rank's messages never hang;
3. **post** — before such a step, a rank with an error posts it on the :class:`PoisonBoard` under the call's key
   (the first output id: new every call, the same on every rank);
4. **join** — after the step, a rank without an error of its own looks the key up: the collectives order every rank
   that received data from the poisoned one after the post, so it sees it and does not silently keep zeros;
5. **poison outputs** — every output of the call becomes a :class:`~torch_dtorch.runtime.blob.Blob` holding the
   error; a later fetch raises it, with the op and call site where it first happened.

:class:`StickyCall` carries one call's error through steps 1–5; :func:`call_hooks` runs the kernel hooks around a
call (a broken hook is logged, never breaks the worker).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Iterable, MutableMapping, Sequence
from typing import Any, Protocol

from torch_dtorch.runtime.blob import Blob, KernelError

__all__ = ["Board", "PoisonBoard", "StickyCall", "call_hooks", "kernel_error", "poison"]

log = logging.getLogger(__name__)

Hook = Callable[[Any, int], None]


class Board(Protocol):
    """Where ranks post errors for their peers: :class:`PoisonBoard` (one process), ``StorePoisonBoard`` (the
    cluster's key-value store)."""

    def post(self, operand_id: int, error: KernelError) -> None: ...

    def get(self, operand_id: int) -> KernelError | None: ...


class PoisonBoard:
    """Errors posted by ranks of one process (thread mode), by the key of the call they poisoned.

    A rank with a poisoned input posts *before* it enters the collectives, and every rank looks *after* leaving
    them: whoever received data from the poisoned rank (directly or through another rank) is ordered after the post
    by the collectives themselves, so it sees it. Entries are only made on errors; the oldest are dropped beyond
    ``capacity``.
    """

    def __init__(self, *, capacity: int = 4096) -> None:
        self._errors: OrderedDict[int, KernelError] = OrderedDict()
        self._capacity = capacity

    def post(self, operand_id: int, error: KernelError) -> None:
        self._errors.setdefault(operand_id, error)
        while len(self._errors) > self._capacity:
            try:
                self._errors.popitem(last=False)
            except KeyError:
                break

    def get(self, operand_id: int) -> KernelError | None:
        if not self._errors:
            return None
        return self._errors.get(operand_id)


def kernel_error(
    e: BaseException, *, op: str, device: int, call_site: str | None = None, detail: str = ""
) -> KernelError:
    """``e`` as the call's sticky error: a :class:`KernelError` as it is, anything else wrapped (with its cause)."""
    if isinstance(e, KernelError):
        return e
    err = KernelError(op, device, e, call_site=call_site, detail=detail)
    err.__cause__ = e
    return err


class StickyCall:
    """One call's error through the protocol of this module's docstring.

    Args:
        board: the runner's :class:`Board`, or ``None`` (a single rank, or a runner that has none).
        key: the call's board key (its first output id), or ``None`` when it has no output.
    """

    __slots__ = ("board", "error", "key", "posted")

    def __init__(self, *, board: Board | None, key: int | None) -> None:
        self.board = board
        self.key = key
        self.error: KernelError | None = None
        self.posted = False

    def fail(self, error: KernelError) -> None:
        """Record ``error`` unless the call already failed (the first error is the one reported)."""
        if self.error is None:
            self.error = error

    def before_comm(self) -> None:
        """Step 3: post this rank's error before a communicating step (once per call)."""
        if self.error is not None and not self.posted and self.board is not None and self.key is not None:
            self.board.post(self.key, self.error)
            self.posted = True

    def after_comm(self) -> None:
        """Step 4: a rank without an error of its own takes the error a peer posted for this call."""
        if self.error is None and self.board is not None and self.key is not None:
            self.error = self.board.get(self.key)

    def poison(self, blobs: MutableMapping[int, Blob], out_ids: Iterable[int]) -> bool:
        """Step 5: every output in ``out_ids`` holds the error. Returns whether the call failed."""
        if self.error is None:
            return False
        poison(blobs, out_ids, self.error)
        return True


def poison(blobs: MutableMapping[int, Blob], out_ids: Iterable[int], error: KernelError) -> None:
    """Every output in ``out_ids`` holds ``error`` (one shared blob)."""
    poisoned = Blob(error=error)
    for oid in out_ids:
        blobs[oid] = poisoned


def call_hooks(hooks: Sequence[Hook], instr: Any, device: int) -> None:
    """Call each kernel hook with ``(instruction, device)``; a broken hook is logged, never breaks the worker."""
    for h in list(hooks):
        try:
            h(instr, device)
        except Exception:  # noqa: BLE001 - a broken hook must not break the worker
            log.exception("kernel hook %r failed", h)
