"""The eager fast path on gapped inputs (strides that leave holes, ``ids[:, -1:]`` of a growing ``[B, L]``): a
non-view op's template serves every raw stride of the input's stride pattern (one plan for all decode steps),
while views, whose outputs carry the input's strides, keep planning per raw stride. Values and strides equal
plain torch either way. (Strides are the operands' — the global metadata the rules and keys see; the device's
tensors themselves report contiguous strides.)"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

import torch_dtorch as dt
from tests.eager.conftest import init_mesh
from torch_dtorch import Replicate, Shard
from torch_dtorch.device.dispatch import operand_of
from torch_dtorch.device.state import get_session


def _stride(t: torch.Tensor) -> tuple[int, ...] | None:
    return operand_of(t).stride


def _planned(fn: Callable[[], torch.Tensor]) -> tuple[torch.Tensor, int]:
    constructor = get_session().executor.constructor
    before = constructor.num_planned
    out = fn()
    return out, constructor.num_planned - before


_NON_VIEW: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "add": lambda x: x + 1,
    "clone": lambda x: x.clone(memory_format=torch.contiguous_format),
    "isin": lambda x: torch.isin(x, torch.tensor([3, 5], device=x.device)),
    "mul_row": lambda x: x * torch.ones(1, 1, dtype=x.dtype, device=x.device),
}


@pytest.mark.parametrize("name", sorted(_NON_VIEW))
@pytest.mark.parametrize("shards", [False, True], ids=["replicate", "shard0"])
def test_non_view_op_plans_once_per_stride_pattern(name: str, shards: bool) -> None:
    op = _NON_VIEW[name]
    mesh = init_mesh((2,) if shards else (1,))
    planned = []
    for length in range(6, 12):
        full = torch.arange(2 * length).reshape(2, length)
        x = dt.distribute_tensor(full, mesh, [Shard(0) if shards else Replicate()])
        last = x[:, -1:]  # [2, 1], strides (length, 1): new raw strides every step, one pattern
        assert _stride(last) == full[:, -1:].stride()
        out, n = _planned(lambda last=last: op(last))  # type: ignore[misc]
        ref = op(full[:, -1:])
        assert _stride(out) == ref.stride() and out.dtype == ref.dtype
        assert torch.equal(out.cpu(), ref)
        planned.append(n)
    assert planned[0] >= 1 and sum(planned[1:]) == 0, planned


def test_views_of_gapped_inputs_keep_their_strides() -> None:
    """A view of a gapped input replays nothing across raw strides: each output's strides are torch's."""
    mesh = init_mesh((1,))
    for length in range(6, 10):
        full = torch.arange(3 * length, dtype=torch.float32).reshape(3, length)
        x = dt.distribute_tensor(full, mesh, [Replicate()])
        for fn in (
            lambda t: t[:, -2:].unsqueeze(0),
            lambda t: t[:, -2:].t(),
            lambda t: t[:, -2:].transpose(0, 1)[1:],
            lambda t: t[:, -2:][:, :1].squeeze(1),
        ):
            got, ref = fn(x), fn(full)
            assert got.shape == ref.shape and _stride(got) == ref.stride(), (
                length,
                _stride(got),
                ref.stride(),
            )
            assert torch.equal(got.cpu(), ref)
