"""Tensors made on ``dtorch`` with no mesh bound yet (a mesh is up, but no op has run on it): unbound Replicate values
that bind to the mesh of their first consumer. Regression: ``torch.tensor(3, device=x.device).to(x.device)`` (HF's
``pad_token_id.to(input_ids.device)``) recursed forever in the device kernel that computes unbound-only ops on the
controller."""

from __future__ import annotations

import pytest
import torch

import torch_dtorch as dt
from tests.eager.conftest import init_mesh
from torch_dtorch import Shard


@pytest.fixture
def fresh_mesh() -> dt.DeviceMesh:
    """A new pool, so no op has bound a mesh yet (the state HF ``generate`` starts from on a fresh model)."""
    dt.shutdown()
    return init_mesh((2,))


def test_scalar_factory_to_same_device(fresh_mesh: dt.DeviceMesh) -> None:
    x = dt.distribute_tensor(torch.arange(6.0).reshape(2, 3), fresh_mesh, [Shard(0)])
    t = torch.tensor(3, device=x.device).to(x.device)
    assert t.device.type == "dtorch" and t.shape == ()
    out = x + t
    assert out.placements == (Shard(0),)
    torch.testing.assert_close(out.full_tensor(), torch.arange(6.0).reshape(2, 3) + 3)
    assert dt.to_torch(t).item() == 3


@pytest.mark.parametrize(
    "convert",
    [
        lambda t, d: t.to(d),
        lambda t, d: t.to(d, torch.float32),
        lambda t, d: t.to(device=d, dtype=torch.float64),
        lambda t, d: t.to(str(d)),
        lambda t, d: t.to(torch.float16),
    ],
    ids=["to_device", "to_device_dtype", "to_kwargs", "to_str", "to_dtype"],
)
def test_unbound_conversions_match_torch(fresh_mesh: dt.DeviceMesh, convert: object) -> None:
    """Every ``to`` form on an unbound value gives torch's value and dtype, then binds to its consumer's mesh."""
    x = dt.distribute_tensor(torch.ones(4), fresh_mesh, [Shard(0)])
    want = convert(torch.tensor([5, 7]), torch.device("cpu"))  # type: ignore[operator]
    got = convert(torch.tensor([5, 7], device=x.device), x.device)  # type: ignore[operator]
    assert got.dtype == want.dtype
    assert torch.equal(dt.to_torch(got).cpu(), want.cpu())  # (the CUDA suite's default device is the GPU)
    total = x.sum() + got.sum()
    torch.testing.assert_close(total.full_tensor().cpu(), (torch.ones(4).sum() + want.sum()).cpu())


def test_unbound_chain_binds_to_first_consumer(fresh_mesh: dt.DeviceMesh) -> None:
    """Unbound-only ops (arithmetic, comparisons) stay unbound on the controller until a distributed tensor uses
    them."""
    x = dt.distribute_tensor(torch.arange(4.0), fresh_mesh, [Shard(0)])
    pad = torch.tensor(2, device=x.device).to(x.device)
    eos = torch.tensor([2, 3], device=x.device)
    is_pad = torch.isin(pad, eos)  # what generate's special-token checks do
    assert bool(is_pad.item())
    y = torch.where(x > pad, x, pad.to(x.dtype))
    assert y.placements == (Shard(0),)
    torch.testing.assert_close(y.full_tensor(), torch.tensor([2.0, 2.0, 2.0, 3.0]))
