"""Plain-torch results of each collective from the list of every rank's input (rank order).

These functions define what the in-memory group delivers; they compute exactly what
:mod:`torch_dtorch.placement_rules.redistribute.simulate` computes (same kernels in the same order), so runtime shards equal the
simulated ones bit for bit. Every returned tensor is new: no result aliases an input or another result.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from torch_dtorch.collectives.errors import CollectiveMismatchError
from torch_dtorch.collectives.group import check_reduce_op
from torch_dtorch.placement import chunk_size_and_offset
from torch_dtorch.placement_rules.ranks import reduce_tensors as _reduce_tensors

__all__ = [
    "all_gather_results",
    "all_reduce_results",
    "all_to_all_results",
    "broadcast_results",
    "chunk",
    "normalize_dim",
    "reduce_scatter_results",
    "reduce_tensors",
]


def normalize_dim(dim: int, ndim: int, what: str) -> int:
    if not -ndim <= dim < ndim:
        raise IndexError(f"{what}: dim {dim} is out of range for a {ndim}-d tensor")
    return dim % ndim


def chunk(t: torch.Tensor, dim: int, num_chunks: int, index: int) -> torch.Tensor:
    """Chunk ``index`` of ``t`` split ``num_chunks`` ways along ``dim`` (``torch.chunk`` rule, empty chunks kept);
    a view of ``t``."""
    size, start = chunk_size_and_offset(t.shape[dim], num_chunks, index)
    return t.narrow(dim, start, size)


def reduce_tensors(parts: Sequence[torch.Tensor], op: str) -> torch.Tensor:
    """The simulator's reduction (one kernel for runtime and reference: bit-identical), with the op checked."""
    check_reduce_op(op)
    return _reduce_tensors(parts, op)


def _check_dtypes(what: str, inputs: Sequence[torch.Tensor]) -> None:
    dtype = inputs[0].dtype
    if any(t.dtype != dtype for t in inputs):
        raise CollectiveMismatchError(f"{what}: ranks passed different dtypes {[t.dtype for t in inputs]}")


def _check_same_shape(what: str, inputs: Sequence[torch.Tensor]) -> None:
    _check_dtypes(what, inputs)
    shape = inputs[0].shape
    if any(t.shape != shape for t in inputs):
        raise CollectiveMismatchError(
            f"{what}: ranks passed different shapes {[tuple(t.shape) for t in inputs]}; they must be equal"
        )


def _on(inputs: Sequence[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """``inputs`` moved to ``device`` where needed (virtual ranks on one device: no copy)."""
    if all(t.device == device for t in inputs):
        return list(inputs)
    return [t if t.device == device else t.to(device) for t in inputs]


def _fan_out(value: torch.Tensor, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """One independent copy of ``value`` per rank, on that rank's input device (``value`` itself goes to the
    first rank on its device)."""
    device = value.device
    out: list[torch.Tensor] = []
    used = False
    for t in inputs:
        if t.device != device:
            out.append(value.to(t.device))
        elif used:
            out.append(value.clone())
        else:
            out.append(value)
            used = True
    return out


def all_gather_results(
    inputs: Sequence[torch.Tensor], dim: int, sizes: Sequence[int] | None = None
) -> list[torch.Tensor]:
    what = f"all_gather(dim={dim})"
    _check_dtypes(what, inputs)
    shape = inputs[0].shape
    ndim = len(shape)
    if any(t.ndim != ndim or any(s != shape[d] for d, s in enumerate(t.shape) if d != dim) for t in inputs):
        raise CollectiveMismatchError(
            f"{what}: rank tensors differ outside dim {dim}: {[tuple(t.shape) for t in inputs]}"
        )
    if sizes is not None and list(sizes) != [t.shape[dim] for t in inputs]:
        raise CollectiveMismatchError(
            f"{what}: sizes {list(sizes)} given, but the ranks hold {[t.shape[dim] for t in inputs]} along dim {dim}"
        )
    full = torch.cat(_on(inputs, inputs[0].device), dim=dim)
    return _fan_out(full, inputs)


def all_reduce_results(inputs: Sequence[torch.Tensor], op: str) -> list[torch.Tensor]:
    _check_same_shape(f"all_reduce(op={op})", inputs)
    return _fan_out(reduce_tensors(_on(inputs, inputs[0].device), op), inputs)


def reduce_scatter_results(inputs: Sequence[torch.Tensor], op: str, dim: int) -> list[torch.Tensor]:
    _check_same_shape(f"reduce_scatter(op={op}, dim={dim})", inputs)
    n = len(inputs)
    parts = _on(inputs, inputs[0].device)
    out = [reduce_tensors([chunk(t, dim, n, m) for t in parts], op) for m in range(n)]
    return [r if r.device == t.device else r.to(t.device) for r, t in zip(out, inputs)]


def all_to_all_results(inputs: Sequence[torch.Tensor], src_dim: int, dst_dim: int) -> list[torch.Tensor]:
    what = f"all_to_all({src_dim}->{dst_dim})"
    _check_dtypes(what, inputs)
    if len({t.ndim for t in inputs}) != 1:
        raise CollectiveMismatchError(f"{what}: ranks passed tensors of different ranks")
    sizes = {t.shape[dst_dim] for t in inputs}
    if len(sizes) != 1:
        raise CollectiveMismatchError(f"{what}: ranks disagree on the size of dim {dst_dim}: {sorted(sizes)}")
    n = len(inputs)
    out = []
    for m, dst in enumerate(inputs):
        pieces = [chunk(t, dst_dim, n, m) for t in inputs]
        out.append(torch.cat(_on(pieces, dst.device), dim=src_dim))
    return out


def broadcast_results(inputs: Sequence[torch.Tensor | None], src: int) -> list[torch.Tensor]:
    value = inputs[src]
    if value is None:
        raise CollectiveMismatchError(f"broadcast(src={src}): the source rank passed no tensor")
    out: list[torch.Tensor] = []
    for t in inputs:
        device = value.device if t is None else t.device
        out.append(value.clone() if device == value.device else value.to(device))
    return out
