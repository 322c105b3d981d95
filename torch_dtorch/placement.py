"""Placements (reused from ``torch.distributed.tensor``) and the local shape / offset arithmetic.

Shards follow ``torch.chunk`` (and DTensor): a dim of size ``n`` split ``k`` ways gives every rank ``ceil(n / k)``
elements except at the end, where shards may be smaller or empty. When several mesh axes shard the same tensor dim,
they nest from the first axis to the last: axis 0 splits the dim, axis 1 splits axis 0's chunk, and so on.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from torch.distributed.tensor import Partial, Placement, Replicate, Shard

from torch_dtorch.errors import PlacementError

#: the ``Partial`` reduce ops a linear map commutes with: ``f(a) + f(b) == f(a + b)`` (and the mean likewise), so a
#: linear op may take such a ``Partial`` input and give the same ``Partial`` output
LINEAR_REDUCE_OPS = ("sum", "avg")

__all__ = [
    "PARTIAL_OPS",
    "Partial",
    "Placement",
    "Placements",
    "Replicate",
    "Shard",
    "chunk_size_and_offset",
    "is_partial",
    "is_replicate",
    "is_shard",
    "local_shape",
    "local_shape_and_offset",
    "normalize_placements",
    "parse_placements",
    "placement_str",
    "placements_str",
    "shard_dims",
]

Placements = tuple[Placement, ...]

#: reduce ops a ``Partial`` may carry (``avg`` is a sum scaled by 1/size, ``max``/``min`` reduce elementwise).
PARTIAL_OPS = ("sum", "avg", "max", "min")

_REPLICATE = Replicate()


def is_shard(p: Placement, dim: int | None = None) -> bool:
    return type(p) is Shard and (dim is None or p.dim == dim)


def is_replicate(p: Placement) -> bool:
    return type(p) is Replicate


def is_partial(p: Placement) -> bool:
    return isinstance(p, Partial)


def placement_str(p: Placement) -> str:
    """Short form used by the graph printer: ``S(0)``, ``R``, ``P(sum)``."""
    if type(p) is Shard:
        return f"S({p.dim})"
    if type(p) is Replicate:
        return "R"
    if isinstance(p, Partial):
        return f"P({p.reduce_op})"
    return str(p)


def placements_str(placements: Iterable[Placement]) -> str:
    """Placements of every mesh axis, concatenated: ``S(0)R``, ``RS(1)``, ``P(sum)S(0)``."""
    return "".join(placement_str(p) for p in placements)


def parse_placements(text: str) -> Placements:
    """Inverse of :func:`placements_str` (for tests and docs): ``"S(0)RP(sum)"`` -> ``(Shard(0), Replicate(), Partial())``."""
    out: list[Placement] = []
    i = 0
    while i < len(text):
        if text[i] == "R":
            out.append(Replicate())
            i += 1
        elif text[i] in "SP" and text[i + 1 : i + 2] == "(":
            end = text.index(")", i)
            arg = text[i + 2 : end]
            out.append(Shard(int(arg)) if text[i] == "S" else Partial(arg))
            i = end + 1
        else:
            raise PlacementError(f"cannot parse placements {text!r} at position {i}")
    return tuple(out)


def normalize_placements(
    placements: Sequence[Placement] | Placement,
    *,
    ndim: int,
    mesh_ndim: int,
    what: str = "tensor",
) -> Placements:
    """Validate placements against a tensor rank and a mesh rank; negative shard dims become positive.

    Raises :class:`PlacementError` naming the offending placement and the fix.
    """
    if isinstance(placements, Placement):
        placements = (placements,)
    placements = tuple(placements)
    if len(placements) != mesh_ndim:
        raise PlacementError(
            f"{what}: got {len(placements)} placement(s) {placements_str(placements) or '()'} for a mesh with "
            f"{mesh_ndim} axis/axes; give exactly one placement per mesh axis "
            f"(e.g. {tuple([Replicate()] * mesh_ndim)})."
        )
    out: list[Placement] = []
    for axis, p in enumerate(placements):
        if type(p) is Shard:
            d = p.dim
            if not -ndim <= d < ndim or ndim == 0:
                raise PlacementError(
                    f"{what}: Shard({d}) on mesh axis {axis} is out of range for a {ndim}-d tensor; "
                    f"shard a dim in [{-ndim}, {ndim - 1}] or use Replicate()."
                )
            out.append(Shard(d % ndim) if d < 0 else p)
        elif type(p) is Replicate:
            out.append(_REPLICATE)
        elif type(p) is Partial:
            if p.reduce_op not in PARTIAL_OPS:
                raise PlacementError(
                    f"{what}: Partial({p.reduce_op!r}) on mesh axis {axis} is not supported; "
                    f"use one of {PARTIAL_OPS}."
                )
            out.append(p)
        else:
            raise PlacementError(
                f"{what}: placement {p!r} on mesh axis {axis} is not a Shard, Replicate or Partial "
                "(torch.distributed.tensor placements)."
            )
    return tuple(out)


def chunk_size_and_offset(size: int, num_chunks: int, index: int) -> tuple[int, int]:
    """Size and start of chunk ``index`` when ``size`` is split ``num_chunks`` ways (torch.chunk rule)."""
    full = -(-size // num_chunks) if size else 0
    start = min(full * index, size)
    end = min(full * (index + 1), size)
    return end - start, start


def shard_dims(placements: Sequence[Placement]) -> set[int]:
    return {p.dim for p in placements if type(p) is Shard}


def local_shape_and_offset(
    global_shape: Sequence[int],
    mesh_shape: Sequence[int],
    placements: Sequence[Placement],
    coordinate: Sequence[int],
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Local shape and global offset of the shard held at ``coordinate`` of a mesh of ``mesh_shape``."""
    shape = list(global_shape)
    offset = [0] * len(shape)
    for axis, p in enumerate(placements):
        if type(p) is Shard:
            size, start = chunk_size_and_offset(shape[p.dim], mesh_shape[axis], coordinate[axis])
            shape[p.dim] = size
            offset[p.dim] += start
    # like DTensor: an empty shard's offset is the end of the global dim
    for d, size in enumerate(shape):
        if size == 0:
            offset[d] = global_shape[d]
    return tuple(shape), tuple(offset)


def local_shape(
    global_shape: Sequence[int],
    mesh_shape: Sequence[int],
    placements: Sequence[Placement],
    coordinate: Sequence[int],
) -> tuple[int, ...]:
    return local_shape_and_offset(global_shape, mesh_shape, placements, coordinate)[0]
