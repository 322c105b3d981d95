from __future__ import annotations

import pytest
import torch

from torch_dtorch.errors import PlacementError
from torch_dtorch.placement import (
    Partial,
    Replicate,
    Shard,
    chunk_size_and_offset,
    local_shape_and_offset,
    normalize_placements,
    parse_placements,
    placements_str,
)


def test_short_strings_roundtrip() -> None:
    pl = (Shard(0), Replicate(), Partial("max"))
    assert placements_str(pl) == "S(0)RP(max)"
    assert parse_placements("S(0)RP(max)") == pl


@pytest.mark.parametrize("size", range(0, 12))
@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_chunk_rule_equals_torch_chunk(size: int, n: int) -> None:
    t = torch.arange(size)
    chunks = list(torch.chunk(t, n)) if size else []
    for i in range(n):
        length, start = chunk_size_and_offset(size, n, i)
        want = chunks[i] if i < len(chunks) else t[:0]
        assert torch.equal(t[start : start + length], want)


def test_nested_uneven_offsets() -> None:
    # dim 0 (size 7) sharded by axis 0 (2 ranks) then axis 1 (3 ranks): 4|3 then 2,2,0 | 1,1,1
    shapes = {
        c: local_shape_and_offset((7, 5), (2, 3), (Shard(0), Shard(0)), c)
        for c in [(0, 0), (0, 2), (1, 0), (1, 2)]
    }
    assert shapes[(0, 0)] == ((2, 5), (0, 0))
    assert shapes[(0, 2)] == ((0, 5), (7, 0))  # empty shard: offset is the end of the dim, as in DTensor
    assert shapes[(1, 0)] == ((1, 5), (4, 0))
    assert shapes[(1, 2)] == ((1, 5), (6, 0))


def test_normalize_errors_name_the_problem() -> None:
    assert normalize_placements([Shard(-1)], ndim=3, mesh_ndim=1) == (Shard(2),)
    with pytest.raises(PlacementError, match="2 placement\\(s\\) S\\(0\\)R for a mesh with 1"):
        normalize_placements([Shard(0), Replicate()], ndim=2, mesh_ndim=1)
    with pytest.raises(PlacementError, match="Shard\\(2\\) on mesh axis 0 is out of range for a 2-d tensor"):
        normalize_placements([Shard(2)], ndim=2, mesh_ndim=1)
    with pytest.raises(PlacementError, match="Partial\\('prod'\\)"):
        normalize_placements([Partial("prod")], ndim=2, mesh_ndim=1)
    with pytest.raises(PlacementError, match="not a Shard, Replicate or Partial"):
        normalize_placements(["S(0)"], ndim=2, mesh_ndim=1)  # type: ignore[list-item]
