"""The eager fast path beyond single-tensor arguments (issue 20): tensor lists (``cat``/``stack``), the ``to``
conversions, consumers of unbound factories (``torch.arange(n, device=x.device)``), and their replay on the
workers. Every repeated call must hit, plan nothing, and equal torch."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
import torch

import torch_dtorch as dt
from tests.eager.conftest import TEST_MODE, init_mesh
from torch_dtorch import Replicate, Shard
from torch_dtorch.device import fastpath
from torch_dtorch.device.state import get_session


def _planned_and_hits(fn: Callable[[], Any]) -> tuple[Any, int, int]:
    constructor = get_session().executor.constructor
    planned, hits = constructor.num_planned, fastpath.stats["hit"]
    out = fn()
    return out, constructor.num_planned - planned, fastpath.stats["hit"] - hits


def _general(mesh: dt.DeviceMesh) -> Counter[str]:
    """Ops run on the general local path so far, summed over the mesh's workers (thread mode)."""
    dt.sync()
    workers = get_session().executor.runner.workers.values()
    return sum((Counter(w.general) for w in workers if w.device in mesh.devices), Counter())


CASES: list[tuple[str, Callable[[Any, Any], Any]]] = [
    ("cat_last", lambda a, b: torch.cat([a, b, a * 2], dim=-1)),
    ("cat_sharded_dim", lambda a, b: torch.cat([a, b], dim=0)),  # a Shard(0) input moves first
    ("cat_same_tensor_twice", lambda a, b: torch.cat([a, a], dim=1)),
    ("stack", lambda a, b: torch.stack([a, b], dim=-1)),
    ("to_dtype_layout", lambda a, b: a.to(dtype=torch.float64, device=a.device)),
    ("to_same_dtype", lambda a, b: a.to(device=a.device, dtype=torch.float32) + b),
    ("dropout_eval", lambda a, b: torch.nn.functional.dropout(a, p=0.3, training=False) + b),
    ("arange_consumer", lambda a, b: a * torch.arange(5, device=a.device, dtype=torch.float32)),
    (
        "arange_alone_consumer",
        lambda a, b: torch.arange(0, 10, 2, device=a.device, dtype=torch.float64) / 4 + 0,
    ),
]


@pytest.mark.parametrize(("name", "fn"), CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("placements", [[Replicate()], [Shard(0)]], ids=["R", "S0"])
def test_repeated_calls_hit_and_equal_torch(
    name: str, fn: Callable[[Any, Any], Any], placements: Any
) -> None:
    mesh = init_mesh((2,))
    a, b = torch.randn(6, 5), torch.randn(6, 5)
    da, db = dt.distribute_tensor(a, mesh, placements), dt.distribute_tensor(b, mesh, placements)
    want = fn(a, b)
    with mesh:
        fn(da, db)  # the first call plans (and teaches the fast path)
        for _ in range(3):
            got, planned, hits = _planned_and_hits(lambda: fn(da, db))
            assert planned == 0 and hits > 0, (name, planned, hits)
            assert got.dtype == want.dtype and got.shape == want.shape
            assert torch.equal(dt.to_torch(got), want), name


@pytest.mark.skipif(TEST_MODE != "thread", reason="reads the workers' counters")
def test_workers_replay_lists_conversions_and_factories() -> None:
    mesh = init_mesh((2,))
    a = dt.distribute_tensor(torch.randn(4, 6), mesh, [Shard(0)])
    b = dt.distribute_tensor(torch.randn(4, 6), mesh, [Shard(0)])

    def step() -> torch.Tensor:
        c = torch.cat([a, b], dim=1)
        s = torch.stack([a, b], dim=0).sum(0)
        d = torch.nn.functional.dropout(c, p=0.5, training=False)
        r = torch.arange(12, device=a.device, dtype=torch.float32)
        m = torch.stack([a, b]).mean(0).amax(-1, keepdim=True)
        return (d * r + m).to(dtype=torch.float64, device=a.device) + s.repeat(1, 2)

    want = dt.to_torch(step())
    step()
    before = _general(mesh)
    got = step()
    assert _general(mesh) == before  # every op of the step replayed
    assert torch.equal(dt.to_torch(got), want)


def test_dropout_in_training_draws_a_new_mask_on_every_hit() -> None:
    """``dropout`` in training (``0 < p < 1``) has its own kernel (a global mask): a hit must not replay it as the
    op with the first call's mask, nor as the identity."""
    mesh = init_mesh((2,))
    x = torch.randn(64, 8).abs() + 1
    dx = dt.distribute_tensor(x, mesh, [Shard(0)])
    masks = []
    for _ in range(4):
        got = dt.to_torch(torch.nn.functional.dropout(dx, p=0.5, training=True))
        kept = got != 0
        assert torch.equal(got[kept], x[kept] * 2)
        assert 0 < int(kept.sum()) < x.numel()
        masks.append(kept)
    assert any(not torch.equal(masks[0], m) for m in masks[1:])
