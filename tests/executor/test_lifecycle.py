"""Memory and lifecycle: freed operands leave the workers, uploads of shards, minimal fetches, shutdown."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch

from tests.executor.conftest import MakeExecutor
from torch_dtorch.executor.eager import EagerGraphExecutor
from torch_dtorch.executor.instructions import Fetch
from torch_dtorch.executor.thread_runner import ThreadRunner
from torch_dtorch.mesh import DeviceMesh
from torch_dtorch.placement import Partial, Replicate, Shard
from torch_dtorch.runtime import op_runner as kernel_module

aten = torch.ops.aten


def test_long_loop_with_frees_keeps_blobs_bounded(make_executor: MakeExecutor) -> None:
    ex, mesh = make_executor((2,))
    peak = dict.fromkeys(mesh.devices, 0)
    workers = ex.runner.workers

    def track(instr: Any, device: int) -> None:
        n = len(workers[device].blobs)
        if n > peak[device]:
            peak[device] = n

    kernel_module.after_hooks.append(track)
    x = ex.input((4, 3), mesh, [Shard(0)])
    ex.upload(x, torch.ones(4, 3))
    y = x
    num_ops = 10_000
    for _ in range(num_ops):
        z = ex.call(aten.add.Tensor, y, x)
        if y is not x:
            ex.free(y)
        y = z
    assert torch.equal(ex.fetch(y).get(timeout=120), torch.full((4, 3), num_ops + 1.0))
    ex.free(y)
    ex.sync()
    # x, the previous value and the new one (each Free directly follows the op that last reads it)
    assert all(p <= 3 for p in peak.values()), peak
    assert all(len(w.blobs) == 1 for w in workers.values())  # only x is left
    assert all(w.executed >= num_ops for w in workers.values())


def test_upload_shards_from_local(make_executor: MakeExecutor) -> None:
    ex, mesh = make_executor((3,))
    shards = {0: torch.randn(3, 2), 1: torch.randn(3, 2), 2: torch.randn(1, 2)}
    x = ex.input((7, 2), mesh, [Shard(0)])
    ex.upload_shards(x, shards)
    assert torch.equal(ex.fetch(x).get(timeout=30), torch.cat([shards[0], shards[1], shards[2]]))
    p = ex.input((2, 2), mesh, [Partial()])
    parts = {d: torch.randn(2, 2) for d in range(3)}
    ex.upload_shards(p, parts)
    torch.testing.assert_close(ex.fetch(p).get(timeout=30), parts[0] + parts[1] + parts[2])
    with pytest.raises(ValueError, match=r"device 2 .* needs float32\[1, 2\], got float32\[3, 2\]"):
        ex.upload_shards(x, {**shards, 2: torch.randn(3, 2)})
    with pytest.raises(ValueError, match="missing"):
        ex.upload_shards(x, {0: shards[0]})


def test_fetch_local_shards(make_executor: MakeExecutor) -> None:
    ex, mesh = make_executor((3,))
    value = torch.randn(7, 2)
    x = ex.input(value.shape, mesh, [Shard(0)])
    ex.upload(x, value)
    parts = [ex.fetch_local(x, d).get(timeout=30) for d in mesh.devices]
    assert [tuple(p.shape) for p in parts] == [(3, 2), (3, 2), (1, 2)]
    assert torch.equal(torch.cat(parts), value)
    with pytest.raises(ValueError, match="not in the mesh"):
        ex.fetch_local(x, 5)


def test_fetch_asks_only_the_devices_it_needs(make_executor: MakeExecutor) -> None:
    ex, mesh = make_executor((2, 2))
    sent: list[Fetch] = []
    real_submit = ex.runner.submit
    ex.runner.submit = lambda batch: (
        sent.extend(i for i in batch if isinstance(i, Fetch)),
        real_submit(batch),
    )  # type: ignore[method-assign]
    value = torch.randn(4, 4)
    cases = {
        (Replicate(), Replicate()): (0,),
        (Shard(0), Replicate()): (0, 2),
        (Replicate(), Shard(1)): (0, 1),
        (Shard(0), Shard(1)): (0, 1, 2, 3),
        (Partial(), Replicate()): (0, 2),
        (Replicate(), Partial()): (0, 1),
    }
    for placements, devices in cases.items():
        x = ex.input(value.shape, mesh, placements)
        ex.upload(x, value)
        assert torch.equal(ex.fetch(x).get(timeout=30), value)
        assert sent[-1].devices == devices, placements


def test_sub_mesh_operand(make_executor: MakeExecutor) -> None:
    ex, mesh = make_executor((2, 2), names=("dp", "tp"))
    tp = mesh["tp"]
    value = torch.randn(4, 6)
    x = ex.input(value.shape, tp, [Shard(1)])  # replicated over "dp"
    ex.upload(x, value)
    y = ex.redistribute(ex.call(aten.neg.default, x), [Replicate()])
    assert torch.equal(ex.fetch(y).get(timeout=30), -value)


def test_shutdown_is_idempotent_and_fails_pending_futures() -> None:
    mesh = DeviceMesh.from_shape("cpu", (2,))
    ex = EagerGraphExecutor(ThreadRunner(mesh.devices))
    kernel_module.before_hooks.append(lambda instr, d: time.sleep(0.5))
    x = ex.input((2,), mesh, [Shard(0)])
    ex.upload(x, torch.ones(2))
    fut = ex.fetch(ex.call(aten.neg.default, x))
    t0 = time.perf_counter()
    ex.shutdown()
    ex.shutdown()
    assert time.perf_counter() - t0 < 5
    assert fut.wait_for(5_000)
    with pytest.raises(Exception, match="shut down|closed"):
        fut.get()
    with pytest.raises(RuntimeError, match="after shutdown"):
        ex.call(aten.neg.default, x)
    ex.free(x)  # a no-op after shutdown (finalizers may still run)
    assert not any(s.alive for s in ex.runner.streams.values())
    with pytest.raises(RuntimeError, match="after shutdown"):
        ex.runner.submit([])
