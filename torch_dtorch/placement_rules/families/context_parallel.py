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

Kernels: a Ulysses-only call (no ring axis) runs torch's own ``scaled_dot_product_attention`` on its ``H/n``
heads of the whole sequence (the fused flash / memory-efficient kernels on CUDA); ring blocks use a float32 math
kernel with log-sum-exp (CPU and fallback), on CUDA the memory-efficient SDPA kernel for unmasked blocks when it is
available. ``local_attention_hooks`` observe the local tensors every attention computation runs on.
Communication goes through the worker's communicator (``LocalContext.comm``, given by the runtime; the simulator's
``run_all_ranks`` gives a thread per rank one); a lone ``run_rank`` has none and raises :class:`ContextParallelError`.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from typing import Any, Literal

import torch

from torch_dtorch.errors import DTorchError
from torch_dtorch.mesh import DeviceMesh
from torch_dtorch.placement import Placements, Replicate, Shard, chunk_size_and_offset, local_shape_and_offset
from torch_dtorch.placement_rules.call import LocalContext, OpCall
from torch_dtorch.placement_rules.signature import PlacementSignature, sig

__all__ = [
    "CP_AXIS_MODES",
    "ContextParallelError",
    "cp_axes",
    "cp_signatures",
    "device_comm",
    "exchange",
    "kernel_needs_comm",
    "local_attention_hooks",
    "observe_local_attention",
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
#: point-to-point tag of the CP kernels (messages between one pair with one tag arrive in order)
CP_TAG = 0x6370

_R = Replicate()


class ContextParallelError(DTorchError, RuntimeError):
    """A context-parallel attention call that cannot run (no communicator, no head dim for Ulysses, ...)."""


def device_comm(ctx: LocalContext, what: str = "context-parallel attention") -> Any:
    """The rank's communicator (``ctx.comm``, given by the runtime's ``OpRunner``); ``what`` names the kernel in the
    error raised without one."""
    if ctx.comm is None:
        raise ContextParallelError(
            f"{what} on device {ctx.device}: no communicator. Communicating kernels run on workers "
            "(dt.init_device_mesh) or in the simulator's run_all_ranks (a thread per rank); a lone run_rank (the "
            "ReferenceExecutor) cannot run them"
        )
    return ctx.comm if ctx.seq is None else _CallComm(ctx.comm, ctx.seq)


#: call numbers wrap after this many calls (tags stay below 2**29: ``torch.distributed`` groups use 2 * tag + 1)
_SEQ_WRAP = (1 << 13) - 1


class _CallComm:
    """The rank's communicator with the call's number in every point-to-point tag (bits 16-28; the kernel's own tag
    keeps bits 0-15). Messages of different calls never match: a rank that fails halfway through an exchange
    leaves messages that no later call consumes (before, the next call of the same kernel took them for its own)."""

    __slots__ = ("_comm", "_high")

    def __init__(self, comm: Any, seq: int) -> None:
        self._comm = comm
        self._high = (seq % _SEQ_WRAP + 1) << 16

    def _tag(self, tag: int) -> int:
        if not 0 <= tag < 1 << 16:
            raise ValueError(f"point-to-point tags of communicating kernels must be in [0, 65536), got {tag}")
        return self._high | tag

    def send(self, t: torch.Tensor, dst: int, tag: int = 0) -> Any:
        return self._comm.send(t, dst, self._tag(tag))

    def recv(self, src: int, tag: int = 0) -> torch.Tensor:
        return self._comm.recv(src, self._tag(tag))

    def __getattr__(self, name: str) -> Any:  # group(), device, ...: the communicator's own
        return getattr(self._comm, name)


#: op -> predicate: does this call's local kernel communicate (needs ``LocalContext.comm``)?
_COMM_KERNELS: dict[Any, Callable[[OpCall], bool]] = {}


def register_comm_kernel(op: Any, needs_comm: Callable[[OpCall], bool]) -> None:
    """Declare that ``op``'s rule kernel talks to other ranks when ``needs_comm(call)`` is true. The compiled
    back end runs such calls as their own program step with the worker's communicator (``backend/local.py``)."""
    _COMM_KERNELS[op] = needs_comm


def kernel_needs_comm(call: OpCall) -> bool:
    """Whether the local kernel of ``call`` needs the worker's communicator (context-parallel attention, p-norms and
    ``prod`` over a sharded dim: ``norm_comm.py``)."""
    pred = _COMM_KERNELS.get(call.op)
    return pred is not None and pred(call)


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


# --- positions ------------------------------------------------------------------------------------------------
Coord = tuple[int, ...]
PosFn = Callable[[Coord], torch.Tensor]


def _range_pos(
    shape: tuple[int, ...], mesh_shape: tuple[int, ...], pl: Placements, dim: int, device: torch.device | None
) -> PosFn:
    def pos(c: Coord) -> torch.Tensor:
        s, o = local_shape_and_offset(shape, mesh_shape, pl, c)
        if not s[dim]:
            return torch.zeros(0, dtype=torch.long, device=device)
        return torch.arange(o[dim], o[dim] + s[dim], device=device)

    return pos


def _with(c: Coord, axis: int, i: int) -> Coord:
    return (*c[:axis], i, *c[axis + 1 :])


def _gathered(pos: PosFn, axis: int, n: int) -> PosFn:
    """Positions after a Ulysses exchange over ``axis``: the rows of every member, in member order."""
    return lambda c: torch.cat([pos(_with(c, axis, i)) for i in range(n)])


# --- point-to-point exchange ----------------------------------------------------------------------------------
def exchange(
    comm: Any, devices: Sequence[int], me: int, pieces: Sequence[torch.Tensor], *, tag: int = CP_TAG
) -> list[torch.Tensor]:
    """All-to-all with arbitrary pieces: ``pieces[t]`` goes to member ``t``; returns what every member sent me."""
    works = [comm.send(p.contiguous(), d, tag) for t, (d, p) in enumerate(zip(devices, pieces)) if t != me]
    got = [pieces[me] if s == me else comm.recv(d, tag) for s, d in enumerate(devices)]
    for w in works:
        w.wait()
    return got


def _relayout(
    x: torch.Tensor,
    dim: int,
    comm: Any,
    devices: Sequence[int],
    me: int,
    src_pos: Sequence[torch.Tensor],
    dst_pos: Sequence[torch.Tensor],
) -> torch.Tensor:
    """Move rows (along ``dim``) from the layout ``src_pos`` (positions per member) to ``dst_pos``."""
    owner: dict[int, int] = {}
    for t, p in enumerate(dst_pos):
        for v in p.tolist():
            owner[v] = t
    mine = src_pos[me].tolist()
    dest = torch.tensor([owner[v] for v in mine], dtype=torch.long, device=src_pos[me].device)
    pieces = [x.index_select(dim, (dest == t).nonzero().flatten().to(x.device)) for t in range(len(devices))]
    got = exchange(comm, devices, me, pieces)
    got_pos = torch.cat(
        [src_pos[s][torch.tensor([owner[v] == me for v in src_pos[s].tolist()], device=src_pos[s].device)]
         if src_pos[s].numel() else src_pos[s] for s in range(len(devices))]
    )  # fmt: skip
    rows = torch.cat(got, dim=dim)
    order = torch.argsort(got_pos)
    idx = order[torch.searchsorted(got_pos[order], dst_pos[me])]
    return rows.index_select(dim, idx.to(rows.device))


def _zigzag(pos: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Load-balanced causal layout: the sorted union in ``2n`` chunks, member ``j`` takes ``j`` and ``2n-1-j``."""
    n = len(pos)
    union = torch.sort(torch.cat(list(pos))).values
    chunks = []
    for i in range(2 * n):
        size, off = chunk_size_and_offset(union.numel(), 2 * n, i)
        chunks.append(union[off : off + size])
    return [torch.cat([chunks[j], chunks[2 * n - 1 - j]]) for j in range(n)]


# --- block attention ------------------------------------------------------------------------------------------
def _block_math(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, mask: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of one (query block, key block) in float32 with its log-sum-exp; fully masked rows give 0, -inf."""
    s = torch.matmul(q.float(), k.float().transpose(-2, -1)) * scale
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else s + mask.float()
    lse = torch.logsumexp(s, dim=-1, keepdim=True)
    safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    out = torch.matmul(torch.exp(s - safe), v.float())
    return out, lse


def _block(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, mask: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    if (
        q.is_cuda
        and mask is None
        and q.ndim == 4
        and q.dtype in (torch.float16, torch.bfloat16, torch.float32)
    ):
        try:
            out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(
                q, k, v, None, True, 0.0, False, scale=scale
            )[:2]
            return out.float(), lse[..., : q.shape[-2]].unsqueeze(-1).float()
        except (RuntimeError, NotImplementedError):  # no efficient kernel for these shapes: math
            pass
    return _block_math(q, k, v, scale, mask)


def _merge(
    acc: tuple[torch.Tensor, torch.Tensor] | None, new: tuple[torch.Tensor, torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    if acc is None:
        return new
    (o1, l1), (o2, l2) = acc, new
    lse = torch.logaddexp(l1, l2)
    safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    return o1 * torch.exp(l1 - safe) + o2 * torch.exp(l2 - safe), lse


def _causal_mask(
    qpos: torch.Tensor, kpos: torch.Tensor, device: torch.device
) -> torch.Tensor | None | Literal[False]:
    """``None``: nothing masked; ``False``: everything masked; else the boolean mask ``kpos <= qpos``."""
    if qpos.numel() == 0 or kpos.numel() == 0:
        return False
    if int(kpos.max()) <= int(qpos.min()):
        return None
    if int(kpos.min()) > int(qpos.max()):
        return False
    return (kpos.view(1, -1) <= qpos.view(-1, 1)).to(device)


def _repeat_heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    h = x.shape[-3]
    if h == heads:
        return x
    if h == 1:
        return x.expand(*x.shape[:-3], heads, *x.shape[-2:])
    return x.repeat_interleave(heads // h, dim=-3)


def _mask_block(
    mask: torch.Tensor | None, row_off: int, qpos: torch.Tensor, kpos: torch.Tensor
) -> torch.Tensor | None:
    """The explicit mask's entries for (query positions, key positions)."""
    if mask is None:
        return None
    m = mask
    if m.ndim >= 2 and m.shape[-2] != 1:
        m = m.index_select(-2, (qpos - row_off).to(m.device))
    if m.shape[-1] != 1:
        m = m.index_select(-1, kpos.to(m.device))
    return m


def _and(causal: torch.Tensor | None, explicit: torch.Tensor | None) -> torch.Tensor | None:
    if causal is None:
        return explicit
    if explicit is None:
        return causal
    if explicit.dtype == torch.bool:
        return explicit & causal
    return explicit.masked_fill(~causal, float("-inf"))


def _runs(pos: torch.Tensor) -> list[tuple[int, int]]:
    """``(start, length)`` of the maximal runs of consecutive positions (a zig-zag block has two)."""
    if pos.numel() == 0:
        return []
    breaks = ((pos[1:] - pos[:-1]) != 1).nonzero().flatten().tolist()
    starts = [0] + [b + 1 for b in breaks]
    ends = [b + 1 for b in breaks] + [pos.numel()]
    return [(a, b - a) for a, b in zip(starts, ends, strict=True)]


#: observers of every local attention computation on a worker: ``hook(device, q, k, v)`` with the local tensors
#: the attention kernel is about to run on (tests check that the work is divided: 1/n of the heads for Ulysses,
#: 1/n of the sequence for ring). Empty in normal runs (one list check per call).
local_attention_hooks: list[Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], None]] = []


def observe_local_attention(device: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    for hook in local_attention_hooks:
        hook(device, q, k, v)


#: score elements (query rows x key columns) computed per device by the CP kernels (a debugging counter: tests
#: use it to check the causal load balance)
BLOCK_STATS: dict[int, int] = {}


def _ring(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    qpos: torch.Tensor,
    kpos: Sequence[torch.Tensor],
    me: int,
    devices: Sequence[int],
    comm: Any,
    scale: float,
    causal: bool,
    mask: torch.Tensor | None,
    mask_row_off: int,
) -> torch.Tensor:
    """Ring attention over ``devices`` (a group of one: plain blockwise attention on the local rows).

    Blocks are split into runs of consecutive positions, so a causal zig-zag block computes only its visible
    (query run, key run) pairs: fully masked pairs are skipped, fully visible ones need no mask."""
    n = len(devices)
    nxt, prv = devices[(me + 1) % n], devices[(me - 1) % n]
    qruns = _runs(qpos)
    accs: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * len(qruns)
    cur_k, cur_v = k, v
    heads = q.shape[-3] if q.ndim >= 3 else 1
    computed = 0
    for step in range(n):
        src = (me - step) % n
        works = []
        if step < n - 1:  # start passing this block on before computing with it
            works = [comm.send(cur_k.contiguous(), nxt, CP_TAG), comm.send(cur_v.contiguous(), nxt, CP_TAG)]
        kk, vv = cur_k, cur_v
        if q.ndim >= 3 and kk.ndim >= 3 and kk.shape[-3] not in (1, heads):  # GQA: repeat kv heads
            kk, vv = _repeat_heads(kk, heads), _repeat_heads(vv, heads)
        kp = kpos[src]
        for ks, kl in _runs(kp):
            kpr = kp[ks : ks + kl]
            kb, vb = kk.narrow(-2, ks, kl), vv.narrow(-2, ks, kl)
            for i, (qs, ql) in enumerate(qruns):
                qpr = qpos[qs : qs + ql]
                cm = _causal_mask(qpr, kpr, q.device) if causal else None
                if cm is False:
                    continue
                m = _and(cm, _mask_block(mask, mask_row_off, qpr, kpr))
                qb = q.narrow(-2, qs, ql)
                if local_attention_hooks:
                    observe_local_attention(devices[me], qb, kb, vb)
                accs[i] = _merge(accs[i], _block(qb, kb, vb, scale, m))
                computed += ql * kl
        if step < n - 1:
            cur_k, cur_v = comm.recv(prv, CP_TAG), comm.recv(prv, CP_TAG)
            for w in works:
                w.wait()
    BLOCK_STATS[devices[me]] = BLOCK_STATS.get(devices[me], 0) + computed
    vlead = list(v.shape[:-2])
    if q.ndim >= 3 and v.ndim >= 3 and vlead[-1] not in (1, heads):
        vlead[-1] = heads
    lead = torch.broadcast_shapes(q.shape[:-2], torch.Size(vlead))
    parts = []
    for (_, ql), acc in zip(qruns, accs, strict=True):
        if acc is None:
            parts.append(torch.zeros(*lead, ql, v.shape[-1], dtype=q.dtype, device=q.device))
        else:
            parts.append(acc[0].to(q.dtype))
    if not parts:
        return torch.zeros(*lead, 0, v.shape[-1], dtype=q.dtype, device=q.device)
    return torch.cat(parts, dim=-2)


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
    qpos_fn = _range_pos(qop.shape, ms, pq, qop.ndim - 2, ctx.torch_device)
    kpos_fn = _range_pos(kop.shape, ms, pk, kop.ndim - 2, ctx.torch_device)
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
        k, v = _repeat_heads(k, q.shape[-3]), _repeat_heads(v, q.shape[-3])
    for a in ulysses:  # sequence-sharded -> head-sharded over axis a
        n, me = ms[a], coord[a]
        devices = [int(ids[_with(coord, a, i)]) for i in range(n)]
        heads = q.shape[-3]
        chunks = [chunk_size_and_offset(heads, n, i) for i in range(n)]
        rows = [int(qpos_fn(_with(coord, a, i)).numel()) for i in range(n)]

        pieces = [[x.narrow(-3, off, size) for size, off in chunks] for x in (q, k, v)]
        q, k, v = (torch.cat(exchange(comm, devices, me, p), dim=-2) for p in pieces)
        if mask is not None and mask.ndim >= 3 and mask.shape[-3] == heads and heads > 1:
            mask = mask.narrow(-3, chunks[me][1], chunks[me][0])
        undo.append((devices, me, rows))
        qpos_fn, kpos_fn = _gathered(qpos_fn, a, n), _gathered(kpos_fn, a, n)
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
        group = [_with(c, a, i) for c in group for i in range(ms[a])]
    group.sort()
    me = group.index(coord)
    devices = [int(ids[c]) for c in group]
    qpos, kpos = [qpos_fn(c) for c in group], [kpos_fn(c) for c in group]
    balance = causal and len(group) > 1
    qz, kz = (_zigzag(qpos), _zigzag(kpos)) if balance else (qpos, kpos)
    if balance:
        sd = q.ndim - 2
        q = _relayout(q, sd, comm, devices, me, qpos, qz)
        k = _relayout(k, k.ndim - 2, comm, devices, me, kpos, kz)
        v = _relayout(v, v.ndim - 2, comm, devices, me, kpos, kz)
    out = _ring(
        q, k, v, qpos=qz[me], kpos=kz, me=me, devices=devices, comm=comm, scale=scale, causal=causal,
        mask=mask, mask_row_off=mask_row_off,
    )  # fmt: skip
    if balance:
        out = _relayout(out, out.ndim - 2, comm, devices, me, qz, qpos)
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
