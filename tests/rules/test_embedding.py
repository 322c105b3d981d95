"""Embedding family: indices / embedding-dim sharding, linearity in the weight, vocab-parallel masked lookup."""

from __future__ import annotations

import pytest
import torch

from tests.rules.harness import Sample, check_sample
from torch_dtorch.placement import Partial, Replicate, Shard
from torch_dtorch.placement_rules import intercept_list

aten = torch.ops.aten
EMB = aten.embedding.default
R, P = Replicate(), Partial()
S = Shard

W = torch.randn(7, 5, generator=torch.Generator().manual_seed(0))
IDX = torch.tensor([[6, 0, 2], [4, 4, 5]])


def test_not_intercepted() -> None:
    assert EMB not in intercept_list()


def test_sharded_indices_and_embedding_dim() -> None:
    for d in (0, 1):
        plan = check_sample(EMB, Sample((W, IDX)), (2,), [(R,), (S(d),)])
        assert plan.match.in_targets == ((R,), (S(d),)) and plan.out_placements == ((S(d),),)
    plan = check_sample(EMB, Sample((W, IDX)), (3,), [(S(1),), (R,)])
    assert plan.match.in_targets == ((S(1),), (R,)) and plan.out_placements == ((S(2),),)
    plan = check_sample(EMB, Sample((W, IDX)), (2, 2), [(R, S(1)), (S(0), R)])
    assert plan.out_placements == ((S(0), S(2)),)


def test_linear_in_the_weight() -> None:
    plan = check_sample(EMB, Sample((W, IDX)), (2,), [(P,), (R,)])
    assert plan.match.in_targets == ((P,), (R,)) and plan.out_placements == ((P,),)


@pytest.mark.parametrize("mesh", [(2,), (3,), (4,)])
def test_vocab_parallel_masked_lookup(mesh: tuple[int, ...]) -> None:
    # 7 rows over 2 / 3 / 4 ranks: 4+3, 3+3+1, 2+2+2+1; every index hits exactly one rank's rows
    plan = check_sample(EMB, Sample((W, IDX)), mesh, [(S(0),), (R,)])
    assert plan.match.in_targets == ((S(0),), (R,)) and plan.out_placements == ((P,),)


def test_vocab_parallel_nested_and_mixed_axes() -> None:
    plan = check_sample(EMB, Sample((W, IDX)), (2, 2), [(S(0), S(0)), (R, R)])
    assert plan.match.in_targets == ((S(0), S(0)), (R, R)) and plan.out_placements == ((P, P),)
    plan = check_sample(EMB, Sample((W, IDX)), (2, 2), [(R, S(0)), (S(1), R)])
    assert plan.match.in_targets == ((R, S(0)), (S(1), R)) and plan.out_placements == ((S(1), P),)
    plan = check_sample(EMB, Sample((W, IDX)), (2, 2), [(S(0), S(1)), (R, R)])
    assert plan.out_placements == ((P, S(2)),)
    # (1, 3)-mesh: the size-1 axis never shifts the offset
    plan = check_sample(EMB, Sample((W, IDX)), (1, 3), [(R, S(0)), (R, R)])
    assert plan.out_placements == ((R, P),)


def test_vocab_parallel_not_offered_when_an_axis_would_be_chosen_by_cost() -> None:
    # weight S(0) next to sharded indices on the same axis: the vocab axis could not be known by the kernel,
    # so the weight is gathered (or the indices) through an ordinary signature — still exact
    plan = check_sample(EMB, Sample((W, IDX)), (2,), [(S(0),), (S(0),)])
    assert plan.out_placements != ((P,),)
    plan = check_sample(EMB, Sample((W, IDX)), (2, 2), [(S(0), R), (R, S(1))])
    assert plan.match.in_targets == ((S(0), R), (R, S(1))) and plan.out_placements == ((P, S(1)),)
    plan = check_sample(EMB, Sample((W, IDX)), (2, 2), [(S(0), Partial("max")), (R, R)])
    w_target = plan.match.in_targets[0]
    assert w_target is not None and w_target[0] != S(0)


def test_vocab_parallel_out_of_range_index_raises() -> None:
    with pytest.raises(RuntimeError, match="out of range"):
        check_sample(EMB, Sample((W, torch.tensor([1, 7]))), (2,), [(S(0),), (R,)])
