"""Normalization family: leading dims stay sharded, normalized/softmax dims are redistributed (never computed on a
slice), group-norm channel sharding only when the groups split evenly."""

from __future__ import annotations

import torch

from tests.rules.harness import Sample, check_sample
from torch_dtorch.placement import Replicate, Shard
from torch_dtorch.placement_rules import intercept_list, rules_by_family
from torch_dtorch.placement_rules.families.normalization import groups_split_evenly

aten = torch.ops.aten
R = Replicate()
S = Shard
_g = torch.Generator().manual_seed(0)


def rand(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=_g)


X = rand(5, 3, 7)


def test_layer_norm_keeps_leading_shards() -> None:
    w, b = rand(7), rand(7)
    for mesh in ((2,), (3,)):
        for d in (0, 1):
            plan = check_sample(aten.layer_norm.default, Sample((X, [7], w, b)), mesh, [(S(d),), (R,), (R,)])
            assert plan.match.in_targets == ((S(d),), (R,), (R,)) and plan.out_placements == ((S(d),),)
    plan = check_sample(
        aten.layer_norm.default, Sample((X, [7], w, b)), (2, 2), [(S(0), S(1)), (R, R), (R, R)]
    )
    assert plan.match.in_targets[0] == (S(0), S(1)) and plan.out_placements == ((S(0), S(1)),)


def test_layer_norm_over_sharded_normalized_dim_is_redistributed() -> None:
    w, b = rand(7), rand(7)
    plan = check_sample(aten.layer_norm.default, Sample((X, [7], w, b)), (2,), [(S(2),), (R,), (R,)])
    assert plan.match.in_targets[0] != (S(2),) and plan.out_placements != ((S(2),),)
    plan = check_sample(aten.layer_norm.default, Sample((X, [3, 7])), (3,), [(S(1),), None, None])
    assert plan.match.in_targets[0] in ((S(0),), (R,))
    # a sharded weight is gathered: it spans the normalized dims
    plan = check_sample(aten.layer_norm.default, Sample((X, [7], w, b)), (2,), [(S(0),), (S(0),), (R,)])
    assert plan.match.in_targets == ((S(0),), (R,), (R,))


def test_native_layer_norm_stats_follow_the_input() -> None:
    plan = check_sample(
        aten.native_layer_norm.default, Sample((X, [7], rand(7), None, 1e-5)), (2,), [(S(1),), (R,), None]
    )
    assert plan.out_placements == ((S(1),),) * 3


def test_rms_norm() -> None:
    if not hasattr(aten, "rms_norm"):
        return
    plan = check_sample(aten.rms_norm.default, Sample((X, [7], rand(7))), (3,), [(S(1),), (R,)])
    assert plan.match.in_targets == ((S(1),), (R,)) and plan.out_placements == ((S(1),),)
    plan = check_sample(aten.rms_norm.default, Sample((X, [3, 7])), (2,), [(S(2),), None])
    assert plan.match.in_targets[0] != (S(2),)


def test_groups_split_evenly() -> None:
    assert groups_split_evenly(12, 12, (2, 2))  # one channel per group
    assert groups_split_evenly(12, 6, (2,)) and groups_split_evenly(12, 6, (3,))
    assert not groups_split_evenly(12, 6, (2, 2))  # 12 -> 6 -> 3: splits a pair of channels
    assert not groups_split_evenly(6, 3, (2,))  # 3 + 3 channels in groups of 2
    assert groups_split_evenly(6, 3, (1, 3))
    assert not groups_split_evenly(6, 4, (2,))


def test_group_norm_channel_sharding() -> None:
    x, w, b = rand(5, 12, 3), rand(12), rand(12)
    plan = check_sample(aten.group_norm.default, Sample((x, 6, w, b)), (2,), [(S(1),), (S(0),), (S(0),)])
    assert plan.match.in_targets == ((S(1),), (S(0),), (S(0),)) and plan.out_placements == ((S(1),),)
    plan = check_sample(aten.group_norm.default, Sample((x, 6, w, b)), (3,), [(S(1),), (R,), (R,)])
    assert plan.match.in_targets == ((S(1),), (S(0),), (S(0),))  # weight/bias sliced for free
    # groups that would be split: redistributed, the result is still exact
    plan = check_sample(aten.group_norm.default, Sample((x, 6, w, b)), (2, 2), [(S(1), S(1)), (R, R), (R, R)])
    assert S(1) not in (plan.match.in_targets[0] or ())
    plan = check_sample(aten.group_norm.default, Sample((rand(5, 6, 3), 3)), (2,), [(S(1),), None, None])
    assert plan.match.in_targets[0] != (S(1),)
    # 4 channels in groups of 2 over 3 ranks: 2 + 2 + 0, the empty shard has no groups
    plan = check_sample(
        aten.group_norm.default, Sample((rand(3, 4), 2, rand(4), None)), (3,), [(S(1),), (R,), None]
    )
    assert plan.match.in_targets[0] == (S(1),) and plan.out_placements == ((S(1),),)
    sample = Sample((rand(3, 4, 5), None, None, 3, 4, 5, 2, 1e-5))
    plan = check_sample(aten.native_group_norm.default, sample, (3,), [(S(1),), None, None])
    assert plan.match.in_targets[0] == (S(1),) and plan.out_placements == ((S(1),),) * 3
    # batch sharding always works, spatial never
    plan = check_sample(aten.group_norm.default, Sample((x, 6, w, b)), (3,), [(S(0),), (R,), (R,)])
    assert plan.out_placements == ((S(0),),)
    plan = check_sample(aten.group_norm.default, Sample((x, 6, w, b)), (2,), [(S(2),), (R,), (R,)])
    assert plan.match.in_targets[0] != (S(2),)


def test_native_group_norm_localizes_sizes_and_stats() -> None:
    x = rand(5, 12, 3)
    sample = Sample((x, rand(12), rand(12), 5, 12, 3, 6, 1e-5))
    plan = check_sample(aten.native_group_norm.default, sample, (3,), [(S(1),), (S(0),), (S(0),)])
    assert plan.out_placements == ((S(1),),) * 3
    plan = check_sample(aten.native_group_norm.default, sample, (2,), [(S(0),), (R,), (R,)])
    assert plan.out_placements == ((S(0),),) * 3
    # 12 channels in groups of 2 over 4 ranks of a (1, 4)-mesh: 3 + 3 + 3 + 3 channels would split groups
    plan = check_sample(aten.native_group_norm.default, sample, (1, 4), [(R, S(1)), (R, R), (R, R)])
    assert plan.match.in_targets[0] != (R, S(1))


def test_softmax_shards_every_dim_but_its_own() -> None:
    for op, args in (
        (aten._softmax.default, (1, False)),
        (aten.softmax.int, (1,)),
        (aten.log_softmax.int, (-2,)),
    ):
        plan = check_sample(op, Sample((X, *args)), (2,), [(S(0),)])
        assert plan.match.in_targets == ((S(0),),) and plan.out_placements == ((S(0),),)
        plan = check_sample(op, Sample((X, *args)), (3,), [(S(2),)])
        assert plan.out_placements == ((S(2),),)
        plan = check_sample(op, Sample((X, *args)), (2,), [(S(1),)])
        assert plan.match.in_targets != ((S(1),),)
    plan = check_sample(aten._log_softmax.default, Sample((X, -1, False)), (2, 2), [(S(0), S(1))])
    assert plan.out_placements == ((S(0), S(1)),)


def test_composites_are_intercepted() -> None:
    ops = set(rules_by_family()["normalization"])
    intercepted = set(intercept_list())
    assert {
        aten.layer_norm.default,
        aten.group_norm.default,
        aten.softmax.int,
        aten.log_softmax.int,
    } <= intercepted
    assert not {aten.native_layer_norm.default, aten._softmax.default} & intercepted
    for op in ops:
        if torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), "CompositeImplicitAutograd"):
            assert op in intercepted, op
