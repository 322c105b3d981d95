"""Context-parallel ``scaled_dot_product_attention``: Ulysses and ring attention, selected by placements.

**Selection.** When the call's mesh has a *context-parallel axis* — an axis named ``cp``, ``ring``, ``cp_ring``,
``ulysses`` or ``cp_ulysses`` (:data:`CP_AXIS_MODES`) — the SDPA rule offers one more signature per axis:
``q S(-2), k S(-2), v S(-2), mask R -> out S(-2)`` (sequence sharded, see ``attention.py``). Every axis on which
``q`` and ``k`` are then both sequence-sharded is a CP axis of the call: ``ulysses``/``cp_ulysses`` axes run
Ulysses, every other one runs ring attention. Several CP axes combine: Ulysses first (over each Ulysses axis in
mesh order), then one ring over the devices of all ring axes. Batch/head sharding on other axes (DP, TP) and query
sequence sharding on a non-CP axis compose with it.

**Ulysses**: all-to-all ``q/k/v`` from sequence-sharded to head-sharded (each rank gets every row of ``H/n``
heads), local attention, all-to-all back. Needs a head dim (``ndim >= 3``); kv heads that do not equal the query
heads (GQA, broadcast) are repeated to the query heads first. Uneven sequences and head counts are exact.

**Ring**: every rank keeps its query block; key/value blocks travel around the ring by point-to-point sends
(``n - 1`` steps, the next block's send overlapping this block's compute); each step computes blockwise attention
with its log-sum-exp and merges it online (``out = Σ exp(lse_i - lse) out_i``). Causal attention masks by global
positions (the top-left alignment of ``is_causal``), skips fully masked blocks, and is **load balanced**: before
the ring, rows move to a zig-zag layout (the group's positions in ``2n`` chunks, rank ``j`` takes chunks ``j`` and
``2n-1-j``) and back after, so every rank computes the same number of unmasked blocks. An explicit ``attn_mask``
is replicated on the CP axes and sliced per block by global row / column positions.

Positions are global, so rotary embeddings (computed by the model from ``arange(L)``, replicated, and sliced to the
query shard by the elementwise rules) follow the sharding without model changes.

The ring kernels live in ``context_parallel_ring.py``, the communicator plumbing in ``comm.py``, the backward in
``attention_backward.py``. Kernels: a Ulysses-only call (no ring axis) runs torch's own ``scaled_dot_product_attention`` on its ``H/n``
heads of the whole sequence (the fused flash / memory-efficient kernels on CUDA); ring blocks use a float32 math
kernel with log-sum-exp (CPU and fallback), on CUDA the memory-efficient SDPA kernel for unmasked blocks when it is
available. ``local_attention_hooks`` observe the local tensors every attention computation runs on.
Communication goes through the worker's communicator (``LocalContext.comm``, given by the runtime; the simulator's
``run_all_ranks`` gives a thread per rank one); a lone ``run_rank`` has none and raises :class:`ContextParallelError`.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import Any

import torch

from torch_dtorch.graph import Operand
from torch_dtorch.mesh import DeviceMesh
from torch_dtorch.placement import Placement, Replicate, Shard, chunk_size_and_offset, local_shape_and_offset
from torch_dtorch.placement_rules.call import LocalContext, OpCall
from torch_dtorch.placement_rules.families.comm import (
    CP_TAG,
    ContextParallelError,
    device_comm,
    exchange,
    kernel_needs_comm,
    register_comm_kernel,
)
from torch_dtorch.placement_rules.families.context_parallel_ring import (
    BLOCK_STATS,
    gathered,
    local_attention_hooks,
    observe_local_attention,
    range_pos,
    relayout,
    repeat_heads,
    ring_attention,
    with_coord,
    zigzag,
)
from torch_dtorch.placement_rules.signature import PlacementSignature, sig

# the communicating-kernel names are re-exported: callers import them from here (comm.py is their home)
__all__ = [
    "BLOCK_STATS",
    "CP_AXIS_MODES",
    "CP_TAG",
    "ContextParallelError",
    "cp_axes",
    "cp_signatures",
    "device_comm",
    "exchange",
    "kernel_needs_comm",
    "local_attention_hooks",
    "observe_local_attention",
    "query_rows_split",
    "register_comm_kernel",
    "run_context_parallel",
]

log = logging.getLogger(__name__)

#: mesh axis name -> context-parallel mode of sequence-sharded attention on that axis
CP_AXIS_MODES: dict[str, str] = {
    "cp": "ring",
    "ring": "ring",
    "cp_ring": "ring",
    "ulysses": "ulysses",
    "cp_ulysses": "ulysses",
}

_R = Replicate()


def mesh_has_cp_axis(mesh: DeviceMesh | None) -> bool:
    names = mesh.mesh_dim_names if mesh is not None else None
    return names is not None and any(n in CP_AXIS_MODES for n in names)


def cp_signatures(call: OpCall) -> list[PlacementSignature]:
    """``(q S(-2), k S(-2), v S(-2), mask R) -> S(-2)`` when the mesh has a context-parallel axis."""
    if not mesh_has_cp_axis(call.mesh):
        return []
    q, k, v, _ = call.inputs
    assert q is not None and k is not None and v is not None
    out_nd = len(call.out_meta[0].shape)
    if min(q.ndim, k.ndim, v.ndim) < 2:
        return []
    return [sig([Shard(q.ndim - 2), Shard(k.ndim - 2), Shard(v.ndim - 2), _R], Shard(out_nd - 2))]


def query_rows_split(mesh: DeviceMesh, q: Operand, pq: Sequence[Placement]) -> bool:
    """``q``'s sequence dim (-2) is sharded on a mesh axis of more than one device: each rank holds some query rows
    only (a causal call then needs its rank's offset; torch's own kernels assume rows from 0)."""
    seq = q.ndim - 2
    return any(mesh.shape[a] > 1 and isinstance(p, Shard) and p.dim % q.ndim == seq for a, p in enumerate(pq))


def cp_axes(call: OpCall) -> list[int]:
    """Mesh axes on which q and k are both sequence-sharded (the call's context-parallel axes)."""
    q, k = call.inputs[0], call.inputs[1]
    pq, pk = call.placements[0], call.placements[1]
    if q is None or k is None or pq is None or pk is None or not mesh_has_cp_axis(call.mesh):
        return []
    assert call.mesh is not None
    sq, sk = Shard(q.ndim - 2), Shard(k.ndim - 2)
    return [a for a in range(call.mesh.ndim) if call.mesh.shape[a] > 1 and pq[a] == sq and pk[a] == sk]


def _mode(mesh: DeviceMesh, axis: int) -> str:
    names = mesh.mesh_dim_names
    return CP_AXIS_MODES.get(names[axis], "ring") if names is not None else "ring"


def run_context_parallel(call: OpCall, ctx: LocalContext, bound: dict[str, Any]) -> torch.Tensor:
    """The local kernel of a context-parallel SDPA call on one rank (see the module docstring)."""
    mesh = call.mesh
    assert mesh is not None
    ms, coord = mesh.shape, tuple(ctx.coordinate)
    axes = cp_axes(call)
    comm = device_comm(ctx)
    q, k, v = bound["query"], bound["key"], bound["value"]
    mask = bound.get("attn_mask")
    causal = bool(bound.get("is_causal", False))
    scale = bound.get("scale")
    scale = float(scale) if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    qop, kop, _, mop = call.inputs
    assert qop is not None and kop is not None
    pq, pk = call.placements[0], call.placements[1]
    assert pq is not None and pk is not None
    qpos_fn = range_pos(qop.shape, ms, pq, qop.ndim - 2, ctx.torch_device)
    kpos_fn = range_pos(kop.shape, ms, pk, kop.ndim - 2, ctx.torch_device)
    mask_row_off = 0
    if mask is not None and mop is not None and mop.ndim >= 2 and mop.shape[-2] != 1:
        pm = call.placements[3]
        assert pm is not None
        mask_row_off = local_shape_and_offset(mop.shape, ms, pm, coord)[1][-2]
    ulysses = [a for a in axes if _mode(mesh, a) == "ulysses"]
    ring = [a for a in axes if a not in ulysses]
    ids = mesh.mesh
    undo: list[tuple[list[int], int, list[int]]] = []
    if ulysses:
        if q.ndim < 3 or k.ndim != q.ndim or v.ndim != q.ndim:
            raise ContextParallelError(
                f"{call.op}: Ulysses attention on mesh axes {[mesh.axis_name(a) for a in ulysses]} needs q, k, v "
                f"with a head dim (-3) and equal ranks, got local shapes {list(q.shape)}, {list(k.shape)}, "
                f"{list(v.shape)}; use a ring axis ('cp'/'ring') for these shapes"
            )
        k, v = repeat_heads(k, q.shape[-3]), repeat_heads(v, q.shape[-3])
    for a in ulysses:  # sequence-sharded -> head-sharded over axis a
        n, me = ms[a], coord[a]
        devices = [int(ids[with_coord(coord, a, i)]) for i in range(n)]
        heads = q.shape[-3]
        chunks = [chunk_size_and_offset(heads, n, i) for i in range(n)]
        rows = [int(qpos_fn(with_coord(coord, a, i)).numel()) for i in range(n)]

        pieces = [[x.narrow(-3, off, size) for size, off in chunks] for x in (q, k, v)]
        q, k, v = (torch.cat(exchange(comm, devices, me, p), dim=-2) for p in pieces)
        if mask is not None and mask.ndim >= 3 and mask.shape[-3] == heads and heads > 1:
            mask = mask.narrow(-3, chunks[me][1], chunks[me][0])
        undo.append((devices, me, rows))
        qpos_fn, kpos_fn = gathered(qpos_fn, a, n), gathered(kpos_fn, a, n)
    if not ring:
        whole = _whole_sequence(qpos_fn(coord), qop.shape[-2]) and _whole_sequence(
            kpos_fn(coord), kop.shape[-2]
        )
        if whole and mask_row_off == 0:  # every row of H/n heads here: torch's own (fused) attention kernel
            if local_attention_hooks:
                observe_local_attention(int(ids[coord]), q, k, v)
            out = torch.ops.aten.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, is_causal=causal, scale=bound.get("scale")
            )
            return _ulysses_back(out, comm, undo)
    group = [coord]
    for a in ring:
        group = [with_coord(c, a, i) for c in group for i in range(ms[a])]
    group.sort()
    me = group.index(coord)
    devices = [int(ids[c]) for c in group]
    qpos, kpos = [qpos_fn(c) for c in group], [kpos_fn(c) for c in group]
    balance = causal and len(group) > 1
    qz, kz = (zigzag(qpos), zigzag(kpos)) if balance else (qpos, kpos)
    if balance:
        sd = q.ndim - 2
        q = relayout(q, sd, comm, devices, me, qpos, qz)
        k = relayout(k, k.ndim - 2, comm, devices, me, kpos, kz)
        v = relayout(v, v.ndim - 2, comm, devices, me, kpos, kz)
    out = ring_attention(
        q, k, v, qpos=qz[me], kpos=kz, me=me, devices=devices, comm=comm, scale=scale, causal=causal,
        mask=mask, mask_row_off=mask_row_off,
    )  # fmt: skip
    if balance:
        out = relayout(out, out.ndim - 2, comm, devices, me, qz, qpos)
    return _ulysses_back(out, comm, undo)


def _whole_sequence(pos: torch.Tensor, length: int) -> bool:
    """Whether ``pos`` is every position ``0 .. length-1`` in order (the rows a lone Ulysses group gathers)."""
    if pos.numel() != length:
        return False
    return length == 0 or bool(torch.equal(pos, torch.arange(length, device=pos.device)))


def _ulysses_back(out: torch.Tensor, comm: Any, undo: list[tuple[list[int], int, list[int]]]) -> torch.Tensor:
    """Head-sharded -> sequence-sharded: the Ulysses exchanges of ``run_context_parallel`` undone in reverse."""
    for devices_u, me_u, rows in reversed(undo):
        got = exchange(comm, devices_u, me_u, list(out.split(rows, dim=-2)))
        out = torch.cat(got, dim=-3)
    return out
