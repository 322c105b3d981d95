"""Instruction batches (:mod:`~torch_dtorch.executor.instructions`) <-> trees the wire format carries — never pickle.

The controller's :class:`BatchEncoder` turns one batch into a small tree for
:func:`~torch_dtorch.cluster.transport.wire.encode`: the instructions as compact JSON bytes (one signed frame, made by
the C JSON encoder rather than walked by the wire format) plus a list of tensor constants (zero-copy frames); a
worker's :class:`BatchDecoder` turns ``wire.decode(...).body`` back into instructions that run on
:class:`~torch_dtorch.executor.worker.Worker` exactly as the originals. One decoder per worker process; every worker
decodes every batch (it holds the whole session's tables, whichever devices the instructions concern).

Both sides are stateful (batches are decoded in the order they were encoded; the transport checks sequence numbers):
ops, meshes, operand metadata types and operator templates are sent once and named by small ids afterwards, operands
by their id. A repeated op (same op, constants, placements, plan) costs a few ints: the node id, input/output operand
ids and a template id. Tables are numbered in the order their definitions appear in the tree, so the decoder must see
every batch once, in order. :meth:`BatchEncoder.reset` (or an encode that failed half-way) makes the next batch carry
a reset flag: every decoder then starts from scratch. Batch numbers are checked; a gap raises :class:`CodecError`.

Batch tree: ``["dtorch-codec", VERSION, batch_no, reset, cleared_tables, dropped_operand_ids, json_bytes,
hit_bytes | None, [tensor...]]``; ``json_bytes`` holds ``[instruction...]``, ``hit_bytes`` the binary records of the
fast path's hits and of frees (:mod:`~torch_dtorch.cluster.codec.hits`; version 2), placed in the order by
``["H", n_words]`` instructions.
Instruction trees are ``[tag, ...]``; :func:`register_codec` adds tags for instruction types of higher layers.
Operators are rebuilt with their rule found again in the placement_rules registry by the overload's qualified name
(``"aten::add.Tensor"``). Operand view info: ``base`` and ``copy_of`` travel as operand refs, ``view`` as the
carrying call's op and constants. Tensor constants are sent by value with every call (never cached).
"""

from __future__ import annotations

from torch_dtorch.cluster.codec import hit_worker as _hit_worker  # noqa: F401 - registers the HitRun handler
from torch_dtorch.cluster.codec.common import VERSION, CodecError, register_codec
from torch_dtorch.cluster.codec.decoder import BatchDecoder, DecodeContext
from torch_dtorch.cluster.codec.encoder import BatchEncoder, EncodeContext

__all__ = [
    "VERSION",
    "BatchDecoder",
    "BatchEncoder",
    "CodecError",
    "DecodeContext",
    "EncodeContext",
    "register_codec",
]
