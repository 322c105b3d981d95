"""A ``torch.library.custom_op`` made distributed with the public ``torch_dtorch.register_rule`` decorator (the
example of docs/adding_an_op.md): the rule's signatures keep the op sharded, the workers run its body on shards."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import torch_dtorch as dt
from tests.eager.conftest import TEST_DEVICE, init_mesh
from torch_dtorch import Replicate, Shard
from torch_dtorch.placement_rules import OpCall, PlacementSignature, sig, unregister_rule

pytestmark = pytest.mark.skipif(TEST_DEVICE != "cpu", reason="the op's body uses numpy (CPU tensors)")


@torch.library.custom_op("dtorch_test::row_softsign", mutates_args=())
def row_softsign(x: torch.Tensor, scale: float) -> torch.Tensor:
    """``scale * x / (1 + |x|)`` row by row, through numpy: opaque to torch, so dtorch cannot decompose it."""
    a = x.detach().cpu().numpy()
    return torch.from_numpy(scale * a / (1.0 + np.abs(a))).to(x.dtype)


@row_softsign.register_fake
def _(x: torch.Tensor, scale: float) -> torch.Tensor:
    return torch.empty_like(x)


OP = torch.ops.dtorch_test.row_softsign.default


def _rule(call: OpCall) -> list[PlacementSignature]:
    """Elementwise: every dim may stay sharded (a Partial input is reduced first: the op is not linear)."""
    x = call.inputs[0]
    assert x is not None
    return [sig([Shard(d)], Shard(d)) for d in range(x.ndim)]


def test_custom_op_with_a_rule_runs_sharded() -> None:
    mesh = init_mesh((3,))
    z = torch.randn(7, 5)
    # without a rule, torch runs the body on the dtorch tensor: its .cpu() gathers, the result is a plain tensor
    plain = row_softsign(dt.distribute_tensor(z, mesh, [Shard(0)]), 2.0)
    assert plain.device.type == "cpu"
    dt.register_rule(OP, family="custom")(_rule)
    try:
        for placements in ([Shard(0)], [Shard(1)], [Replicate()]):
            x = dt.distribute_tensor(z, mesh, placements)
            y = row_softsign(x, 2.0)
            assert y.placements == x.placements  # no redistribute: each worker ran the body on its shard
            torch.testing.assert_close(y.full_tensor(), row_softsign(z, 2.0))
    finally:
        unregister_rule(OP)
