"""``torch_dtorch.graph.strides``: two tensors of one shape whose strides have the same pattern get the same
result layout from torch's non-view ops (the property the eager fast path's pattern keys rely on), checked on
random gapped layouts against plain torch."""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable

import pytest
import torch

from torch_dtorch.graph.strides import GAPPED, is_dense, stride_key

_OPS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "add": lambda x: x + 1,
    "add_broadcast": lambda x: x + torch.ones(x.shape[-1:]),
    "mul_self": lambda x: x * x,
    "clone": torch.clone,
    "clone_contiguous": lambda x: x.clone(memory_format=torch.contiguous_format),
    "empty_like": torch.empty_like,
    "to_double": lambda x: x.to(torch.float64),
    "neg": torch.neg,
    "sum_last": lambda x: x.sum(-1),
    "sum_first_keepdim": lambda x: x.sum(0, keepdim=True),
    "isin": lambda x: torch.isin(x, torch.tensor([1.0, 2.0])),
    "where": lambda x: torch.where(x > 0, x, 0.0),
    "softmax": lambda x: x.softmax(-1),
}


def _gapped_pair(rng: random.Random, ndim: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Two views of one shape whose strides differ but share a pattern (``None``: the draw gave none)."""
    shape = [rng.choice((1, 2, 3)) for _ in range(ndim)]
    order = list(range(ndim))
    rng.shuffle(order)
    strides = []
    for gap in (rng.randint(1, 3), rng.randint(1, 3) + 7):
        st = [0] * ndim
        step = 1
        for d in order:
            st[d] = step
            step *= shape[d] + (gap if d == order[0] else 0)
        strides.append(st)
    a, b = (torch.randn(4096).as_strided(shape, st) for st in strides)
    if is_dense(a.shape, a.stride()) or stride_key(a.shape, a.stride()) != stride_key(b.shape, b.stride()):
        return None
    return a, b


@pytest.mark.parametrize("name", sorted(_OPS))
def test_same_pattern_same_result_layout(name: str) -> None:
    rng = random.Random(name)
    op = _OPS[name]
    pairs = 0
    for ndim in itertools.islice(itertools.cycle((2, 3, 4)), 120):
        pair = _gapped_pair(rng, ndim)
        if pair is None:
            continue
        a, b = pair
        pairs += 1
        ra, rb = op(a), op(b)
        assert ra.shape == rb.shape and ra.stride() == rb.stride(), (name, a.shape, a.stride(), b.stride())
    assert pairs >= 20


def test_decode_slice_pattern() -> None:
    """``ids[:, -1:]`` of a growing ``[B, L]``: one pattern for every L (the decode case), unlike a dense tensor,
    whose key is its strides."""
    keys = {stride_key((2, 1), torch.zeros(2, n)[:, -1:].stride()) for n in range(2, 40)}
    assert len(keys) == 1 and next(iter(keys))[0] == GAPPED  # type: ignore[index]
    assert stride_key((2, 3), (3, 1)) == (3, 1)
    assert stride_key((2, 3), None) is None
    assert is_dense((2, 3), (1, 2)) and is_dense((2, 1, 3), (3, 7, 1)) and is_dense((0, 5), (9, 9))
    assert not is_dense((2, 1), (5, 1)) and not is_dense((2, 2), (0, 1))
