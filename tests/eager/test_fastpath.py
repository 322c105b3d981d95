"""The eager fast path (device/fastpath.py): repeated calls replay a cached plan and still equal torch."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

import torch_dtorch as dt
from tests.eager.conftest import init_mesh
from torch_dtorch import Partial, Replicate, Shard
from torch_dtorch.device import fastpath

aten = torch.ops.aten


def _stats_delta(fn: Callable[[], Any]) -> tuple[Any, dict[str, int]]:
    before = dict(fastpath.stats)
    out = fn()
    return out, {k: fastpath.stats[k] - before[k] for k in before}


CASES: list[tuple[str, Callable[[Any, Any], Any]]] = [
    ("add", lambda a, b: a + b),
    ("mm", lambda a, b: a @ b.t()),
    ("view", lambda a, b: a.view(-1)),
    ("transpose", lambda a, b: a.transpose(0, 1)),
    ("sum0", lambda a, b: a.sum(0)),
    ("sum1", lambda a, b: a.sum(1)),
    ("split", lambda a, b: a.split(2, dim=1)),
    ("mul_scalar_kw", lambda a, b: torch.mul(a, b).softmax(dim=-1)),
]


@pytest.mark.parametrize(("name", "fn"), CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize(
    "placements",
    [([Replicate()], [Replicate()]), ([Shard(0)], [Replicate()]), ([Shard(1)], [Shard(0)])],
    ids=["RR", "S0R", "S1S0"],
)
def test_replay_equals_torch(
    name: str, fn: Callable[[Any, Any], Any], placements: tuple[list[Any], list[Any]]
) -> None:
    mesh = init_mesh((3,))
    a, b = torch.randn(7, 5), torch.randn(7, 5)  # uneven over 3 devices
    da = dt.distribute_tensor(a, mesh, placements[0])
    db = dt.distribute_tensor(b, mesh, placements[1])
    want = fn(a, b)
    fn(da, db)  # first call: the full path (may record a template)
    for _ in range(3):  # replays
        got, delta = _stats_delta(lambda: fn(da, db))
        assert delta["miss"] == 0, f"{name}: the repeated call missed the fast path: {delta}"
        if isinstance(want, tuple):
            assert len(got) == len(want)
            for g, w in zip(got, want, strict=True):
                torch.testing.assert_close(dt.to_torch(g), w)
        else:
            torch.testing.assert_close(dt.to_torch(got), want)


def test_placement_change_takes_another_template() -> None:
    mesh = init_mesh((2,))
    a = torch.randn(4, 6)
    x_row = dt.distribute_tensor(a, mesh, [Shard(0)])
    x_col = dt.distribute_tensor(a, mesh, [Shard(1)])
    for _ in range(2):
        r, c = x_row.sum(0), x_col.sum(0)
        assert r.placements == (Partial(),) or r.placements == (Replicate(),)
        assert c.placements == (Shard(0),)
        torch.testing.assert_close(dt.to_torch(r), a.sum(0))
        torch.testing.assert_close(dt.to_torch(c), a.sum(0))


def test_constants_are_part_of_the_key() -> None:
    mesh = init_mesh((2,))
    a = torch.randn(4, 6)
    x = dt.distribute_tensor(a, mesh, [Replicate()])
    for k in (1.0, 2.0, 3.0):
        torch.testing.assert_close(dt.to_torch(torch.pow(x, k)), torch.pow(a, k))
    for shape in ((24,), (6, 4), (2, 12)):
        assert dt.to_torch(x.view(*shape)).shape == shape


def test_requires_grad_flows_on_replay() -> None:
    from torch_dtorch.device.dispatch import operand_of

    mesh = init_mesh((2,))
    w = dt.distribute_tensor(torch.randn(4, 4), mesh, [Replicate()])
    v = dt.distribute_tensor(torch.randn(4, 4), mesh, [Replicate()])
    operand_of(v).requires_grad = True  # as for an operand produced from a grad-requiring value
    for _ in range(3):  # first call full path, then replays: the flag follows the inputs every time
        assert operand_of(v + w).requires_grad
        assert not operand_of(w + w).requires_grad


def test_constants_never_collide_with_layouts_or_other_types() -> None:
    """A cached template is keyed by input layout ids (ints) and constants: ``x + x`` must not serve
    ``x + float(layout id of x)``, nor ``i + 1`` serve ``i + 1.0`` or ``i + True`` (different promotion)."""
    from torch_dtorch.device.tensors import TABLE

    mesh = init_mesh((2,))
    x = dt.distribute_tensor(torch.arange(4.0), mesh, [Shard(0)])
    i = dt.distribute_tensor(torch.arange(4), mesh, [Shard(0)])
    for _ in range(2):
        torch.testing.assert_close((x + x).full_tensor(), torch.arange(4.0) * 2)
        assert (i + i).full_tensor().tolist() == [0, 2, 4, 6]
    lx, li = TABLE.entry(x).layout, TABLE.entry(i).layout  # type: ignore[union-attr]
    assert isinstance(lx, int) and isinstance(li, int)
    for _ in range(2):
        torch.testing.assert_close((x + float(lx)).full_tensor(), torch.arange(4.0) + lx)
        assert (i + li).full_tensor().tolist() == [li, li + 1, li + 2, li + 3]
        assert (i + 1).full_tensor().dtype == torch.int64
        assert (i + 1.0).full_tensor().dtype == torch.float32
        assert (i + True).full_tensor().tolist() == [1, 2, 3, 4]
        assert x.view([2, 2]).shape == (2, 2) and x.view([4]).shape == (4,)


def _same_bits(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Equal values, signs of zeros and NaNs where torch has them (``torch.equal`` alone takes ``-0.0 == 0.0`` and
    ``nan != nan``), in thread and process mode (the wire sends a NaN constant's bytes)."""
    nan = want.isnan()
    signs = got.signbit() == want.signbit()
    return (
        torch.equal(got.isnan(), nan)
        and bool(signs.all())
        and torch.equal(got.masked_fill(nan, 0), want.masked_fill(nan, 0))
    )


SIGNED_CONSTANTS: list[tuple[str, Callable[[Any, float], Any]]] = [
    ("mul", lambda a, c: a * c),
    ("mul_scalar", lambda a, c: torch.ops.aten.mul.Scalar(a, c)),
    ("full_like_kw", lambda a, c: torch.full_like(a, fill_value=c)),
    ("add_alpha_kw", lambda a, c: torch.add(a, a, alpha=c)),
]


@pytest.mark.parametrize(("name", "fn"), SIGNED_CONSTANTS, ids=[c[0] for c in SIGNED_CONSTANTS])
def test_signed_zeros_and_nans_are_distinct_constants(name: str, fn: Callable[[Any, float], Any]) -> None:
    """``x * -0.0`` after ``x * 0.0`` must not replay the ``+0.0`` call (``0.0 == -0.0`` in Python), and a NaN
    constant hits its own template (``nan != nan``) instead of missing every time."""
    mesh = init_mesh((2,))
    a = torch.tensor([[1.5, -2.0, 0.0], [-0.0, 3.0, -1.0]])
    x = dt.distribute_tensor(a, mesh, [Shard(0)])
    nan = float("nan")
    for round_ in range(3):
        for c in (0.0, -0.0, nan, -nan, 1.0):
            got, delta = _stats_delta(lambda c=c: dt.to_torch(fn(x, c)))
            want = fn(a, c)
            assert _same_bits(got, want), f"{name}({c}) round {round_}: {got} vs torch {want}"
            if round_:
                assert delta["miss"] == 0, f"{name}({c}) missed the fast path in round {round_}: {delta}"


def test_signed_complex_constants_are_distinct() -> None:
    """Complex constants too: ``z * complex(-0.0, -0.0)`` after ``z * 0j`` keeps its signs of zeros, in thread mode
    (the plan cache key) and process mode (the wire's template key and constant)."""
    mesh = init_mesh((2,))
    a = torch.tensor([[1.5 - 2.0j, 0.5j], [-3.0 + 0.0j, 1.0 + 1.0j]])
    z = dt.distribute_tensor(a, mesh, [Shard(0)])
    nan = float("nan")
    for _ in range(2):
        for c in (0j, complex(-0.0, -0.0), complex(-nan, 1.0), complex(nan, 1.0)):
            got, want = dt.to_torch(z * c), a * c
            for part in ("real", "imag"):
                g, w = getattr(got, part), getattr(want, part)
                assert _same_bits(g, w), f"z * {c}: {part} {g} vs torch {w}"


def test_int_and_float_constants_plan_apart() -> None:
    """The plan cache keys numbers by type too: ``i + 1.0`` first must not give ``i + 1`` a float output (or the
    reverse)."""
    mesh = init_mesh((1,))
    i = dt.distribute_tensor(torch.arange(15).view(5, 3), mesh, [Replicate()])
    j = dt.distribute_tensor(torch.arange(14).view(7, 2), mesh, [Replicate()])
    for _ in range(2):
        for t, ref in ((i, torch.arange(15).view(5, 3)), (j, torch.arange(14).view(7, 2))):
            for c in (1.0, 1) if t is i else (1, 1.0):
                y, want = t + c, ref + c
                assert y.dtype == want.dtype, (c, y.dtype)  # the operand's metadata (the plan's)
                assert torch.equal(y.full_tensor(), want)
