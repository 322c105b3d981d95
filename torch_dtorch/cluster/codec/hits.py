"""Binary hit records (codec v3): the eager fast path's hits and the frees between them, as fixed-width words.

A fast-path hit (:class:`~torch_dtorch.executor.instructions.FastRun`) of a plan that moves no input and writes no
input in place — views, list arguments (``cat``) and the Python fast path's hits included — travels as one record of signed 64-bit little-endian words in the batch's *hit frame* (a frame of the signed
wire message, covered by its HMAC like every other frame)::

    hit:   [hid << 2 | 0, node_id, first_output_id, input_id_0, ..., input_id_{n-1}]   (-1: an absent slot)
    free:  [count << 2 | 1, operand_id_0, ..., operand_id_{count-1}]

``hid`` names a *hit template*: the first hit of a template travels as a JSON ``RunOp`` wrapped in ``["Y", hid, ...]``
(its operator template, output types and devices); every later hit of it is a record of ``3 + n`` words. A template
is keyed by the plan (which fixes every constant of a native hit), the outputs' ``requires_grad`` and, for the Python
fast path's hits, the call's constants and operand slots (:func:`~torch_dtorch.cluster.codec.common.template_key`).
A record's outputs carry no view metadata on the worker (the replayed view op makes the local view).
The JSON instruction list says where records go in the order: ``["H", n_words]`` stands for the next ``n_words``
words of the hit frame. Outputs of a hit are ``first_output_id, first_output_id + 1, ...``.

The worker (:mod:`torch_dtorch.cluster.codec.hit_worker`) does not rebuild instructions for records: a record whose
template the worker resolved to a native call goes straight onto the native chain by operand id. Only a record the
general path must run (the first one on a worker, a poisoned input, replay off, kernel hooks) is *materialized*
into a ``RunOp``; its operands are made from the hit templates' output types when first needed.

Every record is checked when the batch is decoded (known template, enough words, ids in range, absent slots only
where the template has them): a malformed or truncated frame is a :class:`CodecError`, never a crash or a hang.
"""

from __future__ import annotations

import os
import sys
from array import array
from typing import TYPE_CHECKING, Any

from torch_dtorch.cluster.codec.common import CodecError
from torch_dtorch.cluster.codec.common import template_key as _key
from torch_dtorch.executor.instructions import FastRun, RunOp
from torch_dtorch.graph import Operand

if TYPE_CHECKING:
    from torch_dtorch.cluster.codec.decoder import BatchDecoder

__all__ = ["HIT", "FREE", "MAX_HIT_BYTES", "HitRun", "HitTemplate", "hits_enabled", "pack", "unpack"]

HIT = 0
FREE = 1
#: the largest hit frame a worker decodes (a batch of ``DTORCH_BATCH_SIZE`` hits is a few KiB)
MAX_HIT_BYTES = 64 << 20
_MAX_ID = (1 << 62) - 1
_BIG = sys.byteorder == "big"


def hits_enabled() -> bool:
    """Whether the encoder sends fast-path hits as binary records (``DTORCH_WIRE_HITS``, default on; ``0``: every
    instruction as JSON, the v1 layout inside a v2 batch)."""
    return os.environ.get("DTORCH_WIRE_HITS", "1") != "0"


def pack(words: list[int]) -> bytes:
    """The hit frame of ``words`` (signed 64-bit, little-endian)."""
    a = array("q", words)
    if _BIG:  # pragma: no cover - no big-endian CI machine
        a.byteswap()
    return a.tobytes()


def unpack(frame: Any, *, batch_no: int) -> list[int]:
    """The words of a hit frame; :class:`CodecError` if it is not a whole number of words or too large."""
    if frame is None:
        return []
    if not isinstance(frame, (bytes, bytearray, memoryview)):
        raise CodecError(f"instruction batch {batch_no}: the hit frame is {type(frame).__name__}, not bytes")
    n = memoryview(frame).nbytes
    if n % 8 or n > MAX_HIT_BYTES:
        raise CodecError(
            f"instruction batch {batch_no}: hit frame of {n} bytes (a multiple of 8 up to {MAX_HIT_BYTES} expected)"
        )
    a = array("q")
    a.frombytes(frame)
    if _BIG:  # pragma: no cover
        a.byteswap()
    return a.tolist()


class HitTemplate:
    """Worker side: what every hit of one template shares (the decoded operator template ``tm``, which is also the
    replay key the worker resolves once)."""

    __slots__ = ("tm", "op", "devices", "n_slots", "present", "dense", "n_out", "out_types", "name")

    def __init__(self, tm: Any, node: Any) -> None:
        self.tm = tm
        self.op = node.op
        self.devices: tuple[int, ...] = tuple(node.assign.devices) if node.assign is not None else ()
        self.n_slots = len(node.inputs)
        self.present = tuple(x is not None for x in node.inputs)
        self.dense = all(self.present)  # every slot holds an operand (no -1 in records)
        self.n_out = len(node.outputs)
        #: per output: (shape, dtype, mesh, placements, stride, requires_grad, tag)
        self.out_types = tuple(
            (o.shape, o.dtype, o.mesh, o.placements, o.stride, o.requires_grad, o.tag) for o in node.outputs
        )
        self.name = node.name


class HitRun:
    """One run of consecutive records of a batch (``words[start:end]``), as the worker's instruction list holds it:
    one object per run, not per op."""

    __slots__ = ("dec", "words", "start", "end")

    def __init__(self, dec: BatchDecoder, words: list[int], start: int, end: int) -> None:
        self.dec, self.words, self.start, self.end = dec, words, start, end

    @property
    def name(self) -> str:
        """What the heartbeat names while the run is taken: its first record's op."""
        w = self.words[self.start]
        if w & 3 == HIT:
            return f"{self.dec._tables['hit'][w >> 2].name} -> %{self.words[self.start + 2]} (hit records)"
        return "free (hit records)"

    def leading_frees(self) -> tuple[list[int], bool]:
        """The operand ids its free records before its first hit drop, and whether it holds nothing else: a
        worker's handler of the instruction just before it may drop those blobs first (``Worker.freed_after``, a
        compiled program's donated inputs)."""
        words, p, end = self.words, self.start, self.end
        ids: list[int] = []
        while p < end and words[p] & 3 == FREE:
            q = p + 1 + (words[p] >> 2)
            ids.extend(words[p + 1 : q])
            p = q
        return ids, p >= end

    def __repr__(self) -> str:
        return f"HitRun({self.end - self.start} words)"


# --- controller side --------------------------------------------------------------------------------------------
class HitEncoding:
    """The encoder's part (mixed into :class:`~torch_dtorch.cluster.codec.encoder.BatchEncoder`): which plans have
    a hit template, and the words of the batch being encoded."""

    _operands: dict[int, Operand]
    _tables: dict[str, dict[Any, int]]

    def _hits_reset(self) -> None:
        #: plan -> whether its hits may travel as records (no moves, no views, flat arguments), per plan once
        self._hit_ok: dict[Any, bool] = {}
        self._words: list[int] = []

    def _hit(self, run: FastRun) -> list[Any] | None:
        """Encode ``run`` as a record (``None``), or return the JSON trees it needs instead (its template's first
        hit: the ``RunOp`` that defines it; anything a record cannot carry — moved inputs, in-place writes, a call
        site, tensor constants — the expanded instructions). The controller's per-op cost: written out for the
        common case (native hit, one output, inputs known)."""
        if run.call_site is None:
            plan = run.plan
            outs = run.outputs
            if len(outs) == 1:
                o = outs[0]
                key: Any = plan if not o.requires_grad else (plan, (True,))
            else:
                o = None
                flags = tuple([x.requires_grad for x in outs])
                key = plan if True not in flags else (plan, flags)
            args = run.args
            if args is not None:  # the Python fast path's hits: the constants (and slots) are part of the key
                parts: list[Any] = []
                if not _key(args, parts, run.inputs):
                    return self._expanded(run)  # a tensor constant: one-shot templates only
                key = (key, tuple(parts))
            known = self._operands
            ids: list[int] = []
            for x in run.inputs:
                if x is None:
                    ids.append(-1)
                elif known.get(x.id) is x:
                    ids.append(x.id)
                else:
                    break  # an input the decoder does not know: the JSON path defines it
            else:
                hid = self._tables["hit"].get(key)
                if hid is not None:
                    words = self._words
                    words += (hid << 2, run.first_op, run.first_id)
                    words += ids
                    if o is not None:
                        known[o.id] = o
                    else:
                        for o in outs:
                            known[o.id] = o
                    return None
                ok = self._hit_ok.get(plan)
                if ok is None:
                    ok = self._hit_ok[plan] = _plan_fits(plan)
                # a template is defined from a call on distinct operands (``x * x`` of a native hit would make
                # a template that reads slot 0 twice); its later records may repeat an operand
                present = [i for i in ids if i >= 0]
                if ok and (args is not None or len(set(present)) == len(present)):
                    return self._hit_define(run, key)
        return self._expanded(run)

    def _expanded(self, run: FastRun) -> list[Any]:
        return [self._instr(part) for part in run.expand()]  # type: ignore[attr-defined]

    def _hit_define(self, run: FastRun, key: Any) -> list[Any]:
        (part,) = run.expand()  # no moves: the RunOp alone
        tree = self._instr(part)  # type: ignore[attr-defined]
        tmpl = tree[3]
        if type(tmpl) is list and tmpl[:1] == ["!"]:  # one-shot (a tensor constant): never a record
            self._hit_ok[run.plan] = False
            return [tree]
        t = self._tables["hit"]
        hid = t[key] = len(t)
        return [["Y", hid, tree]]

    def _free_words(self, ids: list[int]) -> None:
        if ids:
            pop = self._operands.pop
            for i in ids:
                pop(i, None)
            words = self._words
            words.append(len(ids) << 2 | FREE)
            words += ids


def _plan_fits(plan: Any) -> bool:
    """Whether the hits of ``plan`` can be records: no moved inputs (their copies are extra operands and
    instructions) and no in-place write (the output is the written input, not a new operand); views are records
    too (workers keep no view metadata: the replayed view op makes the local view)."""
    if plan.nmoves or plan.written is not None or not plan.compact:
        return False
    return not any(isinstance(v, Operand) for v in plan.kwargs.values())


# --- worker side ------------------------------------------------------------------------------------------------
class HitDecoding:
    """The decoder's part (mixed into :class:`~torch_dtorch.cluster.codec.decoder.BatchDecoder`): hit templates,
    the operands hits defined (made only when the general path needs them), and the operands this batch freed (a
    record materialized while its batch runs still finds every operand the batch names; they go with the next
    batch)."""

    _operands: dict[int, Operand]
    _tables: dict[str, list[Any]]
    _batch_no: int

    def _hits_reset(self) -> None:
        #: operand id -> the hit template that made it (``(template, k)`` for output ``k > 0``)
        self._lazy: dict[int, Any] = {}
        #: operands (or lazy entries) freed by the batch being decoded or run
        self._grave: dict[int, Any] = {}
        self._words: list[int] = []
        self._hit_pos = 0

    def _free(self, ids: list[int]) -> None:
        pop, lazy_pop, grave = self._operands.pop, self._lazy.pop, self._grave
        for i in ids:
            v = pop(i, None)
            if v is None:
                v = lazy_pop(i, None)
            if v is not None:
                grave[i] = v

    def _lazy_operand(self, i: int) -> Operand | None:
        v = self._lazy.get(i)
        if v is None:
            return None
        # setdefault: workers sharing one decoder (the loopback runner's threads) agree on one object
        x = self._operands.setdefault(i, _make_operand(i, v))
        self._lazy.pop(i, None)
        return x

    def _run_operand(self, i: int) -> Operand:
        """Operand ``i`` for a record materialized at run time (freed later in its batch: still found)."""
        x = self._operands.get(i)
        if x is None:
            x = self._lazy_operand(i)
        if x is None:
            v = self._grave.get(i)
            if v is None:
                raise CodecError(f"a hit record names operand %{i}, which this worker does not know")
            x = v if type(v) is Operand else _make_operand(i, v)
        return x

    def _define_hit(self, tree: list[Any]) -> RunOp:
        _tag, hid, rtree = tree
        if type(rtree) is not list or rtree[:1] != ["R"] or len(rtree) != 6:
            raise CodecError(
                f"instruction batch {self._batch_no}: hit template {hid!r} is not defined by a RunOp"
            )
        _r, node_id, ins, tmpl_tree, outs, call_site = rtree
        inputs = [self.operand(r) for r in ins]  # type: ignore[attr-defined]
        tm = self._template(tmpl_tree)  # type: ignore[attr-defined]
        instr: RunOp = self._make_run_op(node_id, inputs, tm, outs, call_site)  # type: ignore[attr-defined]
        table = self._tables["hit"]
        if hid != len(table):
            raise CodecError(
                f"instruction batch {self._batch_no}: hit template {hid!r} defined out of order (the decoder knows {len(table)})"
            )
        node = instr.node
        # a stored template whose call takes the node's arguments (list arguments included: ``cat``) is replayed
        # from records: every record of it is the same call on other operands
        if not (tm.stored and tm.cargs is None):
            raise CodecError(
                f"instruction batch {self._batch_no}: hit template {hid}: its RunOp {node.name} cannot be replayed from records"
            )
        if instr.replay_key is None:
            instr = RunOp(node, instr.call_site, replay_key=tm)
        table.append(HitTemplate(tm, node))
        return instr

    def _hit_run(self, n: Any) -> HitRun:
        """Check the next ``n`` words (a run of records) and note the operands their hits define."""
        words, start = self._words, self._hit_pos
        if type(n) is not int or n <= 0 or start + n > len(words):
            raise CodecError(
                f"instruction batch {self._batch_no}: hit run of {n!r} words at word {start}: the hit frame holds {len(words)} (truncated or malformed)"
            )
        end = start + n
        where = f"instruction batch {self._batch_no}"
        hts = self._tables["hit"]
        lazy, free, known = self._lazy, self._free, self._operands
        p = start
        while p < end:
            w = words[p]
            kind = w & 3
            if kind == HIT:
                hid = w >> 2
                if not 0 <= hid < len(hts):
                    raise CodecError(
                        f"{where}: hit record at word {p}: unknown hit template {hid} (known: {len(hts)})"
                    )
                ht = hts[hid]
                q = p + 3 + ht.n_slots
                if q > end:
                    raise CodecError(
                        f"{where}: hit record at word {p}: truncated ({end - p} of {q - p} words)"
                    )
                first = words[p + 2]
                if not (0 <= words[p + 1] <= _MAX_ID and 0 <= first <= _MAX_ID - ht.n_out):
                    raise CodecError(f"{where}: hit record at word {p}: operator or output id out of range")
                if ht.dense:
                    if ht.n_slots and min(words[p + 3 : q]) < 0:
                        raise CodecError(f"{where}: hit record at word {p}: a negative input id")
                else:
                    for i, here in zip(words[p + 3 : q], ht.present, strict=True):
                        if (i >= 0) is not here or i < -1:
                            raise CodecError(
                                f"{where}: hit record at word {p}: input ids do not match the template's slots"
                            )
                # the record defines its outputs anew: an older operand of the same id (a compiled program's
                # own operands share the id space) must not answer for them
                if ht.n_out == 1:
                    lazy[first] = ht
                    if first in known:
                        del known[first]
                else:
                    lazy[first] = ht
                    known.pop(first, None)
                    for k in range(1, ht.n_out):
                        lazy[first + k] = (ht, k)
                        known.pop(first + k, None)
                p = q
            elif kind == FREE:
                q = p + 1 + (w >> 2)
                if w < 0 or q > end:
                    raise CodecError(f"{where}: free record at word {p}: truncated or malformed")
                free(words[p + 1 : q])
                p = q
            else:
                raise CodecError(f"{where}: record at word {p}: unknown record kind {kind}")
        self._hit_pos = end
        return HitRun(self, words, start, end)  # type: ignore[arg-type]

    def materialize(self, ht: HitTemplate, node_id: int, ids: list[int], first: int) -> RunOp:
        """The ``RunOp`` of one record (the general path runs it)."""
        operand = self._run_operand
        inputs: list[Operand | None] = [None if i < 0 else operand(i) for i in ids]
        outputs = [operand(first + k) for k in range(ht.n_out)]
        instr: RunOp = self._make_run_op(node_id, inputs, ht.tm, outputs, None)  # type: ignore[attr-defined]
        if (
            instr.replay_key is None
        ):  # a template with list arguments: replayed all the same (see _define_hit)
            instr = RunOp(instr.node, None, replay_key=ht.tm)
        return instr


def _make_operand(i: int, v: Any) -> Operand:
    ht, k = (v, 0) if type(v) is HitTemplate else v
    shape, dtype, mesh, placements, stride, requires_grad, tag = ht.out_types[k]
    return Operand(i, shape, dtype, mesh, placements, stride, requires_grad=requires_grad, tag=tag)
