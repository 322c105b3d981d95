"""Matmul family: einsum-driven signatures (no redistribute where a sharded one fits), Partial outputs, bias
handling, equation parsing, exact 2·M·N·K costs."""

from __future__ import annotations

import pytest
import torch

from tests.rules.harness import Sample, check_sample
from torch_dtorch.errors import ShapeError
from torch_dtorch.placement import Partial, Replicate, Shard
from torch_dtorch.placement_rules import intercept_list, rules_by_family
from torch_dtorch.placement_rules.families.matmul import matmul_equation, parse_einsum

aten = torch.ops.aten
R, P, PAVG = Replicate(), Partial(), Partial("avg")
S = Shard
_g = torch.Generator().manual_seed(0)


def rand(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=_g)


def sample(*args: object, **kwargs: object) -> Sample:
    return Sample(tuple(args), dict(kwargs), atol=1e-4, rtol=1e-4)


A, B = rand(5, 3), rand(3, 7)


def test_mm_signatures_keep_shards() -> None:
    for mesh in ((2,), (3,)):
        plan = check_sample(aten.mm.default, sample(A, B), mesh, [(S(0),), (R,)])
        assert plan.match.in_targets == ((S(0),), (R,)) and plan.out_placements == ((S(0),),)
        plan = check_sample(aten.mm.default, sample(A, B), mesh, [(R,), (S(1),)])
        assert plan.match.in_targets == ((R,), (S(1),)) and plan.out_placements == ((S(1),),)
        plan = check_sample(aten.mm.default, sample(A, B), mesh, [(S(1),), (S(0),)])
        assert plan.match.in_targets == ((S(1),), (S(0),)) and plan.out_placements == ((P,),)
    # 2-d mesh: rows on axis 0, columns on axis 1; nested rows on both axes
    plan = check_sample(aten.mm.default, sample(A, B), (2, 2), [(S(0), R), (R, S(1))])
    assert plan.match.in_targets == ((S(0), R), (R, S(1))) and plan.out_placements == ((S(0), S(1)),)
    plan = check_sample(aten.mm.default, sample(A, B), (2, 2), [(S(0), S(0)), (R, R)])
    assert plan.match.in_targets == ((S(0), S(0)), (R, R)) and plan.out_placements == ((S(0), S(0)),)


def test_mm_contracted_dim_with_replicated_peer_becomes_partial() -> None:
    # R -> S(0) on the peer is a free local slice: cheaper than gathering the sharded K dim
    plan = check_sample(aten.mm.default, sample(A, B), (2,), [(S(1),), (R,)])
    assert plan.match.in_targets == ((S(1),), (S(0),)) and plan.out_placements == ((P,),)


def test_mm_is_linear_in_each_argument_but_not_both() -> None:
    for p in (P, PAVG):
        plan = check_sample(aten.mm.default, sample(A, B), (2,), [(p,), (R,)])
        assert plan.match.in_targets == ((p,), (R,)) and plan.out_placements == ((p,),)
        plan = check_sample(aten.mm.default, sample(A, B), (2,), [(R,), (p,)])
        assert plan.out_placements == ((p,),)
    plan = check_sample(aten.mm.default, sample(A, B), (2,), [(P,), (P,)])
    assert plan.match.in_targets != ((P,), (P,))  # P·P is not a partial product: one side is reduced first


def test_addmm_partial_requires_partial_bias() -> None:
    bias = rand(7)
    plan = check_sample(
        aten.addmm.default, sample(bias, A, B, beta=0.5, alpha=2.0), (2,), [(R,), (S(1),), (S(0),)]
    )
    assert plan.match.in_targets == ((P,), (S(1),), (S(0),)) and plan.out_placements == ((P,),)
    plan = check_sample(aten.addmm.default, sample(bias, A, B), (3,), [(R,), (P,), (R,)])
    assert plan.match.in_targets == ((P,), (P,), (R,)) and plan.out_placements == ((P,),)
    # bias over the output columns follows S(1); a broadcast [5, 1] bias stays R next to it
    plan = check_sample(aten.addmm.default, sample(bias, A, B), (2,), [(R,), (R,), (S(1),)])
    assert plan.match.in_targets == ((S(0),), (R,), (S(1),)) and plan.out_placements == ((S(1),),)
    plan = check_sample(aten.addmm.default, sample(rand(5, 1), A, B), (2,), [(R,), (R,), (S(1),)])
    assert plan.match.in_targets == ((R,), (R,), (S(1),)) and plan.out_placements == ((S(1),),)


def test_linear_column_and_row_parallel() -> None:
    x, w, b = rand(2, 5, 3), rand(7, 3), rand(7)
    # column parallel: weight S(0) -> output sharded on its last dim, bias follows
    plan = check_sample(aten.linear.default, sample(x, w, b), (2,), [(R,), (S(0),), (S(0),)])
    assert plan.match.in_targets == ((R,), (S(0),), (S(0),)) and plan.out_placements == ((S(2),),)
    plan = check_sample(aten.linear.default, sample(x, w), (3,), [(R,), (S(0),), None])
    assert plan.out_placements == ((S(2),),)
    # row parallel: input S(-1), weight S(1) -> P(sum); the bias is zero-filled on all but one rank
    plan = check_sample(aten.linear.default, sample(x, w, b), (2,), [(S(2),), (S(1),), (R,)])
    assert plan.match.in_targets == ((S(2),), (S(1),), (P,)) and plan.out_placements == ((P,),)
    plan = check_sample(aten.linear.default, sample(x, w), (2, 2), [(S(0), S(2)), (R, S(1)), None])
    assert plan.match.in_targets[:2] == ((S(0), S(2)), (R, S(1))) and plan.out_placements == ((S(0), P),)


def test_matmul_broadcast_batch_and_vectors() -> None:
    a, b = rand(2, 1, 5, 3), rand(3, 3, 7)
    plan = check_sample(aten.matmul.default, sample(a, b), (2,), [(S(0),), (R,)])
    assert plan.match.in_targets == ((S(0),), (R,)) and plan.out_placements == ((S(0),),)
    # b's batch dim aligns with out dim 1; a broadcasts (size 1) there and stays R
    plan = check_sample(aten.matmul.default, sample(a, b), (2,), [(R,), (S(0),)])
    assert plan.match.in_targets == ((R,), (S(0),)) and plan.out_placements == ((S(1),),)
    plan = check_sample(aten.matmul.default, sample(rand(7), rand(7)), (3,), [(S(0),), (S(0),)])
    assert plan.out_placements == ((P,),)
    plan = check_sample(aten.matmul.default, sample(rand(7), rand(3, 7, 5)), (2,), [(R,), (S(2),)])
    assert plan.match.in_targets == ((R,), (S(2),)) and plan.out_placements == ((S(1),),)


def test_einsum_signatures() -> None:
    q, k = rand(2, 3, 5, 4), rand(2, 3, 7, 4)
    plan = check_sample(aten.einsum.default, sample("bhqd,bhkd->bhqk", [q, k]), (2,), [(S(1),), (S(1),)])
    assert plan.match.in_targets == ((S(1),), (S(1),)) and plan.out_placements == ((S(1),),)
    plan = check_sample(aten.einsum.default, sample("bhqd,bhkd->bhqk", [q, k]), (2,), [(S(3),), (S(3),)])
    assert plan.out_placements == ((P,),)
    plan = check_sample(aten.einsum.default, sample("ij->ji", [A]), (2,), [(P,)])
    assert plan.out_placements == ((P,),)
    plan = check_sample(aten.einsum.default, sample("ij->ji", [A]), (2,), [(S(0),)])
    assert plan.out_placements == ((S(1),),)
    # a diagonal cannot be sharded on one axis: the input is gathered
    plan = check_sample(aten.einsum.default, sample("ii->i", [rand(3, 3)]), (2,), [(S(0),)])
    assert plan.match.in_targets == ((R,),) and plan.out_placements == ((R,),)
    # k is contracted between the 2nd and 3rd operand: the replicated 3rd is sliced for free -> P(sum)
    plan = check_sample(
        aten.einsum.default, sample("ij,jk,kl->il", [A, B, rand(7, 2)]), (2,), [(R,), (S(1),), (R,)]
    )
    assert plan.match.in_targets == ((R,), (S(1),), (S(0),)) and plan.out_placements == ((P,),)


def test_parse_einsum() -> None:
    e = parse_einsum("...ij,...jk", [(2, 1, 5, 3), (3, 3, 2)])
    assert e.inputs[0][-2:] == "ij" and e.inputs[1][-2:] == "jk" and len(e.inputs[0]) == 4
    assert e.output[-2:] == "ik" and len(e.output) == 4 and e.output[:2] == e.inputs[0][:2]
    assert parse_einsum("Ba,Ca", [(2, 3), (5, 3)]).output == "BC"
    assert parse_einsum("b...a,...", [(2, 4, 3), (5, 4)]).output[-2:] == "ab"
    assert parse_einsum(" i j , j k -> i k ", [(2, 3), (3, 4)]).output == "ik"
    assert matmul_equation(1, 1) == "k,k->" and matmul_equation(3, 2) == "amk,kn->amn"
    assert matmul_equation(2, 4) == "mk,abkn->abmn"
    with pytest.raises(NotImplementedError, match="ij,jk->ik"):
        parse_einsum("ij,jk->ik", [(2, 3)])
    with pytest.raises(NotImplementedError, match="i1"):
        parse_einsum("i1->i", [(2, 3)])
    with pytest.raises(ShapeError):
        check_sample(aten.einsum.default, sample("ij,jk->ik", [A, A]), (2,), [(R,), (R,)])


def test_costs_are_exact() -> None:
    def flops(op: object, *args: object, **kwargs: object) -> int:
        n = len(args[1]) if op is aten.einsum.default else sum(isinstance(a, torch.Tensor) for a in args)  # type: ignore[arg-type]
        placements: list[tuple[Replicate, ...] | None] = [(R,)] * n
        if op is aten.linear.default and n == 2:
            placements.append(None)
        return check_sample(op, sample(*args, **kwargs), (1,), placements).cost.flops

    assert flops(aten.mm.default, A, B) == 2 * 5 * 7 * 3
    assert flops(aten.addmm.default, rand(7), A, B) == 2 * 5 * 7 * 3
    assert flops(aten.bmm.default, rand(4, 5, 3), rand(4, 3, 7)) == 2 * 4 * 5 * 7 * 3
    assert flops(aten.baddbmm.default, rand(1, 7), rand(4, 5, 3), rand(4, 3, 7)) == 2 * 4 * 5 * 7 * 3
    assert flops(aten.mv.default, A, rand(3)) == 2 * 5 * 3
    assert flops(aten.dot.default, rand(7), rand(7)) == 2 * 7
    assert flops(aten.matmul.default, rand(2, 1, 5, 3), rand(3, 3, 7)) == 2 * 6 * 5 * 7 * 3
    assert flops(aten.linear.default, rand(2, 5, 3), rand(7, 3)) == 2 * 10 * 7 * 3
    assert (
        flops(aten.einsum.default, "bhqd,bhkd->bhqk", [rand(2, 3, 5, 4), rand(2, 3, 7, 4)])
        == 2 * 6 * 5 * 7 * 4
    )
    # three operands: (5x3)(3x7) then (5x7)(7x2)
    three = flops(aten.einsum.default, "ij,jk,kl->il", [A, B, rand(7, 2)])
    assert three == 2 * 5 * 3 * 7 + 2 * 5 * 7 * 2


def test_composites_are_intercepted() -> None:
    ops = set(rules_by_family()["matmul"])
    intercepted = set(intercept_list())
    assert {aten.matmul.default, aten.linear.default, aten.einsum.default} <= intercepted
    assert not {aten.mm.default, aten.addmm.default, aten.bmm.default} & intercepted
    for op in ops:
        if torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), "CompositeImplicitAutograd"):
            assert op in intercepted, op


# --- addmv / vdot (kept sharded, as upstream DTensor does) -----------------------------------------------------------

_MESHES_1D = ((2,), (3,), (4,))


def test_vdot_of_equally_sharded_vectors_is_partial_sum() -> None:
    x, y = rand(7), rand(7)  # 7 on 4 ranks: 2, 2, 2, 1
    cx = torch.randn(5, dtype=torch.complex64, generator=_g)  # 5 on 4 ranks: 2, 2, 1, 0 (an empty shard)
    cy = torch.randn(5, dtype=torch.complex64, generator=_g)
    for mesh in _MESHES_1D:
        for a, b in ((x, y), (cx, cy)):
            plan = check_sample(aten.vdot.default, sample(a, b), mesh, [(S(0),), (S(0),)])
            assert plan.match.in_targets == ((S(0),), (S(0),)) and plan.out_placements == ((P,),)
    plan = check_sample(aten.vdot.default, sample(cx, cy), (2, 2), [(S(0), S(0)), (S(0), S(0))])
    assert plan.match.in_targets == ((S(0), S(0)), (S(0), S(0))) and plan.out_placements == ((P, P),)
    # a replicated peer is sliced locally (no gather); vdot is linear in each argument (conj is additive)
    plan = check_sample(aten.vdot.default, sample(cx, cy), (4,), [(S(0),), (R,)])
    assert plan.match.in_targets == ((S(0),), (S(0),)) and plan.out_placements == ((P,),)
    for p in (P, PAVG):
        plan = check_sample(aten.vdot.default, sample(x, y), (2,), [(p,), (R,)])
        assert plan.match.in_targets == ((p,), (R,)) and plan.out_placements == ((p,),)


def test_addmv_contracted_shards_give_partial_and_add_the_bias_once() -> None:
    bias, mat, vec = rand(5), rand(5, 7), rand(7)
    for mesh in _MESHES_1D:
        for kw in ({}, {"beta": 0.5, "alpha": 2.0}):
            # columns of the matrix and the vector sharded: P(sum); the replicated bias is zero-filled on all
            # ranks but one (R -> P costs no communication), so the sum adds it exactly once
            plan = check_sample(
                aten.addmv.default, sample(bias, mat, vec, **kw), mesh, [(R,), (S(1),), (S(0),)]
            )
            assert plan.match.in_targets == ((P,), (S(1),), (S(0),)) and plan.out_placements == ((P,),)
        # rows: bias and matrix S(0), vector R -> S(0)
        plan = check_sample(aten.addmv.default, sample(bias, mat, vec), mesh, [(S(0),), (S(0),), (R,)])
        assert plan.match.in_targets == ((S(0),), (S(0),), (R,)) and plan.out_placements == ((S(0),),)
    # a broadcast bias (shape (1,)) stays R next to sharded rows; 2-d mesh: rows on axis 0, K on axis 1
    plan = check_sample(aten.addmv.default, sample(rand(1), mat, vec), (4,), [(R,), (S(0),), (R,)])
    assert plan.match.in_targets == ((R,), (S(0),), (R,)) and plan.out_placements == ((S(0),),)
    plan = check_sample(
        aten.addmv.default, sample(bias, mat, vec, beta=0.5), (2, 2), [(S(0), R), (S(0), S(1)), (R, S(0))]
    )
    assert plan.match.in_targets == ((S(0), P), (S(0), S(1)), (R, S(0)))
    assert plan.out_placements == ((S(0), P),)
