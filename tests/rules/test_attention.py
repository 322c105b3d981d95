"""Attention family: head/batch sharding stays put, query-sequence sharding (causal offsets included), GQA only in
whole groups, key-sequence sharding is gathered, dropout refused, sdpa cost."""

from __future__ import annotations

import pytest
import torch

from tests.rules.harness import Sample, check_sample
from torch_dtorch.placement import Partial, Replicate, Shard
from torch_dtorch.placement_rules import intercept_list

aten = torch.ops.aten
SDPA = aten.scaled_dot_product_attention.default
R, P = Replicate(), Partial()
S = Shard
_g = torch.Generator().manual_seed(0)


def rand(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=_g)


def sample(*args: object, **kwargs: object) -> Sample:
    return Sample(tuple(args), dict(kwargs), atol=1e-4, rtol=1e-4)


Q, K, V = rand(2, 3, 5, 4), rand(2, 3, 7, 4), rand(2, 3, 7, 3)


def test_sdpa_is_intercepted() -> None:
    assert SDPA in intercept_list()


def test_head_and_batch_sharding_stays() -> None:
    for mesh in ((2,), (3,)):
        for d in (0, 1):
            plan = check_sample(SDPA, sample(Q, K, V), mesh, [(S(d),), (S(d),), (S(d),), None])
            assert plan.match.in_targets[:3] == ((S(d),),) * 3 and plan.out_placements == ((S(d),),)
    plan = check_sample(SDPA, sample(Q, K, V), (2, 2), [(S(0), S(1)), (S(0), S(1)), (S(0), S(1)), None])
    assert plan.match.in_targets[:3] == ((S(0), S(1)),) * 3 and plan.out_placements == ((S(0), S(1)),)


def test_mask_follows_where_full_size_and_broadcasts_otherwise() -> None:
    mask = rand(2, 1, 5, 7)  # full batch, broadcast heads
    plan = check_sample(SDPA, sample(Q, K, V, mask), (2,), [(S(0),), (S(0),), (S(0),), (R,)])
    assert plan.match.in_targets == ((S(0),), (S(0),), (S(0),), (S(0),)) and plan.out_placements == ((S(0),),)
    plan = check_sample(SDPA, sample(Q, K, V, mask), (3,), [(S(1),), (S(1),), (S(1),), (R,)])
    assert plan.match.in_targets == ((S(1),), (S(1),), (S(1),), (R,)) and plan.out_placements == ((S(1),),)
    plan = check_sample(SDPA, sample(Q, K, V, mask), (2,), [(S(2),), (R,), (R,), (R,)])
    assert plan.match.in_targets == ((S(2),), (R,), (R,), (S(2),)) and plan.out_placements == ((S(2),),)


@pytest.mark.parametrize("mesh", [(2,), (3,), (2, 2)])
def test_query_sequence_sharding_with_causal_offsets(mesh: tuple[int, ...]) -> None:
    q_pl = (S(2),) * len(mesh)
    for q, k, v in ((Q, K, V), (rand(2, 3, 7, 4), rand(2, 3, 5, 4), rand(2, 3, 5, 3))):  # L < S and L > S
        plan = check_sample(
            SDPA, sample(q, k, v, is_causal=True), mesh, [q_pl, (R,) * len(mesh), (R,) * len(mesh), None]
        )
        assert plan.match.in_targets[0] == q_pl and plan.out_placements == (q_pl,)
    # k/v sharded on the sequence too: never computed as is (an all-to-all to the batch dim is cheapest)
    plan = check_sample(SDPA, sample(Q, K, V, is_causal=True, scale=0.5), mesh, [q_pl, q_pl, q_pl, None])
    assert plan.match.in_targets[1] != q_pl and plan.match.in_targets[2] != q_pl


def test_key_sequence_sharding_is_gathered_not_computed_locally() -> None:
    plan = check_sample(SDPA, sample(Q, K, V), (2,), [(R,), (S(2),), (S(2),), None])
    assert plan.match.in_targets[1] != (S(2),) and plan.match.in_targets[2] != (S(2),)


def test_gqa_heads_split_only_in_whole_groups() -> None:
    q, k, v = rand(2, 4, 5, 4), rand(2, 2, 7, 4), rand(2, 2, 7, 3)
    s = sample(q, k, v, enable_gqa=True)
    plan = check_sample(SDPA, s, (2,), [(S(1),), (S(1),), (S(1),), None])
    assert plan.match.in_targets[:3] == ((S(1),),) * 3 and plan.out_placements == ((S(1),),)
    plan = check_sample(SDPA, s, (3,), [(S(1),), (S(1),), (S(1),), None])  # 2 + 2 + 0 query heads
    assert plan.out_placements == ((S(1),),)
    # (2, 2) nests 4 -> 2 -> 1 query heads: a group of 2 would be split, so the heads are not sharded twice
    plan = check_sample(SDPA, s, (2, 2), [(S(1), S(1)), (S(1), S(1)), (S(1), S(1)), None])
    assert plan.out_placements != ((S(1), S(1)),)
    # 6 query heads in groups of 2 over 2 ranks: 3 + 3 splits a group
    q6, k3 = rand(1, 6, 5, 4), rand(1, 3, 7, 4)
    plan = check_sample(SDPA, sample(q6, k3, k3, enable_gqa=True), (2,), [(S(1),), (S(1),), (S(1),), None])
    assert plan.out_placements != ((S(1),),)
    plan = check_sample(SDPA, sample(q6, k3, k3, enable_gqa=True), (3,), [(S(1),), (S(1),), (S(1),), None])
    assert plan.out_placements == ((S(1),),)


def test_linear_in_value_and_value_features() -> None:
    plan = check_sample(SDPA, sample(Q, K, V), (2,), [(R,), (R,), (P,), None])
    assert plan.match.in_targets[:3] == ((R,), (R,), (P,)) and plan.out_placements == ((P,),)
    plan = check_sample(SDPA, sample(Q, K, V), (3,), [(R,), (R,), (S(3),), None])
    assert plan.match.in_targets[:3] == ((R,), (R,), (S(3),)) and plan.out_placements == ((S(3),),)
    # softmax(q k) is not linear in q
    plan = check_sample(SDPA, sample(Q, K, V), (2,), [(P,), (R,), (R,), None])
    assert plan.match.in_targets[0] != (P,)


def test_dropout_is_refused() -> None:
    with pytest.raises(NotImplementedError, match="dropout_p"):
        check_sample(SDPA, sample(Q, K, V, dropout_p=0.1), (2,), [(R,), (R,), (R,), None])


def test_sdpa_cost() -> None:
    plan = check_sample(SDPA, sample(Q, K, V), (1,), [(R,), (R,), (R,), None])
    assert plan.cost.flops == 2 * 6 * 5 * 7 * (4 + 3)
    plan = check_sample(SDPA, sample(Q, K, V, is_causal=True), (1,), [(R,), (R,), (R,), None])
    assert plan.cost.flops == 6 * 5 * 7 * (4 + 3)
