"""Shape-generic decisions: what a rule's decision for a call depends on when an input's length grows.

A decode step at a length never seen before (a KV cache ``cat``, a ``[:, -1:]`` slice of the growing
``input_ids``, SDPA over the grown cache) is the same call as the last step but for a few lengths. A rule that
can say which lengths its decision ignores gives a **growth key** (:meth:`OpRule.growth_key`): every call of the op
with an equal key — together with what the eager fast path adds itself (each input's mesh, placements and dtype,
the constants, the redistribute policy) — gets the same signatures, pinned slots and input checks. The output
metadata of such a call is then worked out by arithmetic (:meth:`OpRule.grown_meta`) instead of a meta-tensor run.

The key alone does not make a decision reusable: the matcher's choice also weighs the bytes each move costs, which
grow with the lengths. :func:`free_decision` admits the decisions that cannot depend on them (the ``cat`` rule's
argument, ``families/cat.py``): on every mesh axis the inputs already are what the chosen signature wants, or get
there by a free move (from Replicate — a local slice or zero-fill — or on an axis of size 1). Then every other
candidate costs zero at every length or more than zero at every length (a move of a non-empty input: emptiness is
in the key, below), and the tie-breaks — signatures that leave ranks empty, moves, Partial outputs, order — see
only the key. Lengths enter keys through :func:`bucket`: ``min(n, max(2, largest mesh axis))`` keeps exactly what
the matcher's empty-shard test (``shape[d] < axis size``) and the emptiness of an input can see.

Uneven shards need nothing more: placements are in the key, local shapes and offsets are recomputed from the
global shape wherever they are used (operands, kernels, redistribute plans), and a decision that would move a
sharded growing dim (slicing it, gathering it) is not free, so it is never reused.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import torch

from torch_dtorch.graph import Operand, TensorMeta
from torch_dtorch.graph.operand import contiguous_strides
from torch_dtorch.mesh import DeviceMesh
from torch_dtorch.placement import Replicate
from torch_dtorch.placement_rules.call import OpCall
from torch_dtorch.placement_rules.matcher import Match
from torch_dtorch.placement_rules.rule import Growth

__all__ = [
    "ELEMENTWISE_GROWTH",
    "LOOKUP_GROWTH",
    "bucket",
    "copy_grown_meta",
    "elementwise_growth_key",
    "elementwise_grown_meta",
    "free_decision",
    "is_contiguous",
    "stride_class",
]


def bucket(n: int, mesh: DeviceMesh) -> int:
    """A length as a decision can see it: exact below ``max(2, largest mesh axis)``, that cap above (see the module
    docstring)."""
    return min(n, max(2, *mesh.shape))


def is_contiguous(shape: Sequence[int], stride: Sequence[int]) -> bool:
    """``stride`` is exactly :func:`contiguous_strides` of ``shape``."""
    return tuple(stride) == contiguous_strides(shape)


def stride_class(shape: Sequence[int], stride: Sequence[int] | None) -> object:
    """A growth key's stand-in for strides that change with the lengths: ``"c"`` for row-major contiguous ones,
    else the strides themselves (such an input is reused only at one stride); ``None`` when unknown."""
    if stride is None:
        return None
    return "c" if is_contiguous(shape, stride) else tuple(stride)


def free_decision(call: OpCall, m: Match) -> bool:
    """On every axis the chosen signature's inputs are the current placements or reached by a free move (from
    Replicate, or on an axis of size 1): the decision does not depend on the inputs' lengths (module docstring)."""
    mesh = call.mesh
    if mesh is None:
        return False
    for pl, tgt in zip(call.placements, m.in_targets, strict=True):
        if pl is None or tgt is None:
            continue
        for a, (src, dst) in enumerate(zip(pl, tgt, strict=True)):
            if src != dst and type(src) is not Replicate and mesh.shape[a] > 1:
                return False
    return True


def _grown_input(x: Operand, mesh: DeviceMesh) -> tuple[Any, ...] | None:
    """An elementwise input's part of a growth key: its shape bucketed when it is row-major contiguous with exactly
    :func:`contiguous_strides`; ``("ones", shape)`` for a one-element tensor of any strides (a ``[:, -1:]`` slice of a
    ``[1, L]`` row is ``[1, 1]`` with stride ``(L, 1)``); ``None`` otherwise (an elementwise output's strides follow
    the inputs' stride order, which would then depend on the lengths)."""
    if x.stride is None:
        return None
    if is_contiguous(x.shape, x.stride):
        return tuple(bucket(n, mesh) for n in x.shape)
    if all(n == 1 for n in x.shape):
        return ("ones", x.shape)
    return None


def elementwise_growth_key(call: OpCall, *, lookup: bool = False) -> Any:
    """The growth key of an elementwise op: each tensor input's shape bucketed (exact below the cap, so sizes 0 and
    1 — broadcasting and empty shards — are exact; in a valid broadcast every other length equals the output's).
    ``lookup``: only input 0 is elementwise (``isin``'s test elements, ``bucketize``'s boundaries are whole lookup
    tables), the other inputs' shapes and strides are exact. ``None`` for a strided input, or a one-element input of
    other strides next to a larger input (then the output's strides follow the inputs' stride order; with every
    input one element, the output is one element, whose strides are all 1)."""
    mesh = call.mesh
    if mesh is None:
        return None
    key: list[Any] = []
    odd_one = larger = False  # a one-element input of other strides; an elementwise input of more elements
    for i, x in enumerate(call.inputs):
        if x is None:
            key.append(None)
        elif lookup and i > 0:
            key.append((x.shape, x.stride))
        else:
            part = _grown_input(x, mesh)
            if part is None:
                return None
            if part and part[0] == "ones":
                odd_one = True
            elif any(n != 1 for n in part):
                larger = True
            key.append(part)
    if odd_one and larger:
        return None
    return tuple(key)


def elementwise_grown_meta(
    call: OpCall, kept: Sequence[TensorMeta], *, lookup: bool = False
) -> list[TensorMeta] | None:
    """The output of a TensorIterator op over contiguous inputs: row-major contiguous strides of the inputs'
    broadcast shape (``lookup``: input 0's shape), the kept dtype — where the kept output had such strides too
    (``None`` otherwise, or when the shapes do not broadcast: the full path raises torch's error)."""
    if len(kept) != 1 or kept[0].stride is None or not is_contiguous(kept[0].shape, kept[0].stride):
        return None
    shapes = [x.shape for x in (call.inputs[:1] if lookup else call.inputs) if x is not None]
    if not shapes:
        return None
    try:
        shape = tuple(torch.broadcast_shapes(*shapes))
    except RuntimeError:
        return None
    return [TensorMeta(shape, kept[0].dtype, contiguous_strides(shape))]


def copy_grown_meta(call: OpCall, kept: Sequence[TensorMeta]) -> list[TensorMeta] | None:
    """A copy (``clone``, ``_to_copy``) of a contiguous input 0 in the preserved memory format keeps the input's
    strides exactly (torch's ``empty_like``; a size-1 dim's stride included); ``memory_format=torch.contiguous_format``
    gives row-major strides. Other formats: ``None``."""
    x = call.inputs[0]
    fmt = call.kwargs.get("memory_format")
    if len(kept) != 1 or x is None or x.stride is None:
        return None
    if fmt is None or fmt == torch.preserve_format:
        return [TensorMeta(x.shape, kept[0].dtype, x.stride)]
    if fmt == torch.contiguous_format:
        return [TensorMeta(x.shape, kept[0].dtype, contiguous_strides(x.shape))]
    return None


#: the growth of elementwise ops (``register_rule(growth=...)``) and of lookups against a whole table
ELEMENTWISE_GROWTH = Growth(elementwise_growth_key, elementwise_grown_meta)
LOOKUP_GROWTH = Growth(
    functools.partial(elementwise_growth_key, lookup=True),
    functools.partial(elementwise_grown_meta, lookup=True),
)
