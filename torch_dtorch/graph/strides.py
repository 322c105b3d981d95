"""Stride patterns: what of a tensor's strides a non-view op's result can depend on.

A slice such as ``ids[:, -1:]`` of a ``[B, L]`` tensor is ``[B, 1]`` with strides ``(L, 1)``: its strides change
every decoded token although nothing an elementwise op, a clone or a reduction computes from them does. Torch
derives a fresh (non-view) result's layout from its inputs' strides only through comparisons — TensorIterator's
dimension order (``stride_i < stride_j``, ties broken by size), contiguity and density checks (``stride_i ==
stride_j * size_j``, ``stride == 1``), the channels-last tests (``stride_i < stride_j * size_j``) — never from their
values. :func:`stride_key` keeps exactly those comparisons for a tensor whose strides leave gaps (not
non-overlapping-and-dense) and the strides themselves otherwise (a dense tensor's strides follow from its shape and
dimension order, so nothing is lost by keeping them). A view's result does carry its input's stride values, so a
cache keyed by :func:`stride_key` must not replay a view of a gapped input (the eager fast path's guard).
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["GAPPED", "is_dense", "stride_key"]

#: the tag of a gapped stride pattern's key
GAPPED = "gapped"


def is_dense(shape: Sequence[int], stride: Sequence[int]) -> bool:
    """Whether a tensor of ``shape`` and ``stride`` is non-overlapping and dense (torch's
    ``is_non_overlapping_and_dense``: its elements fill one block of memory, in some dimension order). Tensors with
    no elements count as dense (their strides are kept as they are)."""
    if 0 in shape:
        return True
    dims = sorted((i for i, n in enumerate(shape) if n != 1), key=lambda i: (stride[i], shape[i]))
    expected = 1
    for i in dims:
        if stride[i] != expected:
            return False
        expected *= shape[i]
    return True


def _cmp(a: int, b: int) -> int:
    return (a > b) - (a < b)


def stride_key(shape: Sequence[int], stride: Sequence[int] | None) -> tuple[object, ...] | None:
    """A hashable stand-in for ``stride`` that is equal for two tensors of ``shape`` exactly when every non-view
    op's result has the same layout for both (see the module docstring): the strides themselves for a dense tensor
    (or ``None`` when unknown), else ``(GAPPED, comparisons)`` with, for every pair of dims ``i, j``, the signs of
    ``stride_i - stride_j`` and ``stride_i - stride_j * size_j``, and of ``stride_i - 1``."""
    if stride is None:
        return None
    st = tuple(stride)
    if is_dense(shape, st):
        return st
    n = len(st)
    signs = tuple(
        (_cmp(st[i], st[j]), _cmp(st[i], st[j] * shape[j])) for i in range(n) for j in range(n)
    ) + tuple(_cmp(s, 1) for s in st)
    return (GAPPED, signs)
