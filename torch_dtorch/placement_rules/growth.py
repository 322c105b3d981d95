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

from collections.abc import Sequence

from torch_dtorch.graph.operand import contiguous_strides
from torch_dtorch.mesh import DeviceMesh
from torch_dtorch.placement import Replicate
from torch_dtorch.placement_rules.call import OpCall
from torch_dtorch.placement_rules.matcher import Match

__all__ = ["bucket", "free_decision", "is_contiguous", "stride_class"]


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
