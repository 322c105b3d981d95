"""Pointwise family: ``_prelu_kernel`` (behind ``F.prelu``) and ``log_sigmoid_forward`` (behind ``F.logsigmoid``)
keep their shards like any elementwise op."""

from __future__ import annotations

import pytest
import torch

from tests.rules.harness import Sample, check_sample, to_call
from torch_dtorch.mesh import DeviceMesh
from torch_dtorch.placement import Partial, Replicate, Shard
from torch_dtorch.placement_rules import get_rule

aten = torch.ops.aten
R, P, S = Replicate(), Partial(), Shard
PRELU, LOGSIG = aten._prelu_kernel.default, aten.log_sigmoid_forward.default
_g = torch.Generator().manual_seed(0)


def rand(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=_g)


@pytest.mark.parametrize("mesh", [(2,), (3,), (4,)])
def test_prelu_kernel_shards_with_a_broadcast_weight(mesh: tuple[int, ...]) -> None:
    x = rand(2, 5, 3)  # channels (dim 1) = 5: uneven on every mesh, an empty shard on 4
    per_channel = rand(5, 1)
    for d in (0, 2):
        plan = check_sample(PRELU, Sample((x, per_channel)), mesh, [(S(d),), (R,)])
        assert plan.match.in_targets == ((S(d),), (R,)) and plan.out_placements == ((S(d),),)
    # channels sharded: the per-channel weight is sharded with them
    plan = check_sample(PRELU, Sample((x, per_channel)), mesh, [(S(1),), (S(0),)])
    assert plan.match.in_targets == ((S(1),), (S(0),)) and plan.out_placements == ((S(1),),)
    plan = check_sample(PRELU, Sample((x, per_channel)), mesh, [(S(1),), (R,)])  # R -> S is a local slice
    assert plan.match.in_targets == ((S(1),), (S(0),)) and plan.out_placements == ((S(1),),)
    plan = check_sample(PRELU, Sample((rand(7), torch.tensor(0.25))), mesh, [(S(0),), (R,)])
    assert plan.match.in_targets == ((S(0),), (R,)) and plan.out_placements == ((S(0),),)


def test_prelu_kernel_on_2x2_and_not_linear() -> None:
    x, w = rand(2, 5, 3), rand(5, 1)
    plan = check_sample(PRELU, Sample((x, w)), (2, 2), [(S(0), S(1)), (R, S(0))])
    assert plan.match.in_targets == ((S(0), S(1)), (R, S(0))) and plan.out_placements == ((S(0), S(1)),)
    plan = check_sample(PRELU, Sample((x, w)), (2,), [(P,), (R,)])
    assert not isinstance(plan.out_placements[0][0], Partial)


@pytest.mark.parametrize("mesh", [(2,), (3,), (4,), (2, 2)])
def test_log_sigmoid_forward_keeps_output_and_buffer_sharded(mesh: tuple[int, ...]) -> None:
    x = rand(5, 3) * 4
    for d in (0, 1):
        pl = (S(d),) * len(mesh)
        plan = check_sample(LOGSIG, Sample((x,)), mesh, [pl])
        assert plan.match.in_targets == (pl,) and plan.out_placements == (pl, pl)


def test_log_sigmoid_forward_buffer_follows_the_device() -> None:
    # CUDA's kernel returns an empty (0,) buffer (the meta kernel models the CPU's full one): it is Replicate there
    x = rand(5, 3)
    for kind, buffer_shape, buffer_pl in (("cpu", (5, 3), S(0)), ("cuda", (0,), R)):
        mesh = DeviceMesh.from_shape(kind, (4,))
        call, _ = to_call(LOGSIG, Sample((x,)), mesh, [(S(0),)])
        plan = get_rule(LOGSIG).plan(call)
        assert tuple(plan.out_meta[1].shape) == buffer_shape
        assert plan.match.in_targets == ((S(0),),) and plan.out_placements == ((S(0),), (buffer_pl,))
