"""Controller and worker overhead of ``torch.compile(backend="dtorch")`` (4-device thread mesh, CPU).

Two numbers, for a chain of N elementwise ops on Shard(0) inputs (the input count stays fixed while N grows):

- **controller µs/call**: time per call of the compiled model minus the same model under a no-op dynamo backend
  (one that returns preallocated outputs: dynamo's own guards and frame cost). Target ≤ 50 µs, flat in N.
- **replay ratio**: time the workers spend running their local program per call ÷ running the same local programs
  directly in torch on the same shards. Target ≤ 1.1.

    python bench/compile_overhead.py [--ops 500 1000 2000 5000] [--calls 200]
"""

from __future__ import annotations

import argparse
import functools
import logging
import time
from collections.abc import Callable
from typing import Any

import torch

import torch_dtorch as dt
from torch_dtorch import Shard

log = logging.getLogger("bench.compile_overhead")


def chain(num_ops: int) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    def f(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for i in range(num_ops // 2):
            x = x * y if i % 2 else x + y
            x = torch.sin(x)
        return x

    return f


def per_call(fn: Callable[[], Any], calls: int, clock: Callable[[], float] = time.perf_counter) -> float:
    fn()
    t0 = clock()
    for _ in range(calls):
        fn()
    return (clock() - t0) / calls


def paused_workers(fn: Callable[[], Any], calls: int) -> float:
    """Per-call controller time with the workers held at a gate (in thread mode they would otherwise compete for
    the GIL, and their compute would be counted as controller time)."""
    import threading

    from torch_dtorch.runtime import kernel

    gate = threading.Event()
    kernel.before_hooks.append(lambda instr, device: gate.wait(600))
    try:
        return per_call(fn, calls)
    finally:
        gate.set()
        kernel.before_hooks.pop()
        dt.sync()


def noop_backend(out: torch.Tensor) -> Callable[..., Any]:
    """A dynamo backend whose graphs return ``out`` at once: dynamo's own per-call cost."""

    def backend(gm: Any, example_inputs: Any) -> Callable[..., Any]:
        return lambda *a: (out,)

    return backend


def replay_times(worker: Any, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    """(worker seconds per replay, seconds to run the same local program directly) for the newest program."""
    from torch_dtorch.backend.program import _PROGRAMS

    table = _PROGRAMS[worker]
    loaded = table[max(table)]
    replay = loaded.stats.seconds / max(loaded.stats.calls, 1)
    local = [x.to_local(worker.device), y.to_local(worker.device)]
    steps = list(loaded.program.steps)
    direct = per_call(lambda: [s.gm(*local) for s in steps], 50, time.thread_time)
    return replay, direct


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ops", type=int, nargs="+", default=[500, 1000, 2000, 5000])
    parser.add_argument("--calls", type=int, default=200)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.set_num_threads(1)
    mesh = dt.init_device_mesh("cpu", (4,))
    rt_executor = __import__("torch_dtorch.device.state", fromlist=["get_runtime"]).get_runtime().executor
    x = dt.distribute_tensor(torch.randn(64, 16), mesh, [Shard(0)])
    y = dt.distribute_tensor(torch.randn(64, 16), mesh, [Shard(0)])
    log.info("%8s %18s %16s %14s", "ops", "controller µs/call", "no-op µs/call", "replay ratio")
    for n in args.ops:
        torch._dynamo.reset()
        f = chain(n)
        with torch.no_grad():
            compiled = torch.compile(f, backend="dtorch")
            compiled(x, y)
            dt.sync()
            t_ours = paused_workers(functools.partial(compiled, x, y), args.calls)
            dt.sync()
            replay, direct = replay_times(rt_executor.runner.workers[0], x, y)
            out = compiled(x, y)

            torch._dynamo.reset()
            base = torch.compile(f, backend=noop_backend(out))
            t_noop = paused_workers(functools.partial(base, x, y), args.calls)
        log.info("%8d %18.1f %16.1f %14.2f", n, (t_ours - t_noop) * 1e6, t_noop * 1e6, replay / direct)
    dt.shutdown()


if __name__ == "__main__":
    main()
