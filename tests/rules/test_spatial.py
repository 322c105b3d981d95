"""The convolution rule's halo-free signature: a patchify convolution (kernel == stride, no padding) keeps a
sharded spatial dim sharded when every rank's input block is ``stride`` times its output block — checked against
single-device torch on every placement, even and uneven shards, 1-d / 2-d meshes; otherwise the rows are gathered
(still exact)."""

from __future__ import annotations

import pytest
import torch

from tests.rules.harness import Sample, check_op_samples, check_sample
from torch_dtorch.placement import Placement, Replicate, Shard

aten = torch.ops.aten
R = Replicate()


def _conv(h: int, w: int, *, kernel: int = 2, stride: int = 2, padding: int = 0, seed: int = 0) -> Sample:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 3, h, w, generator=g)
    weight = torch.randn(4, 3, kernel, kernel, generator=g)
    bias = torch.randn(4, generator=g)
    args = (x, weight, bias, [stride, stride], [padding, padding], [1, 1], False, [0, 0], 1)
    return Sample(args, atol=1e-4, rtol=1e-4, options=_options)


def _options(slot: int, t: torch.Tensor) -> list[Placement]:
    return [R] + [Shard(d) for d in range(t.ndim)]


SAMPLES = [
    _conv(16, 8),  # rows split 8/8, 6/6/4 (uneven, yet whole patches) and 4x4 on (2, 2): patches never cut
    _conv(12, 8),  # 3 rows per rank on (2, 2) cut a patch: gathered there
    _conv(10, 6),  # 5/5 rows on 2 ranks cut a patch: gathered instead
    _conv(9, 9, kernel=3, stride=3),
    _conv(8, 8, kernel=3, stride=1, padding=1),  # a halo: never spatially sharded
]


def test_convolution_equals_torch_on_every_placement() -> None:
    assert check_op_samples(aten.convolution.default, SAMPLES, limit=40) > 0


@pytest.mark.parametrize(
    "mesh_shape,placements",
    [((2,), [Shard(2)]), ((3,), [Shard(2)]), ((2,), [Shard(3)]), ((2, 2), [Shard(2), Shard(2)]),
     ((2, 2), [Shard(0), Shard(2)]), ((2, 2), [Shard(2), Shard(3)])],
)  # fmt: skip
def test_patchify_keeps_rows_sharded(mesh_shape: tuple[int, ...], placements: list[Placement]) -> None:
    sample = _conv(16, 8)
    plan = check_sample(
        aten.convolution.default, sample, mesh_shape, [tuple(placements), *[(R,) * len(mesh_shape)] * 2]
    )
    assert plan.match.in_targets[0] == tuple(placements)  # no redistribute of the input
    assert plan.out_placements[0] == tuple(placements)


@pytest.mark.parametrize(
    "sample,mesh_shape,placements",
    [(_conv(10, 6), (2,), [Shard(2)]), (_conv(8, 8, kernel=3, stride=1, padding=1), (2,), [Shard(2)]),
     (_conv(12, 8), (2, 2), [Shard(2), Shard(2)])],
)  # fmt: skip
def test_cut_patches_and_halos_leave_the_rows(
    sample: Sample, mesh_shape: tuple[int, ...], placements: list[Placement]
) -> None:
    """5/5 rows cut a 2-row patch; a 3x3 window with padding reads its neighbours' rows; 12 rows over 2x2 ranks
    give blocks of 3 rows: all three move the rows off the spatial dim (the values stay exact)."""
    plan = check_sample(
        aten.convolution.default, sample, mesh_shape, [tuple(placements), *[(R,) * len(mesh_shape)] * 2]
    )
    assert all(p != Shard(2) for p in plan.match.in_targets[0]), plan.match
