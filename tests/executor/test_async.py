"""Asynchrony: calls return before the workers run them, batches flush on a timer, futures resolve in order."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import torch

from tests.executor.conftest import MakeExecutor
from torch_dtorch.executor.future import TensorFuture
from torch_dtorch.executor.instructions import RunOp
from torch_dtorch.placement import Replicate, Shard
from torch_dtorch.runtime import op_runner as kernel_module

aten = torch.ops.aten
SLOW_S = 0.02


def _slow(instr: Any, device: int) -> None:
    time.sleep(SLOW_S)


def test_call_returns_before_workers_finish(make_executor: MakeExecutor) -> None:
    ex, mesh = make_executor((2,), batch_size=4)
    done = []
    kernel_module.before_hooks.append(_slow)
    kernel_module.after_hooks.append(lambda instr, d: done.append(d) if isinstance(instr, RunOp) else None)
    value = torch.randint(-5, 5, (4, 4)).float()  # sums stay exact
    x = ex.input(value.shape, mesh, [Shard(0)])
    ex.upload(x, value)
    ex.call(aten.add.Tensor, x, x)  # warm-up: the first call of an op pays one-time costs (shape inference)
    ex.sync()
    done.clear()
    n = 20
    t0 = time.perf_counter()
    y = x
    for _ in range(n):
        y = ex.call(aten.add.Tensor, y, x)
    issue_s = time.perf_counter() - t0
    # the workers need n * SLOW_S = 0.4 s; issuing took a small fraction of it and most ops are still queued
    assert issue_s < n * SLOW_S / 4, f"issuing {n} ops took {issue_s:.3f} s: call() waited for the workers"
    assert len(done) < 2 * n
    fut = ex.fetch(y)
    assert not fut.is_ready()
    assert torch.equal(fut.get(timeout=30), value * (n + 1))
    assert len(done) == 2 * n


def test_timer_flush_without_explicit_flush(make_executor: MakeExecutor) -> None:
    ex, mesh = make_executor((2,), batch_size=1000, flush_interval_ms=5)
    ran = threading.Event()
    kernel_module.after_hooks.append(lambda instr, d: ran.set() if isinstance(instr, RunOp) else None)
    x = ex.input((4,), mesh, [Shard(0)])
    ex.upload(x, torch.arange(4.0))
    y = ex.call(aten.mul.Tensor, x, x)
    # no flush, no fetch, no sync: the timer sends the batch after 5 ms without a new op
    assert ran.wait(5.0), "the flush timer never sent the pending batch"
    assert ex.runner.wait_idle(5.0)
    assert all(y.id in w.blobs for w in ex.runner.workers.values())
    assert ex.num_flushes >= 1


def test_batch_full_flushes(make_executor: MakeExecutor) -> None:
    ex, mesh = make_executor((1,), batch_size=3, flush_interval_ms=60_000)
    x = ex.input((2,), mesh, [Replicate()])
    ex.upload(x, torch.ones(2))
    ex.call(aten.neg.default, x)
    assert ex.num_flushes == 0
    ex.call(aten.neg.default, x)  # third instruction (upload + 2 ops): a full batch goes at once
    assert ex.num_flushes == 1


def test_futures_resolve_in_request_order(make_executor: MakeExecutor) -> None:
    ex, mesh = make_executor((2,))
    kernel_module.before_hooks.append(_slow)
    order: list[int] = []
    futures: list[TensorFuture] = []
    value = torch.randn(6, 2)
    x = ex.input(value.shape, mesh, [Shard(0)])
    ex.upload(x, value)
    for i in range(6):
        y = (
            ex.call(aten.mul.Tensor, x, x) if i % 2 else x
        )  # even futures need no work, odd ones wait for an op
        fut = ex.fetch(y)
        fut.add_done_callback(lambda f, i=i: order.append(i))
        futures.append(fut)
    assert futures[-1].wait_for(30_000)
    for f in futures:
        f.wait(timeout=30)
    assert order == list(range(6))
    assert all(f.is_ready() for f in futures)
    assert torch.equal(futures[0].get(), value) and torch.equal(futures[1].get(), value * value)
    # a callback added after resolution runs at once
    late: list[TensorFuture] = []
    futures[0].add_done_callback(late.append)
    assert late == [futures[0]]


def test_await_in_asyncio(make_executor: MakeExecutor) -> None:
    ex, mesh = make_executor((2,))
    value = torch.randn(4, 3)
    x = ex.input(value.shape, mesh, [Shard(1)])
    ex.upload(x, value)

    async def main() -> list[torch.Tensor]:
        a = ex.fetch(ex.call(aten.exp.default, x))
        b = ex.fetch(x)
        return list(await asyncio.gather(a, b))

    a, b = asyncio.run(main())
    assert torch.equal(a, torch.exp(value)) and torch.equal(b, value)


def test_wait_timeout_and_sync(make_executor: MakeExecutor) -> None:
    ex, mesh = make_executor((2,))
    kernel_module.before_hooks.append(lambda instr, d: time.sleep(0.2))
    x = ex.input((2,), mesh, [Shard(0)])
    ex.upload(x, torch.ones(2))
    fut = ex.fetch(ex.call(aten.neg.default, x))
    assert not fut.wait_for(10)
    try:
        fut.wait(timeout=0.01)
        raise AssertionError("wait() should time out")
    except TimeoutError:
        pass
    ex.sync(timeout=30)
    assert fut.wait_for(5_000)
    assert torch.equal(fut.get(), -torch.ones(2))


def test_thread_safe_calls(make_executor: MakeExecutor) -> None:
    ex, mesh = make_executor((2,), batch_size=7)
    value = torch.randint(-5, 5, (4, 4)).float()  # sums stay exact
    x = ex.input(value.shape, mesh, [Shard(0)])
    ex.upload(x, value)
    results: dict[int, TensorFuture] = {}

    def user(k: int) -> None:
        y = x
        for _ in range(k):
            y = ex.call(aten.add.Tensor, y, x)
        results[k] = ex.fetch(y)

    threads = [threading.Thread(target=user, args=(k,)) for k in range(1, 5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for k, f in results.items():
        assert torch.equal(f.get(timeout=30), value * (k + 1))
