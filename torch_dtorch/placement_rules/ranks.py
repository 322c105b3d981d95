"""Plain-torch simulation of distributed layouts: split a global tensor into per-rank shards, assemble it back, and
run one op's local kernels on shards. Used by the rule and planner tests, the demo, and as the reference the runtime
is checked against. Ranks are mesh coordinates; nothing here talks to a worker.

Kernels that communicate (``context_parallel.kernel_needs_comm``: p-norms and ``prod`` over a sharded dim, ring
attention) run in :func:`run_all_ranks` with every rank on its own thread and a :class:`SimComm` for point-to-point
messages between them; :func:`run_rank` alone gives them no communicator.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import cache, lru_cache
from itertools import product
from typing import Any

import torch

from torch_dtorch.graph import Operand, TensorMeta
from torch_dtorch.placement import (
    Partial,
    Placement,
    Placements,
    Shard,
    chunk_size_and_offset,
    local_shape_and_offset,
)
from torch_dtorch.placement_rules.call import LocalContext, OpCall, map_operands
from torch_dtorch.placement_rules.families.context_parallel import kernel_needs_comm

__all__ = [
    "SimComm",
    "Shards",
    "assemble",
    "coords",
    "distribute",
    "operand_for",
    "partial_split",
    "run_all_ranks",
    "run_rank",
]

Coord = tuple[int, ...]
Shards = dict[Coord, torch.Tensor]


def coords(mesh_shape: Sequence[int]) -> list[Coord]:
    return list(product(*(range(s) for s in mesh_shape)))


def partial_split(t: torch.Tensor, n: int, reduce_op: str, gen: torch.Generator | None) -> list[torch.Tensor]:
    """``n`` tensors whose reduction with ``reduce_op`` is ``t`` (random when ``gen`` is given, else trivial)."""
    if n == 1:
        return [t.clone()]
    if reduce_op in ("sum", "avg"):
        if gen is None or not t.is_floating_point():
            zero = torch.zeros_like(t)
            first = t * n if reduce_op == "avg" else t
            return [first.clone()] + [zero.clone() for _ in range(n - 1)]
        parts = [torch.randn(t.shape, generator=gen, dtype=t.dtype) for _ in range(n - 1)]
        rest = t * (n if reduce_op == "avg" else 1) - sum(parts)
        return [*parts, rest]
    if reduce_op in ("max", "min"):
        if gen is None or not t.is_floating_point():
            return [t.clone() for _ in range(n)]
        sign = -1.0 if reduce_op == "max" else 1.0
        parts = [t + sign * torch.rand(t.shape, generator=gen, dtype=t.dtype) for _ in range(n)]
        parts[int(torch.randint(n, (1,), generator=gen))] = t.clone()
        return parts
    raise ValueError(f"unsupported Partial reduce op {reduce_op!r}")


def distribute(
    t: torch.Tensor,
    mesh_shape: Sequence[int],
    placements: Sequence[Placement],
    *,
    gen: torch.Generator | None = None,
) -> Shards:
    """Split ``t`` over a mesh: Shard chunks (nested from the first axis), Replicate copies, Partial splits."""
    # Replicas must be identical: a Partial split below a Replicate axis is drawn once per distinct key
    # (the coordinate without its Replicate axes) and shared by every replica.
    out: dict[Coord, tuple[Coord, torch.Tensor]] = {(): ((), t)}
    for size, p in zip(mesh_shape, placements, strict=True):
        nxt: dict[Coord, tuple[Coord, torch.Tensor]] = {}
        splits: dict[Coord, list[torch.Tensor]] = {}
        for c, (key, local) in out.items():
            if type(p) is Shard:
                for i in range(size):
                    length, start = chunk_size_and_offset(local.shape[p.dim], size, i)
                    nxt[(*c, i)] = ((*key, i), local.narrow(p.dim, start, length).clone())
            elif isinstance(p, Partial):
                if key not in splits:
                    splits[key] = partial_split(local, size, p.reduce_op, gen)
                for i, part in enumerate(splits[key]):
                    nxt[(*c, i)] = ((*key, i), part.clone())
            else:
                for i in range(size):
                    nxt[(*c, i)] = (key, local.clone())
        out = nxt
    return {c: v for c, (_, v) in out.items()}


def reduce_tensors(parts: Sequence[torch.Tensor], reduce_op: str) -> torch.Tensor:
    """Reduce equally shaped tensors stacked in rank order (``avg`` = sum / n, floor division for integers).

    The one reduction kernel of the project: the planner's simulator and the in-memory collectives both use it, so
    the runtime and its reference agree bit for bit (for 5+ float parts torch's stacked sum is not a left-to-right
    sum, but it is deterministic)."""
    shapes = {tuple(p.shape) for p in parts}
    if len(shapes) != 1:
        raise ValueError(f"reduce over tensors of different shapes {sorted(shapes)}")
    stacked = torch.stack(list(parts))
    if reduce_op == "sum":
        return stacked.sum(0)
    if reduce_op == "avg":
        total = stacked.sum(0)
        return total / len(parts) if total.is_floating_point() else total // len(parts)
    if reduce_op == "max":
        return stacked.amax(0)
    if reduce_op == "min":
        return stacked.amin(0)
    raise ValueError(f"unsupported reduce op {reduce_op!r}")


def _same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise-equal values, NaN matching NaN (``torch.equal`` calls two NaN replicas different)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if torch.equal(a, b):
        return True
    if not (a.is_floating_point() or a.is_complex()):
        return False
    return bool(((a == b) | (torch.isnan(a) & torch.isnan(b))).all())


def assemble(
    shards: Shards, mesh_shape: Sequence[int], placements: Sequence[Placement], *, check_replicas: bool = True
) -> torch.Tensor:
    """Inverse of :func:`distribute`: concatenate shards, reduce partials, and (optionally) check that replicas agree."""
    cur: Shards = dict(shards)
    for axis in reversed(range(len(mesh_shape))):
        p = placements[axis]
        nxt: Shards = {}
        for c in coords(mesh_shape[:axis]):
            group = [cur[(*c, i)] for i in range(mesh_shape[axis])]
            if type(p) is Shard:
                nxt[c] = torch.cat(group, dim=p.dim)
            elif isinstance(p, Partial):
                nxt[c] = reduce_tensors(group, p.reduce_op)
            else:
                if check_replicas:
                    for i, g in enumerate(group[1:], 1):
                        if not _same_values(g, group[0]):
                            raise AssertionError(
                                f"replicas differ on mesh axis {axis} at {(*c, i)} vs {(*c, 0)}"
                            )
                nxt[c] = group[0]
        cur = nxt
    return cur[()]


@lru_cache(maxsize=65536)
def cached_local_shape_and_offset(
    shape: tuple[int, ...], mesh_shape: tuple[int, ...], placements: Placements, coord: tuple[int, ...]
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    return local_shape_and_offset(shape, mesh_shape, placements, coord)


@cache
def takes_device(op: Any) -> bool:
    schema = getattr(op, "_schema", None)
    return schema is not None and any(a.name == "device" and a.kwarg_only for a in schema.arguments)


class _Nested(Exception):
    pass


def _swap(a: Any, by_operand: dict[int, torch.Tensor | None]) -> Any:
    """Operands of a flat argument replaced by shards (raises ``_Nested`` for deeper structures)."""
    t = type(a)
    if t is Operand:
        return by_operand[id(a)]
    if t is list or t is tuple:
        if any(type(v) in (list, tuple, dict) for v in a):
            raise _Nested
        if any(type(v) is Operand for v in a):
            return t(by_operand[id(v)] if type(v) is Operand else v for v in a)
        return a
    if t is dict:
        raise _Nested
    return a


def local_context(
    call: OpCall,
    coordinate: Coord,
    mesh_shape: Sequence[int],
    in_shapes: list[tuple[int, ...] | None],
    placements_out: Sequence[Placements],
    *,
    device: int = -1,
    torch_device: torch.device | None = None,
    comm: Any = None,
    seq: int | None = None,
) -> LocalContext:
    """What ``OpRule.localize`` and the rule's kernel know about one rank of ``call`` (see :func:`run_rank`)."""
    mesh_shape = tuple(mesh_shape)
    outs = [
        cached_local_shape_and_offset(tuple(m.shape), mesh_shape, tuple(pl), tuple(coordinate))
        for m, pl in zip(call.out_meta, placements_out)
    ]
    return LocalContext(
        device=device,
        coordinate=coordinate,
        in_shapes=in_shapes,
        out_shapes=[shape for shape, _ in outs],
        out_offsets=[offset for _, offset in outs],
        comm=comm,
        seq=seq,
        torch_device=torch_device,
    )


def run_rank(
    rule: Any,
    call: OpCall,
    coordinate: Coord,
    mesh_shape: Sequence[int],
    local: Sequence[torch.Tensor | None],
    placements_out: Sequence[Placements],
    *,
    device: int = -1,
    torch_device: torch.device | None = None,
    comm: Any = None,
    seq: int | None = None,
) -> list[torch.Tensor]:
    """One rank's local kernel: localize the call for this rank, substitute its shards, run the rule's kernel.

    ``local`` holds this rank's shard of every tensor slot of ``call`` (``None`` for absent optional slots). The
    workers run every eager op through here, so it avoids per-call overhead (cached local shapes, a flat operand
    swap). ``torch_device`` (non-CPU workers): rules drop the global ``device=`` of factories and workers set no
    default device, so ops whose schema takes a ``device`` get the rank's explicitly, and rule kernels find it in
    ``LocalContext.torch_device``. ``comm`` (workers): the rank's communicator, for kernels that communicate
    (``LocalContext.comm``), ``seq`` the call's number (``LocalContext.seq``)."""
    ctx = local_context(
        call,
        coordinate,
        mesh_shape,
        [tuple(t.shape) if t is not None else None for t in local],
        placements_out,
        device=device,
        torch_device=torch_device,
        comm=comm,
        seq=seq,
    )
    by_operand = {id(x): t for x, t in zip(call.inputs, local, strict=True) if x is not None}
    args, kwargs = rule.localize(call, ctx)
    try:
        args = tuple(_swap(a, by_operand) for a in args)
        kwargs = {k: _swap(v, by_operand) for k, v in kwargs.items()} if kwargs else kwargs
    except _Nested:
        args, kwargs = map_operands((args, kwargs), lambda o: by_operand[id(o)])
    if torch_device is not None and kwargs.get("device") is None and takes_device(call.op):
        kwargs = {**kwargs, "device": torch_device}
    out = rule.kernel(call, ctx, args, kwargs)
    return list(out) if isinstance(out, (list, tuple)) else [out]


def run_all_ranks(
    rule: Any,
    call: OpCall,
    placements_out: Sequence[Placements],
    local_inputs: dict[Coord, list[torch.Tensor | None]],
    mesh_shape: Sequence[int],
) -> dict[Coord, list[torch.Tensor]]:
    """Run ``call.op`` on every rank's shards with the rule's localized arguments; outputs per rank.

    A kernel that communicates (``kernel_needs_comm(call)``) runs every rank on its own thread, each with a
    :class:`SimComm` named by the rank's device id in ``call.mesh``."""
    if call.mesh is None or len(local_inputs) < 2 or not kernel_needs_comm(call):
        return {
            c: run_rank(rule, call, c, mesh_shape, tensors, placements_out)
            for c, tensors in local_inputs.items()
        }
    mesh = call.mesh
    box = _Mailbox()

    def one(c: Coord, tensors: list[torch.Tensor | None]) -> list[torch.Tensor]:
        device = int(mesh.mesh[c])
        try:
            return run_rank(
                rule, call, c, mesh_shape, tensors, placements_out, device=device, comm=SimComm(device, box)
            )
        except BaseException:
            box.abort()  # peers waiting for this rank's messages raise instead of hanging
            raise

    with ThreadPoolExecutor(max_workers=len(local_inputs)) as pool:
        futures = {c: pool.submit(one, c, tensors) for c, tensors in local_inputs.items()}
        return {c: f.result() for c, f in futures.items()}


class _Mailbox:
    """Messages in flight between simulated ranks, FIFO per (source, destination, tag)."""

    def __init__(self, timeout_s: float = 60.0) -> None:
        self.queues: dict[tuple[int, int, int], collections.deque[torch.Tensor]] = collections.defaultdict(
            collections.deque
        )
        self.cond = threading.Condition()
        self.aborted = False
        self.timeout_s = timeout_s

    def put(self, key: tuple[int, int, int], t: torch.Tensor) -> None:
        with self.cond:
            self.queues[key].append(t)
            self.cond.notify_all()

    def take(self, key: tuple[int, int, int]) -> torch.Tensor:
        with self.cond:
            if not self.cond.wait_for(lambda: self.aborted or self.queues[key], self.timeout_s):
                raise RuntimeError(f"simulated recv {key[0]} -> {key[1]} (tag {key[2]}): nothing arrived")
            if not self.queues[key]:
                raise RuntimeError(f"simulated recv {key[0]} -> {key[1]}: a peer rank failed")
            return self.queues[key].popleft()

    def abort(self) -> None:
        with self.cond:
            self.aborted = True
            self.cond.notify_all()


class SimComm:
    """One simulated rank's communicator (the ``send``/``recv`` part of ``collectives.group.Comm``)."""

    def __init__(self, device: int, box: _Mailbox) -> None:
        self.device = device
        self._box = box

    def send(self, t: torch.Tensor, dst: int, tag: int = 0) -> SimComm:
        """Buffer a copy of ``t`` for ``dst``; the returned handle's ``wait()`` returns at once."""
        self._box.put((self.device, dst, tag), t.clone())
        return self

    def wait(self) -> None:
        pass

    def recv(self, src: int, tag: int = 0) -> torch.Tensor:
        return self._box.take((src, self.device, tag))


def operand_for(t: torch.Tensor, mesh: Any, placements: Placements, ident: int = 0) -> Operand:
    """A free-standing operand describing ``t`` distributed with ``placements`` (for tests and the demo)."""
    meta = TensorMeta.of(t)
    return Operand(ident, meta.shape, meta.dtype, mesh, tuple(placements), stride=meta.stride)
