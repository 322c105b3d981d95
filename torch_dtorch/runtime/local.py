"""One rank's local kernel: :func:`~torch_dtorch.placement_rules.simulate.run_rank` with the per-op overhead cut.

The worker runs every eager op through here, so the Python cost per call matters (it shares the GIL with the
controller in thread mode): local shapes are cached per (shape, mesh, placements, coordinate) and operands are
swapped for shards without a pytree walk when the arguments are flat. The rule hooks called and their arguments are
exactly ``run_rank``'s, so results are identical.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cache, lru_cache
from typing import Any

import torch

from torch_dtorch.graph import Operand
from torch_dtorch.placement import Placements, local_shape_and_offset
from torch_dtorch.placement_rules.call import LocalContext, map_operands

__all__ = ["local_shape", "run_local"]


@lru_cache(maxsize=65536)
def _local_shape_and_offset(
    shape: tuple[int, ...], mesh_shape: tuple[int, ...], placements: Placements, coord: tuple[int, ...]
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    local, offset = local_shape_and_offset(shape, mesh_shape, placements, coord)
    return tuple(local), tuple(offset)


def local_shape(
    shape: tuple[int, ...], mesh_shape: tuple[int, ...], placements: Placements, coord: tuple[int, ...]
) -> tuple[int, ...]:
    return _local_shape_and_offset(shape, mesh_shape, placements, coord)[0]


def run_local(
    rule: Any,
    call: Any,
    coordinate: tuple[int, ...],
    mesh_shape: tuple[int, ...],
    local: Sequence[torch.Tensor | None],
    placements_out: Sequence[Placements],
    *,
    device: int,
    torch_device: torch.device | None = None,
) -> list[torch.Tensor]:
    """:func:`~torch_dtorch.placement_rules.simulate.run_rank` with the per-op overhead cut: the same
    ``LocalContext``, ``localize`` and ``kernel`` calls, with cached local shapes and a flat operand substitution
    (nested argument structures fall back to ``run_rank``'s pytree map).

    ``torch_device`` (non-CPU workers): rules drop the global ``device=`` of factories so that they run on the
    rank's default device, but aten overloads ignore ``torch.set_default_device``; ops whose schema takes a
    ``device`` get it explicitly."""
    outs = [
        _local_shape_and_offset(m.shape, mesh_shape, pl, coordinate)
        for m, pl in zip(call.out_meta, placements_out)
    ]
    ctx = LocalContext(
        device=device,
        coordinate=coordinate,
        in_shapes=[tuple(t.shape) if t is not None else None for t in local],
        out_shapes=[shape for shape, _ in outs],
        out_offsets=[offset for _, offset in outs],
    )
    by_operand = {id(x): t for x, t in zip(call.inputs, local, strict=True) if x is not None}
    args, kwargs = rule.localize(call, ctx)
    try:
        args = tuple(_swap(a, by_operand) for a in args)
        kwargs = {k: _swap(v, by_operand) for k, v in kwargs.items()} if kwargs else kwargs
    except _Nested:
        args, kwargs = map_operands((args, kwargs), lambda o: by_operand[id(o)])
    if torch_device is not None and kwargs.get("device") is None and _takes_device(call.op):
        kwargs = {**kwargs, "device": torch_device}
    out = rule.kernel(call, ctx, args, kwargs)
    return list(out) if isinstance(out, (list, tuple)) else [out]


@cache
def _takes_device(op: Any) -> bool:
    schema = getattr(op, "_schema", None)
    return schema is not None and any(a.name == "device" and a.kwarg_only for a in schema.arguments)


class _Nested(Exception):
    pass


def _swap(a: Any, by_operand: dict[int, torch.Tensor | None]) -> Any:
    t = type(a)
    if t is Operand:
        return by_operand[id(a)]
    if t is list or t is tuple:
        if any(type(v) is Operand for v in a):
            if any(type(v) in (list, tuple, dict) for v in a):
                raise _Nested
            return t(by_operand[id(v)] if type(v) is Operand else v for v in a)
        if any(type(v) in (list, tuple, dict) for v in a):
            raise _Nested
        return a
    if t is dict:
        raise _Nested
    return a
