"""Reduction family: Partial outputs of sharded reduced dims, kept shards (keepdim shifting), fallbacks, errors."""

from __future__ import annotations

import pytest
import torch

from tests.rules.harness import Sample, check_sample
from torch_dtorch.errors import ShapeError
from torch_dtorch.placement import Partial, Replicate, Shard
from torch_dtorch.placement_rules import intercept_list, rules_by_family

aten = torch.ops.aten
R, P = Replicate(), Partial()
PMAX, PMIN, PAVG = Partial("max"), Partial("min"), Partial("avg")
S = Shard


def rand(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(0))


def test_no_reduction_is_intercepted() -> None:
    assert not set(rules_by_family()["reduction"]) & set(intercept_list())


def test_sum_over_sharded_dim_is_partial_sum() -> None:
    plan = check_sample(aten.sum.dim_IntList, Sample((rand(5, 3), [0])), (2,), [(S(0),)])
    assert plan.match.in_targets == ((S(0),),)
    assert plan.out_placements == ((P,),)
    plan = check_sample(aten.sum.default, Sample((rand(5, 3),)), (2, 2), [(S(0), S(1))])
    assert plan.match.in_targets == ((S(0), S(1)),)
    assert plan.out_placements == ((P, P),)
    # a kept dim stays sharded next to a reduced one on another axis
    plan = check_sample(aten.sum.dim_IntList, Sample((rand(5, 3), [1])), (2, 2), [(S(0), S(1))])
    assert plan.out_placements == ((S(0), P),)


def test_mean_over_uneven_sharded_dim_is_exact() -> None:
    # 5 rows on 2 / 3 / 2x2 ranks: 3+2, 2+2+1, (2+1)+(1+1); local_sum / global_count sums to the mean
    x = rand(5, 3)
    for mesh, pl in (((2,), (S(0),)), ((3,), (S(0),)), ((2, 2), (S(0), S(0)))):
        plan = check_sample(aten.mean.dim, Sample((x, [0]), atol=1e-6), mesh, [pl])
        assert plan.match.in_targets == (pl,)
        assert all(p == P for p in plan.out_placements[0])
    plan = check_sample(aten.mean.default, Sample((rand(5, 1, 7),)), (2, 2), [(S(0), S(1))])
    assert plan.out_placements == ((P, P),)  # axis 1 has an empty shard of the size-1 dim


def test_linear_partials_pass_through_sum_mean_cumsum() -> None:
    for op, args in (
        (aten.sum.dim_IntList, ([1],)),
        (aten.mean.dim, ([0], True)),
        (aten.cumsum.default, (0,)),
    ):
        for p in (P, PAVG):
            plan = check_sample(op, Sample((rand(5, 3), *args)), (2,), [(p,)])
            assert plan.match.in_targets == ((p,),) and plan.out_placements == ((p,),), op
    # a cast to an integer dtype is not linear: the Partial input is reduced first
    plan = check_sample(
        aten.sum.dim_IntList, Sample((rand(5, 3) * 4, [1]), {"dtype": torch.int64}), (2,), [(P,)]
    )
    assert not isinstance(plan.match.in_targets[0][0], Partial)  # reduce-scattered to a sharded signature


def test_amax_amin_give_partial_max_min() -> None:
    plan = check_sample(aten.amax.default, Sample((rand(5, 3), [0])), (3,), [(S(0),)])
    assert plan.out_placements == ((PMAX,),)
    plan = check_sample(aten.amin.default, Sample((rand(5, 3), [1], True)), (2,), [(S(1),)])
    assert plan.out_placements == ((PMIN,),)
    plan = check_sample(aten.max.default, Sample((rand(5, 3),)), (2,), [(PMAX,)])
    assert plan.match.in_targets == ((PMAX,),) and plan.out_placements == ((PMAX,),)
    # max is not linear in a P(sum) input: it is reduced first (a reduce-scatter to a sharded signature)
    plan = check_sample(aten.amax.default, Sample((rand(5, 3), [0])), (2,), [(P,)])
    assert plan.match.in_targets[0] in ((S(0),), (S(1),))
    assert plan.out_placements[0] in ((PMAX,), (S(0),))
    plan = check_sample(aten.amax.default, Sample((rand(5), [0])), (2,), [(P,)])
    assert plan.match.in_targets == ((S(0),),) and plan.out_placements == ((PMAX,),)
    plan = check_sample(aten.logsumexp.default, Sample((rand(5), [0])), (2,), [(P,)])
    assert plan.match.in_targets == ((R,),) and plan.out_placements == ((R,),)


def test_empty_shards_contribute_the_identity() -> None:
    # dim 1 has size 1: rank 1 of each axis holds an empty shard of it
    x = rand(5, 1, 7)
    plan = check_sample(aten.amax.default, Sample((x, [1])), (2,), [(S(1),)])
    assert plan.out_placements == ((PMAX,),)
    check_sample(aten.min.default, Sample((x,)), (2, 2), [(S(1), S(0))])
    ints = torch.arange(5 * 7).reshape(5, 1, 7) - 9
    check_sample(aten.amin.default, Sample((ints, [1, 2])), (2,), [(S(1),)])
    check_sample(aten.all.dim, Sample((x > 0, 1)), (3,), [(S(1),)])
    check_sample(aten.any.default, Sample((x > 0,)), (2, 2), [(S(1), S(1))])


def test_keepdim_shifts_the_kept_shard() -> None:
    x = rand(5, 1, 7)
    plan = check_sample(aten.sum.dim_IntList, Sample((x, [0])), (2,), [(S(2),)])
    assert plan.out_placements == ((S(1),),)
    plan = check_sample(aten.sum.dim_IntList, Sample((x, [0], True)), (2,), [(S(2),)])
    assert plan.out_placements == ((S(2),),)
    plan = check_sample(aten.var_mean.correction, Sample((x, [0, 1])), (2, 2), [(S(2), R)])
    assert plan.out_placements == ((S(0), R), (S(0), R))
    plan = check_sample(aten.max.dim, Sample((x, -2)), (3,), [(S(2),)])
    assert plan.out_placements == ((S(1),), (S(1),))


def test_non_decomposable_reductions_gather_a_sharded_reduced_dim() -> None:
    x = torch.randperm(15, generator=torch.Generator().manual_seed(0)).reshape(5, 3).float()
    for op, args in (
        (aten.max.dim, (0,)),
        (aten.min.dim, (0, True)),
        (aten.argmax.default, (0,)),
        (aten.var.correction, ([0],)),
        (aten.std.correction, ([0],)),
        (aten.logsumexp.default, ([0],)),
    ):
        # the cheapest legal move is the all-to-all to the kept dim, S(0) -> S(1) (never a Partial output)
        plan = check_sample(op, Sample((x, *args)), (2,), [(S(0),)])
        assert plan.match.in_targets == ((S(1),),), op
        assert all(p in ((S(1),), (S(0),)) for p in plan.out_placements), op
        plan = check_sample(op, Sample((x[:, 0], *args)), (3,), [(S(0),)])  # 1-d: nothing else to shard
        assert plan.match.in_targets == ((R,),), op
        assert all(p == (R,) for p in plan.out_placements), op
    # max.dim over the other dim keeps the shard on values AND indices (indices are local to the unsharded dim)
    plan = check_sample(aten.max.dim, Sample((x, 1)), (2,), [(S(0),)])
    assert plan.out_placements == ((S(0),), (S(0),))
    plan = check_sample(aten.argmax.default, Sample((x,)), (2,), [(S(1),)])  # flattened: Replicate only
    assert plan.out_placements == ((R,),)


def test_cumsum_keeps_other_dims_sharded() -> None:
    plan = check_sample(aten.cumsum.default, Sample((rand(5, 3), 1)), (2,), [(S(0),)])
    assert plan.out_placements == ((S(0),),)
    plan = check_sample(aten.cumsum.default, Sample((rand(5, 3), -1)), (2,), [(S(1),)])
    assert plan.match.in_targets == ((S(0),),)  # the scanned dim is gathered (all-to-all)
    plan = check_sample(aten.cumsum.default, Sample((rand(7), 0)), (2,), [(S(0),)])
    assert plan.match.in_targets == ((R,),)


def test_any_all_dims_empty_list_reduces_nothing() -> None:
    plan = check_sample(aten.any.dims, Sample((rand(5, 3) > 0, [])), (2,), [(S(1),)])
    assert plan.out_placements == ((S(1),),)
    plan = check_sample(aten.sum.dim_IntList, Sample((rand(5, 3), [])), (2,), [(S(1),)])
    assert plan.out_placements == ((P,),)


def test_bad_dim_is_a_shape_error() -> None:
    with pytest.raises(ShapeError, match="sum"):
        check_sample(aten.sum.dim_IntList, Sample((rand(5, 3), [2])), (2,), [(S(0),)])
    with pytest.raises(ShapeError):
        check_sample(aten.mean.dim, Sample((torch.arange(6), [0])), (2,), [(S(0),)])


# --- vector norms -----------------------------------------------------------------------------------------------------

NORM = aten.linalg_vector_norm.default
INF = float("inf")


@pytest.mark.parametrize(
    ("order", "partial"),
    [(1, P), (1.0, P), (0, P), (INF, PMAX), (-INF, PMIN)],
    ids=["1", "1.0", "0", "inf", "-inf"],
)
def test_vector_norms_that_combine_over_shards_stay_sharded(order: float, partial: Partial) -> None:
    # 5 rows: 3+2 on 2 ranks, 2+2+1 on 3, 2+2+1+0 on 4 (an empty shard contributes the identity)
    x = rand(5, 3)
    for mesh in ((2,), (3,), (4,)):
        plan = check_sample(NORM, Sample((x, order, [0])), mesh, [(S(0),)])
        assert plan.match.in_targets == ((S(0),),) and plan.out_placements == ((partial,),)
        plan = check_sample(aten.norm.ScalarOpt_dim, Sample((x, order, [0], True)), mesh, [(S(0),)])
        assert plan.match.in_targets == ((S(0),),) and plan.out_placements == ((partial,),)
    # full reduction on 2x2, both dims sharded (dim 1 of size 1 leaves empty shards on axis 1)
    plan = check_sample(NORM, Sample((rand(5, 1, 7), order)), (2, 2), [(S(0), S(1))])
    assert plan.match.in_targets == ((S(0), S(1)),) and plan.out_placements == ((partial, partial),)
    # a kept dim stays sharded next to a reduced one on the other axis
    plan = check_sample(NORM, Sample((x, order, [1])), (2, 2), [(S(0), S(1))])
    assert plan.out_placements == ((S(0), partial),)


def test_vector_norm_dtype_and_complex_inputs() -> None:
    plan = check_sample(NORM, Sample((rand(5, 3), 1, [0]), {"dtype": torch.float64}), (4,), [(S(0),)])
    assert plan.out_placements == ((P,),)
    z = torch.complex(rand(7), rand(7))
    plan = check_sample(NORM, Sample((z, INF)), (4,), [(S(0),)])
    assert plan.out_placements == ((PMAX,),)


def test_p_norms_keep_kept_dims_sharded_and_exchange_over_a_reduced_one() -> None:
    x = rand(5, 3)
    for order in (2, 3, 0.5, -1, None):
        op, args = (aten.norm.ScalarOpt_dim, (x, None, [1])) if order is None else (NORM, (x, order, [1]))
        plan = check_sample(op, Sample(args), (4,), [(S(0),)])
        assert plan.match.in_targets == ((S(0),),) and plan.out_placements == ((S(0),),)
        # (Σ_r Σ|x|^p)^(1/p) needs a root after the sum: no Partial; the kernel exchanges the partial sums
        # (norm_comm.py) and the output is Replicate — the reduced dim stays where it is
        plan = check_sample(op, Sample(args), (2,), [(S(1),)])
        assert plan.match.in_targets == ((S(1),),) and plan.out_placements == ((R,),)
        plan = check_sample(op, Sample((x[0], *args[1:2], [0])), (4,), [(S(0),)])
        assert plan.match.in_targets == ((S(0),),) and plan.out_placements == ((R,),)
    # norms are not linear: a Partial input is reduced first
    plan = check_sample(NORM, Sample((rand(7), 1)), (2,), [(P,)])
    assert plan.match.in_targets == ((S(0),),) and plan.out_placements == ((P,),)
