"""View family: chosen placements (shards kept without redistribute where the layout allows), fallbacks, errors."""

from __future__ import annotations

import pytest
import torch

from tests.rules.harness import Sample, check_sample
from torch_dtorch.errors import ShapeError
from torch_dtorch.placement import Partial, Replicate, Shard
from torch_dtorch.placement_rules import get_rule, intercept_list, rules_by_family
from torch_dtorch.placement_rules.families.view import VIEW_OPS, reshape_dim_pairs
from torch_dtorch.placement_rules.families.view_scatter import STRIDED_VIEW_OPS

aten = torch.ops.aten
R, P = Replicate(), Partial()
S = Shard


def rand(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(0))


def test_every_view_op_is_intercepted_and_aliases_input_0() -> None:
    views = [*VIEW_OPS, *STRIDED_VIEW_OPS]
    assert sorted(map(str, rules_by_family()["view"])) == sorted(map(str, views))
    intercepted = set(intercept_list())
    for op in views:
        assert op in intercepted, op
        assert get_rule(op).view_of == 0, op


def test_transpose_moves_the_shard_without_redistribute() -> None:
    plan = check_sample(aten.transpose.int, Sample((rand(5, 3), 0, 1)), (2,), [(S(0),)])
    assert plan.match.in_targets == ((S(0),),)
    assert plan.out_placements == ((S(1),),)
    plan = check_sample(aten.permute.default, Sample((rand(2, 5, 3), [2, 0, 1])), (2, 2), [(S(0), S(2))])
    assert plan.out_placements == ((S(1), S(0)),)


def test_view_split_of_unsharded_dim_keeps_shard() -> None:
    plan = check_sample(aten.view.default, Sample((rand(8, 6), [8, 2, 3])), (2,), [(S(0),)])
    assert plan.match.in_targets == ((S(0),),)
    assert plan.out_placements == ((S(0),),)


def test_uneven_merge_falls_back_to_replicate() -> None:
    # [3, 2] S(0) on 2 ranks holds 4/2 elements, but [6] S(0) would be 3/3: no sharded signature
    plan = check_sample(aten.view.default, Sample((rand(3, 2), [6])), (2,), [(S(0),)])
    assert plan.match.in_targets == ((R,),)
    assert plan.out_placements == ((R,),)
    plan = check_sample(aten.view.default, Sample((rand(3, 2), [6])), (2, 2), [(S(0), R)])
    assert plan.match.in_targets == ((R, R),)
    # on 3 ranks every block is 1 row = 2 elements, exactly [6]'s chunks: kept
    plan = check_sample(aten.view.default, Sample((rand(3, 2), [6])), (3,), [(S(0),)])
    assert plan.out_placements == ((S(0),),)


def test_even_merge_keeps_shard() -> None:
    plan = check_sample(aten.view.default, Sample((rand(4, 2), [8])), (2,), [(S(0),)])
    assert plan.out_placements == ((S(0),),)
    # nested over both axes: 8 -> 4 -> 2 rows of 6 == 48 -> 24 -> 12 elements on every rank
    plan = check_sample(aten.view.default, Sample((rand(8, 6), [48])), (2, 2), [(S(0), S(0))])
    assert plan.out_placements == ((S(0), S(0)),)


def test_split_of_sharded_dim_shards_leading_factor() -> None:
    plan = check_sample(aten.view.default, Sample((rand(6, 4), [2, 3, 4])), (2,), [(S(0),)])
    assert plan.out_placements == ((S(0),),)
    plan = check_sample(aten.unflatten.int, Sample((rand(6, 4), 0, [3, 2])), (3,), [(S(0),)])
    assert plan.out_placements == ((S(0),),)


def test_reshape_dim_pairs_checks_every_rank_and_possible_movers() -> None:
    assert reshape_dim_pairs((3, 2), (6,), (2,), (S(0),)) == []
    assert reshape_dim_pairs((4, 2), (8,), (2,), (S(0),)) == [(0, 0)]
    assert reshape_dim_pairs((5, 1, 3), (5, 3), (2,), (S(2),)) == [(0, 0), (2, 1)]
    # axis 0 shards dim 1, which cannot stay sharded; it may move onto dim 0, nested with axis 1: 6 -> 3 -> 2/1
    # rows of 6 vs 36 -> 18 -> 9: dim 0 is dropped too
    assert reshape_dim_pairs((6, 6), (36,), (2, 2), (S(1), S(0))) == []
    assert reshape_dim_pairs((8, 6), (48,), (2, 2), (S(1), S(0))) == [(0, 0)]


def test_partial_passes_through_views() -> None:
    for p in (P, Partial("avg"), Partial("max")):
        plan = check_sample(aten.view.default, Sample((rand(5, 3), [15])), (2,), [(p,)])
        assert plan.out_placements == ((p,),)
    plan = check_sample(aten.split.Tensor, Sample((rand(5, 3), 2)), (2, 2), [(P, S(1))])
    assert plan.out_placements == ((P, S(1)),) * 3


def test_unsqueeze_and_squeeze_shift_shard_dims() -> None:
    plan = check_sample(aten.unsqueeze.default, Sample((rand(5, 3), 0)), (2,), [(S(1),)])
    assert plan.out_placements == ((S(2),),)
    plan = check_sample(aten.unsqueeze.default, Sample((rand(5, 3), -1)), (2,), [(S(1),)])
    assert plan.out_placements == ((S(1),),)
    plan = check_sample(aten.squeeze.dim, Sample((rand(5, 1, 3), 1)), (2,), [(S(2),)])
    assert plan.out_placements == ((S(1),),)
    plan = check_sample(aten.squeeze.default, Sample((rand(1, 5, 1, 3),)), (2, 2), [(S(3), S(1))])
    assert plan.out_placements == ((S(1), S(0)),)


def test_squeeze_keeps_local_size_1_dims() -> None:
    # [2, 3] S(0) on 3 ranks: local shards are 1, 1, 0 long but the global dim is not squeezed
    plan = check_sample(aten.squeeze.default, Sample((rand(2, 3),)), (3,), [(S(0),)])
    assert plan.out_placements == ((S(0),),)
    check_sample(aten.squeeze.dim, Sample((rand(2, 3), 0)), (3,), [(S(0),)])


def test_split_and_select_along_unsharded_dim_keep_shard() -> None:
    plan = check_sample(aten.split.Tensor, Sample((rand(5, 3), 2, 1)), (2,), [(S(0),)])
    assert plan.match.in_targets == ((S(0),),)
    assert plan.out_placements == ((S(0),),) * 2
    plan = check_sample(aten.split_with_sizes.default, Sample((rand(5, 3), [2, 3])), (3,), [(S(1),)])
    assert plan.out_placements == ((S(1),),) * 2
    plan = check_sample(aten.select.int, Sample((rand(2, 5, 3), 0, 1)), (2,), [(S(2),)])
    assert plan.out_placements == ((S(1),),)
    plan = check_sample(aten.unbind.int, Sample((rand(2, 5, 3), 2)), (2,), [(S(1),)])
    assert plan.out_placements == ((S(1),),) * 3


def test_slicing_a_sharded_dim_is_not_local() -> None:
    plan = check_sample(aten.slice.Tensor, Sample((rand(5, 3), 0, 1, 4)), (2,), [(S(0),)])
    assert plan.match.in_targets != ((S(0),),)
    plan = check_sample(aten.slice.Tensor, Sample((rand(5, 3), 0)), (2,), [(S(0),)])  # x[:] keeps it
    assert plan.out_placements == ((S(0),),)
    plan = check_sample(aten.split.Tensor, Sample((rand(5, 3), 2)), (2,), [(S(0),)])
    assert plan.match.in_targets != ((S(0),),)


def test_expand_keeps_non_broadcast_dims() -> None:
    plan = check_sample(aten.expand.default, Sample((rand(5, 1), [2, -1, 3])), (3,), [(S(0),)])
    assert plan.out_placements == ((S(1),),)
    plan = check_sample(aten.expand_as.default, Sample((rand(5, 1), rand(2, 5, 3))), (2,), [(S(0),), (S(2),)])
    assert plan.match.in_targets == ((S(0),), (S(2),))  # `other` only lends its shape: never moved
    assert plan.out_placements == ((S(1),),)


def test_bad_view_size_is_a_shape_error() -> None:
    with pytest.raises(ShapeError, match="view"):
        check_sample(aten.view.default, Sample((rand(5, 3), [4, 4])), (2,), [(S(0),)])
