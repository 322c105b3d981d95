"""Attention with its log-sum-exp, and its backward: ``_scaled_dot_product_flash_attention_for_cpu`` and
``_scaled_dot_product_flash_attention_for_cpu_backward`` — the pair that dtorch's SDPA autograd
(``device/attention_grad.py``) runs, so that ``loss.backward()`` through a sequence-sharded attention stays context
parallel (Ulysses and ring) instead of decomposing into a gathered math path.

Forward ``(q [..., L, E], k [..., S, E], v [..., S, Ev], mask?) -> (out [..., L, Ev], lse [..., L] float32)``;
backward ``(dout, q, k, v, out, lse, mask?) -> (dq, dk, dv)``. q, k and v share their leading (batch, head) dims
(GQA repeats the kv heads before, so autograd sums their gradients). Signatures (one mesh axis):

- **batch / head dims** ``d``: every tensor ``S(d)`` (the mask where it has the dim at full size) -> ``S(d)``;
- **query sequence**: ``q``, ``out``, ``dout`` ``S(-2)``, ``lse`` ``S(-1)``, ``k`` / ``v`` ``R``, mask rows
  ``S(-2)`` or ``R`` -> forward ``S(-2)`` / ``S(-1)``; backward ``dq`` ``S(-2)``, ``dk`` / ``dv`` ``P(sum)`` (each
  rank's query rows contribute to every key);
- **context parallel** (meshes with a CP axis, ``context_parallel.py``): q, k, v (and out, dout) ``S(-2)``, lse
  ``S(-1)``, mask ``R`` -> ``S(-2)`` (and lse ``S(-1)``); the kernel communicates;
- backward, **linear in dout**: ``dout`` ``P(sum|avg)``, the rest ``R`` -> every gradient the same ``P``.

Kernels (per rank): where nothing is context parallel, torch's own fused kernels when they compute the same thing
— on CPU meshes the pair itself (:func:`fused_locally`, which workers replay), on CUDA flash or memory-efficient
attention (``attention_local.choose_kernel``: fp16/bf16/fp32, a head size torch's kernels take, causal only where
the rank's queries start at row 0). Everything else runs one blockwise float32 computation with global positions —
a ring group of one when nothing is context parallel (causal offsets and masks by global row / column: a causal
query shard below row 0), the ring of ``context_parallel_ring`` otherwise. **Ulysses** axes first move every tensor from sequence- to head-sharded (all-to-all, as the forward
does) and back after. **Ring** backward: the query side (q, out, dout, lse) stays; key/value blocks travel around
the ring with their gradient accumulators ``dk`` / ``dv`` — ``n`` rotations, so each block's accumulators come home
with every rank's contribution — and each step adds ``dq += s·dS·k``, ``dk += s·dSᵀ·q``, ``dv += Pᵀ·dout`` with
``P = exp(s·q·kᵀ - lse)`` and ``dS = P ∘ (dout·vᵀ - rowsum(dout ∘ out))``. Causal calls use the zig-zag layout of
the forward (load balanced), fully masked block pairs are skipped.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any

import torch

from torch_dtorch.graph import Operand, OperatorCost
from torch_dtorch.ops.cost import sdpa_cost
from torch_dtorch.placement import (
    Partial,
    Placement,
    Replicate,
    Shard,
    chunk_size_and_offset,
    local_shape_and_offset,
)
from torch_dtorch.placement_rules.call import LocalContext, OpCall, every_shard_nonempty
from torch_dtorch.placement_rules.families.attention_local import (
    Choice,
    choose_kernel,
    cuda_support,
    fused_backward,
    fused_forward,
)
from torch_dtorch.placement_rules.families.comm import (
    CP_TAG,
    ContextParallelError,
    device_comm,
    exchange,
    register_comm_kernel,
)
from torch_dtorch.placement_rules.families.context_parallel import (
    CP_AXIS_MODES,
    mesh_has_cp_axis,
    query_rows_split,
)
from torch_dtorch.placement_rules.families.context_parallel_ring import (
    causal_mask,
    gathered,
    local_attention_hooks,
    mask_and,
    mask_block,
    observe_local_attention,
    range_pos,
    relayout,
    ring_attention,
    runs,
    with_coord,
    zigzag,
)
from torch_dtorch.placement_rules.rule import register_rule
from torch_dtorch.placement_rules.signature import PlacementSignature, sig

__all__ = ["ATTENTION_WITH_LSE", "ATTENTION_BACKWARD"]

log = logging.getLogger(__name__)

aten = torch.ops.aten
_R = Replicate()
ATTENTION_WITH_LSE = aten._scaled_dot_product_flash_attention_for_cpu.default
ATTENTION_BACKWARD = aten._scaled_dot_product_flash_attention_for_cpu_backward.default

#: input slots of the two ops
_FWD = {"q": 0, "k": 1, "v": 2, "mask": 3}
_BWD = {"dout": 0, "q": 1, "k": 2, "v": 3, "out": 4, "lse": 5, "mask": 6}


def _slots(call: OpCall) -> dict[str, int]:
    return _FWD if call.op is ATTENTION_WITH_LSE else _BWD


def _operand(call: OpCall, name: str) -> Operand | None:
    return call.inputs[_slots(call)[name]]


def _check(call: OpCall) -> None:
    q, k, v = (_operand(call, n) for n in ("q", "k", "v"))
    assert q is not None and k is not None and v is not None
    if float(call.arg("dropout_p") or 0.0) > 0.0:
        raise NotImplementedError(f"{call.op}: dropout_p > 0 is not supported on dtorch tensors")
    if q.ndim < 2 or not (q.shape[:-2] == k.shape[:-2] == v.shape[:-2]):
        raise NotImplementedError(
            f"{call.op}: q {list(q.shape)}, k {list(k.shape)}, v {list(v.shape)} must share their leading (batch, "
            "head) dims on dtorch tensors (repeat the kv heads first, as scaled_dot_product_attention's autograd does)"
        )


def _mask_rows(mask: Operand | None, rows: int) -> Placement:
    if mask is not None and mask.ndim >= 2 and mask.shape[-2] == rows:
        return Shard(mask.ndim - 2)
    return _R


def _aligned(x: Operand | None, d: int, nd: int, size: int) -> Placement:
    if x is None:
        return _R
    a = d - (nd - x.ndim)
    return Shard(a) if a >= 0 and x.shape[a] == size else _R


def _signatures(call: OpCall) -> list[PlacementSignature]:
    q = _operand(call, "q")
    assert q is not None
    nd, seq = q.ndim, Shard(q.ndim - 2)
    mask = _operand(call, "mask")
    fwd = call.op is ATTENTION_WITH_LSE
    sigs = []
    for d in range(nd - 2):  # batch / head dims
        m = _aligned(mask, d, nd, q.shape[d])
        ins = [Shard(d)] * 3 + [m] if fwd else [Shard(d)] * 6 + [m]
        sigs.append(sig(ins, [Shard(d)] * (2 if fwd else 3)))
    m_seq = _mask_rows(mask, q.shape[-2])
    if fwd:
        sigs.append(sig([seq, _R, _R, m_seq], [seq, seq]))
    else:
        sigs.append(sig([seq, seq, _R, _R, seq, seq, m_seq], [seq, Partial("sum"), Partial("sum")]))
    if mesh_has_cp_axis(call.mesh):
        if fwd:
            sigs.append(sig([seq, seq, seq, _R], [seq, seq]))
        else:
            sigs.append(sig([seq] * 6 + [_R], [seq, seq, seq]))
    if not fwd:
        for op in ("sum", "avg"):
            sigs.append(sig([Partial(op)] + [_R] * 6, [Partial(op)] * 3))
    return sigs


def cp_axes(call: OpCall) -> list[int]:
    """Mesh axes (size > 1, named for CP) on which q and k are both sequence-sharded."""
    q, k = _operand(call, "q"), _operand(call, "k")
    slots = _slots(call)
    pq, pk = call.placements[slots["q"]], call.placements[slots["k"]]
    if q is None or k is None or pq is None or pk is None or not mesh_has_cp_axis(call.mesh):
        return []
    assert call.mesh is not None
    sq = Shard(q.ndim - 2)
    return [a for a in range(call.mesh.ndim) if call.mesh.shape[a] > 1 and pq[a] == sq and pk[a] == sq]


def _mode(call: OpCall, axis: int) -> str:
    names = call.mesh.mesh_dim_names if call.mesh is not None else None
    return CP_AXIS_MODES.get(names[axis], "ring") if names is not None else "ring"


@dataclass
class _Plan:
    """One rank's layout of a call: Ulysses exchanges, then a ring group (of one when nothing rings)."""

    comm: Any
    undo: list[tuple[list[int], int, list[int], list[tuple[int, int]]]]  # devices, me, rows, head chunks
    devices: list[int]
    me: int
    qpos: list[torch.Tensor]  # per ring member, after the Ulysses exchanges
    kpos: list[torch.Tensor]
    qz: list[torch.Tensor]  # the ring's layout (zig-zag when causal and balanced)
    kz: list[torch.Tensor]
    balance: bool
    mask_row_off: int


def _plan(call: OpCall, ctx: LocalContext, heads: int, causal: bool) -> _Plan:
    mesh = call.mesh
    assert mesh is not None
    ms, coord = mesh.shape, tuple(ctx.coordinate)
    slots = _slots(call)
    q, k, mask = _operand(call, "q"), _operand(call, "k"), _operand(call, "mask")
    assert q is not None and k is not None
    pq, pk = call.placements[slots["q"]], call.placements[slots["k"]]
    assert pq is not None and pk is not None
    qpos_fn = range_pos(q.shape, ms, pq, q.ndim - 2, ctx.torch_device)
    kpos_fn = range_pos(k.shape, ms, pk, k.ndim - 2, ctx.torch_device)
    mask_row_off = 0
    if mask is not None and mask.ndim >= 2 and mask.shape[-2] != 1:
        pm = call.placements[slots["mask"]]
        assert pm is not None
        mask_row_off = local_shape_and_offset(mask.shape, ms, pm, coord)[1][-2]
    axes = cp_axes(call)
    comm = device_comm(ctx, f"{call.op} (context parallel)") if axes else None
    ids = mesh.mesh
    undo = []
    ulysses = [a for a in axes if _mode(call, a) == "ulysses"]
    if ulysses and q.ndim < 3:
        raise ContextParallelError(
            f"{call.op}: Ulysses attention needs a head dim (-3), got q {list(q.shape)}"
        )
    for a in ulysses:
        n = ms[a]
        devices = [int(ids[with_coord(coord, a, i)]) for i in range(n)]
        rows = [int(qpos_fn(with_coord(coord, a, i)).numel()) for i in range(n)]
        chunks = [chunk_size_and_offset(heads, n, i) for i in range(n)]
        heads = chunks[coord[a]][0]
        undo.append((devices, coord[a], rows, chunks))
        qpos_fn, kpos_fn = gathered(qpos_fn, a, n), gathered(kpos_fn, a, n)
    group = [coord]
    for a in (a for a in axes if a not in ulysses):
        group = [with_coord(c, a, i) for c in group for i in range(ms[a])]
    group.sort()
    qpos, kpos = [qpos_fn(c) for c in group], [kpos_fn(c) for c in group]
    balance = causal and len(group) > 1
    qz, kz = (zigzag(qpos), zigzag(kpos)) if balance else (qpos, kpos)
    return _Plan(
        comm,
        undo,
        [int(ids[c]) for c in group],
        group.index(coord),
        qpos,
        kpos,
        qz,
        kz,
        balance,
        mask_row_off,
    )


def _to_heads(x: torch.Tensor, plan: _Plan, *, seq: int, head: int) -> torch.Tensor:
    """Sequence-sharded -> head-sharded over every Ulysses axis (``seq`` / ``head``: the tensor's dims)."""
    for devices, me, _, chunks in plan.undo:
        pieces = [x.narrow(head, off, size) for size, off in chunks]
        x = torch.cat(exchange(plan.comm, devices, me, pieces, tag=CP_TAG), dim=seq)
    return x


def _from_heads(x: torch.Tensor, plan: _Plan, *, seq: int, head: int) -> torch.Tensor:
    for devices, me, rows, _ in reversed(plan.undo):
        x = torch.cat(exchange(plan.comm, devices, me, list(x.split(rows, dim=seq)), tag=CP_TAG), dim=head)
    return x


def _to_ring(x: torch.Tensor, plan: _Plan, dim: int, *, keys: bool) -> torch.Tensor:
    if not plan.balance:
        return x
    src, dst = (plan.kpos, plan.kz) if keys else (plan.qpos, plan.qz)
    return relayout(x, dim, plan.comm, plan.devices, plan.me, src, dst)


def _from_ring(x: torch.Tensor, plan: _Plan, dim: int, *, keys: bool) -> torch.Tensor:
    if not plan.balance:
        return x
    src, dst = (plan.kz, plan.kpos) if keys else (plan.qz, plan.qpos)
    return relayout(x, dim, plan.comm, plan.devices, plan.me, src, dst)


def _scale(bound: dict[str, Any], q: torch.Tensor) -> float:
    s = bound.get("scale")
    return float(s) if s is not None else 1.0 / math.sqrt(q.shape[-1])


def _bind(call: OpCall, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    names = [a.name for a in call.op._schema.arguments]
    return dict(zip(names, args)) | kwargs


def fused_locally(call: OpCall) -> bool:
    """The call runs as torch's own fused CPU kernel (the op itself) on every rank's shards, which workers replay:
    CPU workers, nothing context parallel, no mask or one of q's dtype (a bool mask: the blockwise kernel), the query
    sequence whole on every rank (causal alignment is then the kernel's own), no empty shard. Otherwise the kernels below decide per rank (:func:`local_choice`): torch's
    fused CUDA attention on CUDA (this aten pair has no CUDA kernel), else the blockwise float32 kernel."""
    mesh = call.mesh
    if mesh is None or mesh.device_type != "cpu" or cp_axes(call):
        return False
    q, pq = _operand(call, "q"), call.placements[_slots(call)["q"]]
    if q is None or pq is None:
        return False
    mask = _operand(call, "mask")
    if mask is not None and mask.dtype != q.dtype:  # torch's CPU kernel takes only a mask of q's dtype
        return False
    if query_rows_split(mesh, q, pq):
        return False
    return every_shard_nonempty(call)


def local_choice(call: OpCall, ctx: LocalContext, b: dict[str, Any]) -> Choice:
    """The rank's local kernel (``attention_local.choose_kernel``) from its bound local arguments ``b``: torch's
    fused CUDA attention, or the blockwise kernel below."""
    q, k, v = b["query"], b["key"], b["value"]
    mesh, pq = call.mesh, call.placements[_slots(call)["q"]]
    q_global = _operand(call, "q")
    assert mesh is not None and pq is not None and q_global is not None
    support = cuda_support(q.device)
    offset = 0  # the global row of the rank's first query (read only on CUDA)
    if support is not None:
        offset = local_shape_and_offset(q_global.shape, mesh.shape, pq, ctx.coordinate)[1][-2]
    choice = choose_kernel(
        q, k, v, b.get("attn_mask"), causal=bool(b.get("is_causal", False)),
        dropout_p=float(b.get("dropout_p") or 0.0), context_parallel=bool(cp_axes(call)), query_offset=offset,
        support=support,
    )  # fmt: skip
    log.debug("%s on device %d: %s kernel (%s)", call.op, ctx.device, choice.kernel.value, choice.reason)
    return choice


def _forward_kernel(call: OpCall, ctx: LocalContext, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    if fused_locally(call):
        return call.op(*args, **kwargs)
    b = _bind(call, args, kwargs)
    q, k, v, mask = b["query"], b["key"], b["value"], b.get("attn_mask")
    causal = bool(b.get("is_causal", False))
    choice = local_choice(call, ctx, b)
    if choice.fused:
        return fused_forward(choice, q, k, v, mask, causal=causal, scale=b.get("scale"))
    plan = _plan(call, ctx, q.shape[-3] if q.ndim >= 3 else 1, causal)
    scale = _scale(b, q)
    q, k, v = (_to_heads(x, plan, seq=-2, head=-3) for x in (q, k, v))
    if plan.undo and mask is not None and mask.ndim >= 3 and mask.shape[-3] > 1:
        raise NotImplementedError(f"{call.op}: a per-head attn_mask under Ulysses is not supported")
    q = _to_ring(q, plan, q.ndim - 2, keys=False)
    k, v = _to_ring(k, plan, k.ndim - 2, keys=True), _to_ring(v, plan, v.ndim - 2, keys=True)
    lse: list[torch.Tensor] = []
    out = ring_attention(
        q, k, v, qpos=plan.qz[plan.me], kpos=plan.kz, me=plan.me, devices=plan.devices, comm=plan.comm,
        scale=scale, causal=causal, mask=mask, mask_row_off=plan.mask_row_off, lse_out=lse,
    )  # fmt: skip
    out = _from_heads(_from_ring(out, plan, out.ndim - 2, keys=False), plan, seq=-2, head=-3)
    l_ = _from_heads(_from_ring(lse[0], plan, lse[0].ndim - 1, keys=False), plan, seq=-1, head=-2)
    return out, l_


def ring_backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    dout: torch.Tensor,
    lse: torch.Tensor,
    *,
    plan: _Plan,
    scale: float,
    causal: bool,
    mask: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of blockwise attention over the ring ``plan`` names (a group of one: local blocks only)."""
    n, me, devices = len(plan.devices), plan.me, plan.devices
    nxt, prv = devices[(me + 1) % n], devices[(me - 1) % n]
    qpos = plan.qz[me]
    delta = (dout.float() * out.float()).sum(-1, keepdim=True)
    lse_ = lse.float().unsqueeze(-1)
    lse_ = torch.where(torch.isinf(lse_), torch.full_like(lse_, float("inf")), lse_)  # masked rows: P = 0
    qf, dof = q.float(), dout.float()
    dq = torch.zeros_like(qf)
    kk, vv = k, v
    dk, dv = torch.zeros_like(k, dtype=torch.float32), torch.zeros_like(v, dtype=torch.float32)
    for step in range(n):
        src = (me - step) % n
        kp = plan.kz[src]
        for ks, kl in runs(kp):
            kpr = kp[ks : ks + kl]
            kb, vb = kk.narrow(-2, ks, kl).float(), vv.narrow(-2, ks, kl).float()
            for qs, ql in runs(qpos):
                qpr = qpos[qs : qs + ql]
                cm = causal_mask(qpr, kpr, q.device) if causal else None
                if cm is False:
                    continue
                m = mask_and(cm, mask_block(mask, plan.mask_row_off, qpr, kpr))
                qb, dob = qf.narrow(-2, qs, ql), dof.narrow(-2, qs, ql)
                if local_attention_hooks:
                    observe_local_attention(devices[me], qb, kb, vb)
                s = torch.matmul(qb, kb.transpose(-2, -1)) * scale
                if m is not None:
                    s = s.masked_fill(~m, float("-inf")) if m.dtype == torch.bool else s + m.float()
                p = torch.exp(s - lse_.narrow(-2, qs, ql))
                dv.narrow(-2, ks, kl).add_(torch.matmul(p.transpose(-2, -1), dob))
                ds = p * (torch.matmul(dob, vb.transpose(-2, -1)) - delta.narrow(-2, qs, ql))
                dq.narrow(-2, qs, ql).add_(torch.matmul(ds, kb) * scale)
                dk.narrow(-2, ks, kl).add_(torch.matmul(ds.transpose(-2, -1), qb) * scale)
        if n > 1:  # pass the block on; its accumulators come home after n passes
            last = step == n - 1
            travel = [dk, dv] if last else [kk, vv, dk, dv]
            works = [plan.comm.send(t.contiguous(), nxt, CP_TAG) for t in travel]
            got = [plan.comm.recv(prv, CP_TAG) for _ in travel]
            for w in works:
                w.wait()
            if last:
                dk, dv = got
            else:
                kk, vv, dk, dv = got
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _backward_kernel(call: OpCall, ctx: LocalContext, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    if fused_locally(call):
        return call.op(*args, **kwargs)
    b = _bind(call, args, kwargs)
    dout, q, k, v, out, lse = (b[n] for n in ("grad_out", "query", "key", "value", "out", "logsumexp"))
    mask = b.get("attn_mask")
    causal = bool(b.get("is_causal", False))
    choice = local_choice(call, ctx, b)
    if choice.fused:
        return fused_backward(choice, dout, q, k, v, out, lse, mask, causal=causal, scale=b.get("scale"))
    plan = _plan(call, ctx, q.shape[-3] if q.ndim >= 3 else 1, causal)
    scale = _scale(b, q)
    q, k, v, out, dout = (_to_heads(x, plan, seq=-2, head=-3) for x in (q, k, v, out, dout))
    lse = _to_heads(lse, plan, seq=-1, head=-2)
    q, out, dout = (_to_ring(x, plan, x.ndim - 2, keys=False) for x in (q, out, dout))
    lse = _to_ring(lse, plan, lse.ndim - 1, keys=False)
    k, v = _to_ring(k, plan, k.ndim - 2, keys=True), _to_ring(v, plan, v.ndim - 2, keys=True)
    dq, dk, dv = ring_backward(q, k, v, out, dout, lse, plan=plan, scale=scale, causal=causal, mask=mask)
    dq = _from_heads(_from_ring(dq, plan, dq.ndim - 2, keys=False), plan, seq=-2, head=-3)
    dk = _from_heads(_from_ring(dk, plan, dk.ndim - 2, keys=True), plan, seq=-2, head=-3)
    dv = _from_heads(_from_ring(dv, plan, dv.ndim - 2, keys=True), plan, seq=-2, head=-3)
    return dq, dk, dv


def _cost(call: OpCall) -> OperatorCost:
    q, k, v = (_operand(call, n) for n in ("q", "k", "v"))
    assert q is not None and k is not None and v is not None
    c = sdpa_cost(
        call.inputs, call.out_meta, batch_heads=math.prod(q.shape[:-2]), q_len=q.shape[-2], kv_len=k.shape[-2],
        head_dim=q.shape[-1], v_dim=v.shape[-1], causal=bool(call.arg("is_causal")),
    )  # fmt: skip
    if call.op is ATTENTION_BACKWARD:  # five matmuls per block instead of two
        c = OperatorCost(c.flops * 5 // 2, c.bytes_read, c.bytes_written, c.comm_bytes)
    return c


register_rule(
    ATTENTION_WITH_LSE,
    family="attention",
    check=_check,
    kernel=_forward_kernel,
    cost=_cost,
    as_is=fused_locally,
)(_signatures)
register_rule(
    ATTENTION_BACKWARD,
    family="attention",
    check=_check,
    kernel=_backward_kernel,
    cost=_cost,
    as_is=fused_locally,
)(_signatures)
for _op in (ATTENTION_WITH_LSE, ATTENTION_BACKWARD):
    register_comm_kernel(_op, lambda call: bool(cp_axes(call)))
