"""Ring attention kernels of context-parallel SDPA (``context_parallel.py`` selects and orchestrates them).

Every rank keeps its query block; key/value blocks travel around the ring by point-to-point sends (``n - 1`` steps,
the next block's send overlapping this block's compute); each step computes blockwise attention with its
log-sum-exp and merges it online (``out = Σ exp(lse_i - lse) out_i``). Positions are global: causal masking uses
them (blocks split in runs of consecutive positions, fully masked pairs skipped), and :func:`zigzag` gives the
load-balanced causal layout the rows move to before the ring (:func:`relayout`). The backward
(``attention_backward.py``) reuses the positions, layouts and masks.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Literal

import torch

from torch_dtorch.placement import Placements, chunk_size_and_offset, local_shape_and_offset
from torch_dtorch.placement_rules.families.comm import CP_TAG, exchange

__all__ = [
    "BLOCK_STATS",
    "Coord",
    "PosFn",
    "causal_mask",
    "gathered",
    "local_attention_hooks",
    "mask_and",
    "mask_block",
    "observe_local_attention",
    "range_pos",
    "relayout",
    "repeat_heads",
    "ring_attention",
    "runs",
    "with_coord",
    "zigzag",
]

Coord = tuple[int, ...]
PosFn = Callable[[Coord], torch.Tensor]


def range_pos(
    shape: tuple[int, ...], mesh_shape: tuple[int, ...], pl: Placements, dim: int, device: torch.device | None
) -> PosFn:
    def pos(c: Coord) -> torch.Tensor:
        s, o = local_shape_and_offset(shape, mesh_shape, pl, c)
        if not s[dim]:
            return torch.zeros(0, dtype=torch.long, device=device)
        return torch.arange(o[dim], o[dim] + s[dim], device=device)

    return pos


def with_coord(c: Coord, axis: int, i: int) -> Coord:
    return (*c[:axis], i, *c[axis + 1 :])


def gathered(pos: PosFn, axis: int, n: int) -> PosFn:
    """Positions after a Ulysses exchange over ``axis``: the rows of every member, in member order."""
    return lambda c: torch.cat([pos(with_coord(c, axis, i)) for i in range(n)])


def relayout(
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


def zigzag(pos: Sequence[torch.Tensor]) -> list[torch.Tensor]:
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


def causal_mask(
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


def repeat_heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    h = x.shape[-3]
    if h == heads:
        return x
    if h == 1:
        return x.expand(*x.shape[:-3], heads, *x.shape[-2:])
    return x.repeat_interleave(heads // h, dim=-3)


def mask_block(
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


def mask_and(causal: torch.Tensor | None, explicit: torch.Tensor | None) -> torch.Tensor | None:
    if causal is None:
        return explicit
    if explicit is None:
        return causal
    if explicit.dtype == torch.bool:
        return explicit & causal
    return explicit.masked_fill(~causal, float("-inf"))


def runs(pos: torch.Tensor) -> list[tuple[int, int]]:
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


def ring_attention(
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
    lse_out: list[torch.Tensor] | None = None,
) -> torch.Tensor:
    """Ring attention over ``devices`` (a group of one: plain blockwise attention on the local rows).

    Blocks are split into runs of consecutive positions, so a causal zig-zag block computes only its visible
    (query run, key run) pairs: fully masked pairs are skipped, fully visible ones need no mask. ``lse_out``: a list
    that receives the rows' float32 log-sum-exp ``[..., L]`` (``-inf`` for a row that sees no key)."""
    n = len(devices)
    nxt, prv = devices[(me + 1) % n], devices[(me - 1) % n]
    qruns = runs(qpos)
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
            kk, vv = repeat_heads(kk, heads), repeat_heads(vv, heads)
        kp = kpos[src]
        for ks, kl in runs(kp):
            kpr = kp[ks : ks + kl]
            kb, vb = kk.narrow(-2, ks, kl), vv.narrow(-2, ks, kl)
            for i, (qs, ql) in enumerate(qruns):
                qpr = qpos[qs : qs + ql]
                cm = causal_mask(qpr, kpr, q.device) if causal else None
                if cm is False:
                    continue
                m = mask_and(cm, mask_block(mask, mask_row_off, qpr, kpr))
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
    parts, lses = [], []
    for (_, ql), acc in zip(qruns, accs, strict=True):
        if acc is None:
            parts.append(torch.zeros(*lead, ql, v.shape[-1], dtype=q.dtype, device=q.device))
            lses.append(torch.full((*lead, ql), float("-inf"), device=q.device))
        else:
            parts.append(acc[0].to(q.dtype))
            lses.append(acc[1].squeeze(-1).expand(*lead, ql))
    if lse_out is not None:
        lse_out.append(torch.cat(lses, dim=-1) if lses else torch.zeros(*lead, 0, device=q.device))
    if not parts:
        return torch.zeros(*lead, 0, v.shape[-1], dtype=q.dtype, device=q.device)
    return torch.cat(parts, dim=-2)
