"""The eager fast path of factories (``device/fastpath_factory.py``, issue 23): ``arange``/``full``/``scalar_tensor``
hit after their first call — under ``with mesh:`` and without a mesh (bound at once where the first call's consumer
bound it) — with values that change every call (``arange(past, past + 1)``, ``full(shape, value)``,
``scalar_tensor(value)``): the values are no part of the key, each run carries its own, and every result equals
torch's (thread mode: the workers resolve such a plan per values; process mode: its hit templates are keyed by
them). Values torch refuses still raise."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

import torch_dtorch as dt
from tests.eager.conftest import init_mesh
from torch_dtorch import Replicate, Shard
from torch_dtorch.device import fastpath


@pytest.fixture(scope="module")
def mesh() -> Iterator[dt.DeviceMesh]:
    yield init_mesh((2,))


def _misses() -> int:
    return fastpath.stats["miss"]


def _check(
    mesh: dt.DeviceMesh, make: Callable[..., torch.Tensor], values: list[Any], *, scoped: bool
) -> None:
    """``make(v, device)`` for every ``v`` equals torch's; after the first, none misses. Each result is used by an
    op next to a distributed tensor (an unbound one binds there) and fetched."""
    x = dt.distribute_tensor(torch.zeros(2), mesh, [Shard(0)])
    for i, v in enumerate(values):
        want = make(v, torch.device("cpu"))
        before = _misses()
        if scoped:
            with mesh:
                got = make(v, x.device)
        else:
            (x + 1).sum()  # the last op ran on ``mesh`` (where a factory with no mesh in sight goes)
            before = _misses()
            got = make(v, x.device)
        made = _misses() - before
        used = got * 1 if got.dtype != torch.bool else got & True  # a consumer: binds an unbound result
        assert got.dtype == want.dtype and got.shape == want.shape
        assert torch.equal(dt.to_torch(used).cpu(), want), (v, dt.to_torch(used), want)
        if i >= 2:  # (the first call plans; without a mesh the second learns where its consumer bound it)
            assert made == 0, (v, made)


@pytest.mark.parametrize("scoped", [True, False], ids=["with_mesh", "no_mesh"])
def test_arange_moving_window(mesh: dt.DeviceMesh, scoped: bool) -> None:
    """``arange(past, past + 1)`` (HF's cache position) and wider windows: one template per length."""
    _check(mesh, lambda v, d: torch.arange(v, v + 1, device=d), list(range(3, 12)), scoped=scoped)
    _check(mesh, lambda v, d: torch.arange(v, v + 5, 2, device=d), [0, 7, -4, 100, 2**40], scoped=scoped)
    _check(mesh, lambda v, d: torch.arange(v, v - 6, -3, device=d), [9, 4, -1, 30], scoped=scoped)
    _check(
        mesh, lambda v, d: torch.arange(v, v + 3, dtype=torch.float32, device=d), [1, 5, 2**30], scoped=scoped
    )
    _check(mesh, lambda v, d: torch.arange(v, device=d), [4, 4, 4], scoped=scoped)
    _check(mesh, lambda v, d: torch.arange(v, device=d), [6], scoped=scoped)  # a new length: its own template


@pytest.mark.parametrize("scoped", [True, False], ids=["with_mesh", "no_mesh"])
def test_full_changing_value(mesh: dt.DeviceMesh, scoped: bool) -> None:
    _check(mesh, lambda v, d: torch.full((2, 3), v, device=d), [1.5, -0.0, 2.5, math.inf, 7.0], scoped=scoped)
    _check(
        mesh,
        lambda v, d: torch.full((1,), v, dtype=torch.bool, device=d),
        [False, True, False],
        scoped=scoped,
    )
    _check(mesh, lambda v, d: torch.full((3,), v, device=d), [1, -5, 2**62, 0], scoped=scoped)
    _check(
        mesh,
        lambda v, d: torch.full((2,), v, dtype=torch.float16, device=d),
        [1, 3, 65504, -7],
        scoped=scoped,
    )
    nan = torch.full((2,), math.nan)
    x = dt.distribute_tensor(torch.zeros(2), mesh, [Replicate()])
    for v in (1.0, 2.0, math.nan):  # (NaN != NaN: checked by its bits)
        got = dt.to_torch(torch.full((2,), v, device=x.device) + x).cpu()
        assert torch.equal(got.isnan(), nan.isnan()) if v != v else torch.equal(got, torch.full((2,), v))


@pytest.mark.parametrize("scoped", [True, False], ids=["with_mesh", "no_mesh"])
def test_scalar_tensor_changing_value(mesh: dt.DeviceMesh, scoped: bool) -> None:
    _check(mesh, lambda v, d: torch.scalar_tensor(v, device=d), [-math.inf, 0.5, -2.0, 3.0], scoped=scoped)
    _check(
        mesh,
        lambda v, d: torch.scalar_tensor(v, dtype=torch.int64, device=d),
        [1, 2**40, -7, 3],
        scoped=scoped,
    )
    _check(mesh, lambda v, d: torch.tensor(v, device=d), [0.25, 1.0, -3.5], scoped=scoped)  # (scalar_tensor)


def test_refused_values_still_raise(mesh: dt.DeviceMesh) -> None:
    """A fill value torch cannot convert fails after warm hits as on the full path: the workers' kernel raises it
    (a sticky error when fetched); an ``arange`` torch refuses raises at once."""
    with mesh:
        for v in (1, 2, 3):
            torch.full((1,), v, dtype=torch.uint8, device="dtorch")
            torch.full((1,), float(v), dtype=torch.float32, device="dtorch")
            torch.full((2,), v, dtype=torch.float16, device="dtorch")
            torch.arange(v, v + 2, 2, device="dtorch")
        for bad in (
            lambda: torch.full((1,), 300, dtype=torch.uint8, device="dtorch"),
            lambda: torch.full((1,), 1e300, dtype=torch.float32, device="dtorch"),
            lambda: torch.full((2,), 70000, dtype=torch.float16, device="dtorch"),
        ):
            with pytest.raises(RuntimeError, match="without overflow"):
                dt.to_torch(bad())
        with pytest.raises(ValueError, match="inconsistent with step sign"):
            torch.arange(5, 4, 2, device="dtorch")


def test_factory_follows_its_consumer_mesh() -> None:
    """A factory made with no mesh in sight binds where its consumer bound it before; one whose results went to
    two meshes (two pools: pipeline stages) stays deferred and binds to each consumer's mesh."""
    a = init_mesh((2,))
    b = init_mesh((1,))
    xa = dt.distribute_tensor(torch.ones(4), a, [Shard(0)])
    xb = dt.distribute_tensor(torch.ones(4), b, [Replicate()])
    for i in range(4):
        (xa + 1).sum()  # the last op ran on ``a``'s root
        r = torch.arange(i, i + 4, device=xa.device)
        out = xa * r if i % 2 == 0 else xb * r
        assert dt.to_torch(out).cpu().tolist() == list(map(float, range(i, i + 4)))
    for i in range(4):  # consumers always on ``a``: bound at once there
        (xa + 1).sum()
        r = torch.full((4,), float(i), device=xa.device)
        assert dt.to_torch(xa + r).cpu().tolist() == [1.0 + i] * 4


def test_a_factory_bound_on_another_mesh_moves_again_in_the_backward() -> None:
    """A factory the fast path bound at once on the last op's mesh, then consumed next to a tensor of another mesh,
    is moved there — and autograd saved the factory result itself for the backward, which meets it again: it moves
    again (it used to raise "inputs live on different device meshes" there)."""
    a = init_mesh((2,))
    b = init_mesh((4,))
    xa = dt.distribute_tensor(torch.ones(4), a, [Shard(0)])
    xb = dt.distribute_tensor(torch.arange(4.0), b, [Shard(0)]).requires_grad_()
    for _ in range(3):  # consumed on ``a`` after an op on ``a``: learned there, then bound there at once
        (xa + 1).sum()
        assert dt.to_torch(xa * torch.full((), 2.0, device=xa.device)).cpu().tolist() == [2.0] * 4
    for i in range(3):
        (xa + 1).sum()  # the last op ran on ``a`` again: the factory is bound on ``a`` at once
        z = torch.full((), float(i + 1), device=xa.device)
        y = xb * z  # consumed on ``b``: moved for the op; autograd saves ``z`` itself
        y.sum().backward()
        assert dt.to_torch(y).cpu().tolist() == [float(k * (i + 1)) for k in range(4)]
        assert dt.to_torch(xb.grad).cpu().tolist() == [float(i + 1)] * 4
        xb.grad = None


def test_an_upload_is_the_mesh_a_factory_binds_to() -> None:
    """``dt.distribute_tensor`` makes its mesh the one a mesh-less factory made next is bound to, as an op does:
    a script that moves to a new mesh does not bind its first factories on the old one."""
    from torch_dtorch.device.state import get_session

    a = init_mesh((2,))
    b = init_mesh((3,))
    (dt.distribute_tensor(torch.ones(4), a, [Shard(0)]) + 1).sum()
    dt.distribute_tensor(torch.ones(3), b, [Shard(0)])
    assert get_session().last_mesh is b


def test_an_eager_factory_result_is_forgotten_when_it_dies() -> None:
    """The mark that lets a consumer on another mesh move an eager-bound factory result lives as long as the tensor
    (it used to be the last 1,024 marks: one saved for a long backward could lose it)."""
    from torch_dtorch.device import binding
    from torch_dtorch.device.tensors import TABLE

    a = init_mesh((2,))
    xa = dt.distribute_tensor(torch.ones(4), a, [Shard(0)])
    ids = []
    for _ in range(4):
        (xa + 1).sum()
        z = torch.full((), 3.0, dtype=torch.float64, device=xa.device)  # (a key no other test teaches)
        ids.append(TABLE.lookup(z, dt.device.state.get_session().generation).id)
        assert dt.to_torch(xa * z).cpu().tolist() == [3.0] * 4
    assert ids[-1] in binding._EAGER  # bound at once (after the first calls taught the key)
    del z
    dt.sync()
    assert ids[-1] not in binding._EAGER
