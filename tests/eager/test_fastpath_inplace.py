"""In-place ops on the eager fast path (device/fastpath.py, ``FastOp.written``): a hit returns the written tensor
itself, writes its shards where they are, and equals torch (placements, uneven shards, 2-D meshes, views of the
written tensor, repeated operands, autograd's checks)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

import torch_dtorch as dt
from tests.eager.conftest import TEST_MODE, init_mesh
from torch_dtorch import Replicate, Shard
from torch_dtorch.device import fastpath

aten = torch.ops.aten


def _hits(fn: Callable[[], Any]) -> tuple[Any, int, int]:
    h, m = fastpath.stats["hit"], fastpath.stats["miss"]
    out = fn()
    return out, fastpath.stats["hit"] - h, fastpath.stats["miss"] - m


OPS: list[tuple[str, Callable[[Any, Any], Any]]] = [
    ("add_", lambda x, y: x.add_(y)),
    ("add_alpha", lambda x, y: x.add_(y, alpha=-0.5)),
    ("mul_scalar", lambda x, y: x.mul_(1.5)),
    ("sub_", lambda x, y: x.sub_(y)),
    ("copy_", lambda x, y: x.copy_(y)),
    ("add_self", lambda x, y: x.add_(x)),
    ("mul_self", lambda x, y: x.mul_(x)),
    ("lerp_", lambda x, y: x.lerp_(y, 0.25)),
    ("zero_", lambda x, y: x.zero_()),
    ("fill_", lambda x, y: x.fill_(3.0)),
    ("clamp_", lambda x, y: x.clamp_(-0.5, 0.5)),
    ("addcmul_", lambda x, y: x.addcmul_(y, y, value=0.1)),
]

PLACEMENTS = [
    ((2,), [Replicate()], [Replicate()]),
    ((2,), [Shard(0)], [Replicate()]),
    ((2,), [Shard(0)], [Shard(0)]),
    ((2,), [Shard(1)], [Shard(0)]),  # y moves to x's placements on every hit
    ((2, 2), [Shard(0), Shard(1)], [Replicate(), Replicate()]),
    ((2, 2), [Replicate(), Shard(0)], [Shard(1), Replicate()]),
]


@pytest.mark.parametrize(("name", "fn"), OPS, ids=[o[0] for o in OPS])
@pytest.mark.parametrize(("shape", "px", "py"), PLACEMENTS, ids=lambda p: str(p))
def test_in_place_hits_equal_torch(
    name: str, fn: Callable[[Any, Any], Any], shape: tuple[int, ...], px: list[Any], py: list[Any]
) -> None:
    mesh = init_mesh(shape)
    a, b = torch.randn(5, 7), torch.randn(5, 7)  # uneven on both dims
    x = dt.distribute_tensor(a.clone(), mesh, px)
    y = dt.distribute_tensor(b.clone(), mesh, py)
    ref = a.clone()
    placements = x.placements
    hits = 0
    for i in range(3):
        v0 = x._version
        out, h, _ = _hits(lambda: fn(x, y))
        fn(ref, b)
        assert out is x
        assert x._version > v0
        assert x.placements == placements
        if i:
            hits += h
    assert hits >= 2, f"{name}: in-place op never hit the fast path"
    torch.testing.assert_close(x.full_tensor(), ref)
    torch.testing.assert_close(y.full_tensor(), b)


@pytest.mark.parametrize("px", [[Replicate()], [Shard(0)], [Shard(1)]], ids=str)
def test_views_of_the_written_tensor_see_the_write(px: list[Any]) -> None:
    mesh = init_mesh((2,))
    a = torch.randn(6, 4)
    x = dt.distribute_tensor(a.clone(), mesh, px)
    ref = a.clone()
    whole = x.view(6, 2, 2)  # keeps every placement here: a view on the workers too
    for _ in range(3):
        x.add_(1.0)
        ref.add_(1.0)
    torch.testing.assert_close(whole.full_tensor(), ref.view(6, 2, 2))
    # writing through a view (kept placements) reaches the base
    col = x[:, 1:3] if px != [Shard(1)] else x[1:3]
    rcol = ref[:, 1:3] if px != [Shard(1)] else ref[1:3]
    for _ in range(3):
        _, h, _ = _hits(lambda: col.mul_(2.0))
        rcol.mul_(2.0)
    assert h == 1
    torch.testing.assert_close(x.full_tensor(), ref)
    torch.testing.assert_close(col.full_tensor(), rcol)


def test_write_to_a_view_of_a_redistributed_copy_still_raises() -> None:
    """The full path refuses a write that would not reach the base; a hit must refuse it too."""
    mesh = init_mesh((2,))
    x = dt.distribute_tensor(torch.randn(6, 4), mesh, [Shard(0)])
    y = dt.distribute_tensor(torch.randn(6, 4), mesh, [Shard(0)])
    ok = y[:, :2]  # keeps Shard(0): teaches the template of add_ on this layout
    for _ in range(2):
        ok.add_(1.0)
    bad = x[1:3]  # slices the sharded dim: a view of a redistributed copy
    with pytest.raises(NotImplementedError, match="would not reach the original tensor"):
        for _ in range(2):
            bad.add_(1.0)


def test_requires_grad_leaf_raises_as_torch() -> None:
    mesh = init_mesh((2,))
    w = dt.distribute_tensor(torch.randn(4, 4), mesh, [Shard(0)]).requires_grad_()
    t = torch.randn(4, 4, requires_grad=True)
    for _ in range(3):
        with pytest.raises(RuntimeError, match="leaf Variable that requires grad") as e:
            w.add_(1.0)
        with pytest.raises(RuntimeError) as ref:
            t.add_(1.0)
        assert str(e.value) == str(ref.value)
    with torch.no_grad():  # what optimizers do
        for _ in range(3):
            assert w.add_(1.0) is w
    assert w.requires_grad and w.grad_fn is None


def test_in_place_on_a_non_leaf_keeps_autograd() -> None:
    mesh = init_mesh((2,))
    a = torch.randn(4, 4)
    for _ in range(3):
        w = dt.distribute_tensor(a.clone(), mesh, [Shard(0)]).requires_grad_()
        h = w * 2.0
        h.mul_(3.0)
        h.sum().backward()
        torch.testing.assert_close(w.grad.full_tensor(), torch.full((4, 4), 6.0))


def test_scalar_tensor_argument_and_unbound_self() -> None:
    mesh = init_mesh((2,))
    a = torch.randn(4, 4)
    x = dt.distribute_tensor(a.clone(), mesh, [Shard(0)])
    ref = a.clone()
    for k in range(3):
        s = torch.tensor(float(k + 1))
        assert x.mul_(s) is x
        ref.mul_(s)
    torch.testing.assert_close(x.full_tensor(), ref)
    hits = 0
    for _ in range(3):  # an unbound self (made without a mesh) is materialized, written and rebound
        u = torch.zeros(4, 4, device=x.device)
        v = u.view(16)
        out, h, _ = _hits(lambda u=u: u.add_(x))  # type: ignore[misc]
        hits += h
        assert out is u
        assert u.placements == (Shard(0),) or u.placements == (Replicate(),)
        torch.testing.assert_close(u.full_tensor(), ref)
        torch.testing.assert_close(v.full_tensor(), ref.view(16))  # an alias of the storage is rebound too
    assert hits >= 2
    with mesh:  # both unbound (autograd's zeros in a backward): the mesh in sight
        for _ in range(3):
            a0 = torch.ones(2, 3, device=x.device)
            b0 = torch.full((2, 3), 2.0, device=x.device)
            assert a0.add_(b0) is a0
            torch.testing.assert_close(a0.full_tensor(), torch.full((2, 3), 3.0))


@pytest.mark.skipif(TEST_MODE == "process", reason="patches the rule's kernel in this process's workers")
def test_sticky_error_reaches_the_written_tensor() -> None:
    """A kernel failing on the workers poisons the written tensor on a hit as on the full path."""
    from torch_dtorch.placement_rules import get_rule

    mesh = init_mesh((2,))
    x = dt.distribute_tensor(torch.randn(4, 4), mesh, [Shard(0)])
    y = dt.distribute_tensor(torch.randn(4, 4), mesh, [Shard(0)])
    for _ in range(2):
        x.add_(y)
    dt.sync()
    rule = get_rule(aten.add_.Tensor)

    def boom(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("boom")

    rule.kernel = boom  # type: ignore[method-assign]
    try:
        _, h, _ = _hits(lambda: x.add_(y))
        assert h == 1
        with pytest.raises(Exception, match="boom"):
            x.full_tensor()
    finally:
        del rule.kernel
    assert y.full_tensor().shape == (4, 4)  # unrelated tensors keep working
