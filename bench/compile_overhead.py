"""Controller and worker overhead of ``torch.compile(backend="dtorch")`` (4-device thread mesh, CPU).

Two numbers, for a chain of N elementwise ops on Shard(0) inputs (the input count stays fixed while N grows):

- **controller µs/call**: time per call of the compiled model minus the same model under a no-op dynamo backend
  (one that returns preallocated outputs: dynamo's own guards and frame cost), the workers held at a gate while
  timing. Target ≤ 50 µs, flat in N.
- **replay ratio**: one worker's program handler per call ÷ the same compute segments run directly in torch on the
  same shards (both in the main thread, workers idle: the chain has no collective). Target ≤ 1.1.

Each time is the best of ``--repeat`` loops of ``--calls`` calls, the compiled and the no-op model measured in
alternation (the shared machine is noisy: the minimum is the least disturbed loop).

    python bench/compile_overhead.py [--ops 500 1000 2000 5000] [--calls 200] [--repeat 7]
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
from torch_dtorch.backend import dtorch_backend
from torch_dtorch.device.state import get_session

log = logging.getLogger("bench.compile_overhead")


def chain(num_ops: int, tag: str = "") -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """``x = sin(x + y)``, ``x = sin(x * y)``, ... (``num_ops`` ops); each ``tag`` gets its own code object, so
    dynamo keeps one compiled entry per backend without a reset in between."""
    src = (
        "def f(x, y):\n"
        "    for i in range(num_ops // 2):\n"
        "        x = x * y if i % 2 else x + y\n"
        "        x = torch.sin(x)\n"
        "    return x\n"
    )
    scope: dict[str, Any] = {"torch": torch, "num_ops": num_ops}
    exec(compile(src, f"<chain {tag}>", "exec"), scope)  # noqa: S102 - a fixed source: only the filename varies
    return scope["f"]  # type: ignore[no-any-return]


def per_call(
    fn: Callable[[], Any], calls: int, clock: Callable[[], float] = time.perf_counter, repeat: int = 1
) -> float:
    """Seconds per call: the best of ``repeat`` loops of ``calls`` calls."""
    fn()
    best = float("inf")
    for _ in range(repeat):
        t0 = clock()
        for _ in range(calls):
            fn()
        best = min(best, (clock() - t0) / calls)
    return best


def noop_backend(out: torch.Tensor) -> Callable[..., Any]:
    """A dynamo backend whose graphs return ``out`` at once: dynamo's own per-call cost."""

    def backend(gm: Any, example_inputs: Any) -> Callable[..., Any]:
        return lambda *a: (out,)

    return backend


def replay_times(worker: Any, x: torch.Tensor, y: torch.Tensor, repeat: int) -> tuple[float, float]:
    """(seconds per replay of the newest program through the worker's handler, seconds to run the same compute
    segments directly), both in this thread with the workers idle (the chain has no collective), best of
    ``repeat`` loops of each, taken in alternation: the replay overhead without the GIL contention of four worker
    threads on two cores."""
    from torch_dtorch.backend.program import _PROGRAMS, RunProgram, _execute
    from torch_dtorch.device.dispatch import operand_of

    dt.sync()
    table = _PROGRAMS[worker]
    pid = max(table)
    loaded = table[pid]
    instr = RunProgram(pid, (operand_of(x).id, operand_of(y).id), (-1,))
    local = [x.to_local(worker.device), y.to_local(worker.device)]
    steps = list(loaded.program.steps)
    replay = direct = float("inf")
    for _ in range(repeat):  # in alternation, like the controller figures
        replay = min(replay, per_call(lambda: _execute(worker, loaded, instr), 20))
        direct = min(direct, per_call(lambda: [s.gm(*local) for s in steps], 20))
    worker.blobs.pop(-1, None)
    return replay, direct


def interleaved(fns: list[Callable[[], Any]], calls: int, repeat: int) -> list[float]:
    """Per-call seconds of each function with the workers held at a gate, measured in alternation (so load changes
    on the shared machine hit all alike), best of ``repeat`` rounds. The calls are really issued (batches flushed
    and queued to the worker threads), but the backlog they leave is dropped afterwards, not run: at 5000 ops,
    running thousands of queued programs took longer than the measurement; their results are never read."""
    import threading

    from torch_dtorch.runtime import op_runner as kernel

    streams = list(get_session().executor.runner.streams.values())
    dt.sync()
    gate = threading.Event()
    kernel.before_hooks.append(lambda instr, device: gate.wait(600))
    best = [float("inf")] * len(fns)
    try:
        for fn in fns:
            fn()
        for _ in range(repeat):
            for i, fn in enumerate(fns):
                best[i] = min(best[i], per_call(fn, calls))
    finally:
        for s in streams:
            s._discard = True  # the queued batches are skipped (KernelStream's shutdown flag)
        gate.set()
        kernel.before_hooks.pop()
        for s in streams:
            s.wait_idle()
            s._discard = False
        dt.sync()
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ops", type=int, nargs="+", default=[500, 1000, 2000, 5000])
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--repeat", type=int, default=7, help="loops per measurement; the best one counts")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.set_num_threads(1)
    mesh = dt.init_device_mesh("cpu", (4,))
    rt_executor = get_session().executor
    x = dt.distribute_tensor(torch.randn(64, 16), mesh, [Shard(0)])
    y = dt.distribute_tensor(torch.randn(64, 16), mesh, [Shard(0)])
    log.info("%8s %18s %16s %14s", "ops", "controller µs/call", "no-op µs/call", "replay ratio")
    for n in args.ops:
        torch._dynamo.reset()
        with torch.no_grad():
            # the callable, not the entry-point name: the bench also runs from a source tree (device machines)
            compiled = torch.compile(chain(n, "dtorch"), backend=dtorch_backend)
            out = compiled(x, y)
            base = torch.compile(chain(n, "noop"), backend=noop_backend(out))
            base(x, y)
            t_ours, t_noop = interleaved(
                [functools.partial(compiled, x, y), functools.partial(base, x, y)], args.calls, args.repeat
            )
            replay, direct = replay_times(rt_executor.runner.workers[0], x, y, args.repeat)
        log.info("%8d %18.1f %16.1f %14.2f", n, (t_ours - t_noop) * 1e6, t_noop * 1e6, replay / direct)
    dt.shutdown()


if __name__ == "__main__":
    main()
