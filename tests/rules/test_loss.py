"""Loss family: elementwise losses keep their shards (``reduction='none'``) or give ``P(sum)`` (``sum``/``mean``,
exact with uneven and empty shards)."""

from __future__ import annotations

import pytest
import torch

from tests.rules.harness import Sample, check_sample
from torch_dtorch.placement import Partial, Replicate, Shard

aten = torch.ops.aten
HUBER = aten.huber_loss.default
R, P, S = Replicate(), Partial(), Shard
NONE, MEAN, SUM = 0, 1, 2
_g = torch.Generator().manual_seed(0)


def rand(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=_g) * 2


X, Y = rand(5, 3), rand(5, 3)


@pytest.mark.parametrize("mesh", [(2,), (3,), (4,)])
def test_huber_loss_none_keeps_the_shards(mesh: tuple[int, ...]) -> None:
    for d in (0, 1):
        plan = check_sample(HUBER, Sample((X, Y, NONE, 0.5)), mesh, [(S(d),), (S(d),)])
        assert plan.match.in_targets == ((S(d),), (S(d),)) and plan.out_placements == ((S(d),),)
    # a broadcast target stays R next to the sharded input
    plan = check_sample(HUBER, Sample((X, rand(3), NONE)), mesh, [(S(0),), (R,)])
    assert plan.match.in_targets == ((S(0),), (R,)) and plan.out_placements == ((S(0),),)


@pytest.mark.parametrize("mesh", [(2,), (3,), (4,)])
@pytest.mark.parametrize("reduction", [MEAN, SUM], ids=["mean", "sum"])
def test_huber_loss_reduced_over_shards_is_partial_sum(mesh: tuple[int, ...], reduction: int) -> None:
    # 5 rows on 4 ranks: 2, 2, 1, 0 (the empty shard adds 0); mean divides by the global count
    for d in (0, 1):
        plan = check_sample(HUBER, Sample((X, Y, reduction, 1.5)), mesh, [(S(d),), (S(d),)])
        assert plan.match.in_targets == ((S(d),), (S(d),)) and plan.out_placements == ((P,),)
    plan = check_sample(HUBER, Sample((X, rand(3)), {"reduction": reduction}), mesh, [(S(0),), (R,)])
    assert plan.match.in_targets == ((S(0),), (R,)) and plan.out_placements == ((P,),)
    plan = check_sample(HUBER, Sample((rand(7), rand(7), reduction)), mesh, [(S(0),), (S(0),)])
    assert plan.out_placements == ((P,),)


def test_huber_loss_on_2x2_and_all_replicate() -> None:
    plan = check_sample(HUBER, Sample((X, Y)), (2, 2), [(S(0), S(1)), (S(0), S(1))])
    assert plan.match.in_targets == ((S(0), S(1)), (S(0), S(1))) and plan.out_placements == ((P, P),)
    plan = check_sample(HUBER, Sample((X, Y, SUM)), (2, 2), [(S(0), R), (S(0), R)])
    assert plan.out_placements == ((P, R),)
    plan = check_sample(HUBER, Sample((X, Y, NONE)), (2, 2), [(S(0), S(0)), (S(0), S(0))])
    assert plan.out_placements == ((S(0), S(0)),)
    plan = check_sample(HUBER, Sample((X, Y)), (4,), [(R,), (R,)])  # nothing sharded: the op runs unchanged
    assert plan.out_placements == ((R,),)
    # not linear: a Partial input is reduced first (never passed through)
    plan = check_sample(HUBER, Sample((X, Y, SUM)), (2,), [(P,), (R,)])
    assert not isinstance(plan.match.in_targets[0][0], Partial)
