"""The workers' native replay loop: runs of resolved fast-path ops executed in C++ with the GIL released.

A worker collects consecutive replayable instructions of a batch into a :class:`NativeChain` (their resolved calls
have a native handle, see :func:`~torch_dtorch.runtime.replay.resolve`); any other instruction flushes the chain
first, so the order of the batch is kept. :meth:`NativeChain.flush` hands the chain to ``_replay.cpp``'s
``run_chain``: every op runs on its operator handle and a boxed stack prepared once, without the GIL, so worker
threads run in parallel with each other and with the controller. The results come back as blobs (stamped on the
compute stream); an op that raised poisons its outputs and everything in the chain computed from them, with the
same :class:`~torch_dtorch.runtime.blob.KernelError` the Python path makes.

Without a C++ compiler (or with ``DTORCH_NATIVE=0``) :func:`extension` is ``None`` and workers replay in Python.
"""

from __future__ import annotations

from collections.abc import Callable, MutableMapping, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from torch_dtorch._native_build import NativeExtension
from torch_dtorch.runtime.blob import Blob, KernelError
from torch_dtorch.runtime.stream import COMPUTE, KernelStream

__all__ = ["NativeChain", "extension", "hit_encoder"]

#: a chain step that drops the chain's tensors of the ids that follow (``FREE_STEP, n, ids...``; ``_replay.cpp``)
FREE_STEP = -1

_EXTENSION = NativeExtension(
    Path(__file__).with_name("_replay.cpp"),
    prefix="dtorch_replay",
    what="dtorch's native worker loop",
    fallback="the Python replay of resolved ops on the workers",
)


def extension() -> ModuleType | None:
    """The built ``_replay.cpp`` module, or ``None`` (no compiler, ``DTORCH_NATIVE=0``)."""
    return _EXTENSION.load()


def native_handle(
    op: Any,
    args: Sequence[Any],
    kwargs: dict[str, Any],
    positions: Sequence[int],
    elements: Sequence[int] | None = None,
) -> int:
    """The native handle of ``op(*args, **kwargs)`` whose tensor inputs (in slot order) are ``args[positions[k]]``
    (or, where ``elements[k] >= 0``, element ``elements[k]`` of the ``Tensor[]`` argument ``args[positions[k]]``);
    ``-1`` when the native loop cannot run it (or is not available)."""
    module = extension()
    schema = getattr(op, "_schema", None)
    if module is None or schema is None:
        return -1
    elements = [-1] * len(positions) if elements is None else list(elements)
    try:
        return int(
            module.resolve(
                schema.name, schema.overload_name, tuple(args), dict(kwargs), list(positions), elements
            )
        )
    except Exception:  # noqa: BLE001 - an argument the native loop cannot take: the Python replay runs it
        return -1


def hit_encoder() -> Callable[..., int] | None:
    """Process mode's controller lane, ``_replay.cpp``'s ``encode_hits(batch, start, FastRun, Free, known,
    hit_table, words, free_kind) -> index``: the hit and free records of a run of instructions appended in C++
    (:meth:`torch_dtorch.cluster.codec.encoder.BatchEncoder.encode`); ``None`` without the extension."""
    ext = extension()
    return None if ext is None else ext.encode_hits


def release(handles: Sequence[int]) -> None:
    """Give resolved calls back to the native loop (their owner forgot them)."""
    module = extension()
    if module is not None and handles:
        module.release(list(handles))


class NativeChain:
    """A run of resolved ops of one worker, executed together by the native loop.

    Args:
        device: the worker's device id (named by errors).
        blobs: the worker's blob table (read for external inputs, written with the results).
        stream: the worker's stream (cross-stream inputs are waited for when added; results are stamped).
    """

    __slots__ = (
        "device",
        "blobs",
        "stream",
        "ran",
        "_steps",
        "_ops",
        "_ext",
        "_produced",
        "_dropped",
        "_module",
        "_wait",
    )

    def __init__(self, device: int, blobs: MutableMapping[int, Blob], stream: KernelStream | None) -> None:
        self.device = device
        self.blobs = blobs
        self.stream = stream
        self._module = extension()
        self.ran = 0  # ops run by the native loop so far (for tests and stats)
        self._steps: list[int] = []
        self._ops: list[tuple[Any, str | None]] = []  # per step: (op, call site)
        self._ext: dict[int, torch.Tensor] = {}
        self._produced: set[int] = set()
        self._dropped: set[int] = set()
        #: the wait of a chain's first read of a blob (another stream may have written it), or ``None``
        self._wait = (
            (lambda fresh: stream.wait_for(fresh, COMPUTE)) if stream is not None and stream.is_cuda else None
        )

    def _refs(self) -> tuple[Any, ...]:
        """The containers ``_replay.cpp``'s chain functions work on (its ``refs_of``); ``flush`` replaces them."""
        return (self._steps, self._ops, self._ext, self._produced, self._dropped, self.blobs, self._wait)

    @property
    def available(self) -> bool:
        return self._module is not None

    def __len__(self) -> int:
        return len(self._ops)

    def add(
        self, handle: int, op: Any, input_ids: Sequence[int], output_ids: Sequence[int], call_site: str | None
    ) -> bool:
        """Queue one op (``input_ids``: its present inputs in slot order); ``False`` (nothing queued) when an
        input is neither produced by the chain nor a healthy blob: the general path must run it. (``_replay.cpp``'s
        ``add``: the chain's first read of a blob is waited for on the compute stream and keeps its tensor in the
        chain's external inputs; the op's step is appended and its outputs noted as produced.)"""
        assert self._module is not None
        return bool(self._module.add(self._refs(), handle, op, list(input_ids), list(output_ids), call_site))

    def queue_runs(
        self,
        batch: Sequence[Any],
        start: int,
        *,
        resolved: dict[Any, Any],
        checked: set[Any],
        replayable: Any,
        key_of: Any,
        fastrun: type,
        free: type,
        unresolved: Any,
        device: int,
    ) -> tuple[int, int]:
        """``Worker.run_batch``'s hot lane in C++ (``_replay.cpp``'s ``queue_runs``): from ``batch[start]``, queue
        every consecutive ``FastRun`` whose plan the worker resolved to a native call (``resolved``, keyed by the plan
        or ``key_of(run)``; ``replayable(plan, checked)`` the first time a plan is met in a batch), skipping runs of
        other devices, as :meth:`add` each, and every ``Free`` (instruction type ``free``) among them as :meth:`free`. Returns the index of the first instruction not queued and how many ops
        were queued: the worker's per-op Python is one C++ call per run of hits."""
        assert self._module is not None
        i, queued = self._module.queue_runs(
            self._refs(),
            batch,
            start,
            fastrun,
            free,
            resolved,
            checked,
            replayable,
            key_of,
            unresolved,
            device,
        )
        return int(i), int(queued)

    def queue_records(
        self,
        words: list[int],
        start: int,
        end: int,
        *,
        templates: list[Any],
        resolved: dict[Any, Any],
        device: int,
        free_kind: int,
    ) -> tuple[int, int]:
        """Process mode's hot lane (``_replay.cpp``'s ``queue_records``): from word ``start`` to ``end`` of a hit
        frame, queue every hit record whose template (``templates[w >> 2]``) the worker resolved to a native call
        (``resolved[template.tm]``) as :meth:`add`, skip other devices' records, apply free records as :meth:`free`
        (or drop the blobs while the chain is empty). Returns the word index of the first record not queued and how
        many ops were queued."""
        assert self._module is not None
        p, queued = self._module.queue_records(
            self._refs(), words, start, end, templates, resolved, device, free_kind
        )
        return int(p), int(queued)

    def free(self, operand_ids: Sequence[int]) -> None:
        """A ``Free`` inside the chain: blobs go at once; the tensors the chain made or read of those ids go at this
        point of the chain (a free step of the native loop: ``_replay.cpp``'s ``chain_free``), and what it made of
        them is not published."""
        assert self._module is not None
        self._module.free(self._refs(), operand_ids)

    def flush(self) -> int:
        """Run the queued ops; publish their outputs as blobs. Returns how many ops ran (or failed)."""
        n = len(self._ops)
        if not n:
            return 0
        steps, ops = self._steps, self._ops
        ext = self._ext
        dropped = self._dropped
        self._steps, self._ops, self._ext, self._produced, self._dropped = [], [], {}, set(), set()
        assert self._module is not None
        self.ran += n
        ids, tensors = list(ext), list(ext.values())
        ext.clear()  # (run_chain empties ``tensors``: the chain alone holds its inputs, and frees them in place)
        try:
            out_ids, out_tensors, failures = self._module.run_chain(steps, ids, tensors)
        except Exception as e:  # noqa: BLE001 - the loop itself failed: every op of the chain is poisoned
            out_ids, out_tensors = [], []
            failures = [(k, k, f"{type(e).__name__}: {e}") for k in range(n)]
        new: list[Blob] = []
        blobs = self.blobs
        for i, t in zip(out_ids, out_tensors):
            if i in dropped:
                continue
            b = Blob(t)
            new.append(b)
            blobs[i] = b
        if self.stream is not None and new:
            self.stream.stamp(new, COMPUTE)
        if failures:
            self._poison(steps, ops, failures, dropped)
        return n

    def _poison(
        self,
        steps: list[int],
        ops: list[tuple[Any, str | None]],
        failures: list[tuple[int, int, str]],
        dropped: set[int],
    ) -> None:
        from torch_dtorch.graph.operator import op_name

        outputs: list[list[int]] = []
        p = 0
        while p < len(steps):
            if steps[p] == FREE_STEP:
                p += 2 + steps[p + 1]
                continue
            n_in = steps[p + 1]
            n_out = steps[p + 2 + n_in]
            outputs.append(steps[p + 3 + n_in : p + 3 + n_in + n_out])
            p += 3 + n_in + n_out
        errors: dict[int, KernelError] = {}
        for step, origin, message in failures:
            err = errors.get(origin)
            if err is None:
                op, call_site = ops[origin]
                err = errors[origin] = KernelError(
                    op_name(op), self.device, RuntimeError(message), call_site=call_site
                )
            poisoned = Blob(error=err)
            for i in outputs[step]:
                if i not in dropped:
                    self.blobs[i] = poisoned
