"""The worker's own cost per eager op, without the controller: what a worker thread spends holding the GIL.

In thread mode the controller and the workers share one GIL, so every µs of Python a worker spends per op is a µs
the controller may wait. This records a chain of ``--ops`` fast-path hits (``y = y + x`` on a 1-device CPU mesh:
one hit and one ``Free`` per op) with the runner's ``submit`` held back, then runs the held batches on the worker
in this thread and splits the time: the native loop's ``run_chain`` (the kernels, GIL released) and the rest (the
worker's bookkeeping: queueing hits on the chain, frees, publishing blobs). Medians of ``--repeat`` rounds.
``--wire`` first encodes the held batches as process mode does (``BatchEncoder``: binary hit records) and decodes
them (``BatchDecoder``), then runs the decoded batches as a worker process does (heartbeat callback on): the
worker side of process mode, without the transport (encoding and decoding are not timed).

    python bench/worker_lane.py [--ops 20000] [--repeat 3] [--wire]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from typing import Any

import torch

import torch_dtorch as dt
from torch_dtorch.device.state import get_session
from torch_dtorch.runtime.native_replay import extension


class _TimedModule:
    """The native module with ``run_chain`` timed."""

    def __init__(self, module: Any) -> None:
        self.module = module
        self.seconds = 0.0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.module, name)

    def run_chain(self, *args: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return self.module.run_chain(*args)
        finally:
            self.seconds += time.perf_counter() - t0


def _wire(held: list[tuple[Any, ...]]) -> list[list[Any]]:
    """``held`` encoded and decoded as process mode's codec does (one encoder and decoder for all of them)."""
    from torch_dtorch.cluster.codec import BatchDecoder, BatchEncoder

    enc, dec = BatchEncoder(hits=True), BatchDecoder()
    return [list(dec.decode(enc.encode(list(batch)))) for batch in held]


def one_round(x: torch.Tensor, ops: int, *, wire: bool = False) -> tuple[float, float]:
    """µs per op of the worker's ``run_batch`` over held batches, and of ``run_chain`` within it."""
    rt = get_session()
    executor, runner = rt.executor, rt.executor.runner
    worker = runner.workers[0]
    held: list[tuple[Any, ...]] = []
    submit = runner.submit
    runner.submit = lambda batch: held.append(tuple(batch))  # as the thread runner hands them to workers
    try:
        y = x
        for _ in range(ops):
            y = y + x
        del y
        executor.flush()
    finally:
        runner.submit = submit
    batches: list[Any] = _wire(held) if wire else held
    before = (lambda i, instr: None) if wire else None  # a worker process passes its heartbeat's callback
    chain = worker._chain
    timed = _TimedModule(chain._module)
    chain._module = timed
    try:
        t0 = time.perf_counter()
        for batch in batches:
            worker.run_batch(batch, before=before)
        total = time.perf_counter() - t0
    finally:
        chain._module = timed.module
    dt.sync()
    return total / ops * 1e6, timed.seconds / ops * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ops", type=int, default=20000)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument(
        "--wire", action="store_true", help="process mode's hit records (encoded, decoded) on the worker"
    )
    args = p.parse_args()
    if extension() is None:
        raise SystemExit("the native worker loop is not built here (no C++ compiler, or DTORCH_NATIVE=0)")
    torch.set_num_threads(1)
    mesh = dt.init_device_mesh("cpu", (1,))
    x = dt.distribute_tensor(torch.randn(16, 16), mesh)
    y = x
    for _ in range(3000):  # plans, teaches the fast path; the worker resolves
        y = y + x
    del y
    dt.sync()
    rounds = [one_round(x, args.ops, wire=args.wire) for _ in range(args.repeat)]
    total = statistics.median(r[0] for r in rounds)
    kernels = statistics.median(r[1] for r in rounds)
    what = "process mode's hit records" if args.wire else "thread mode's instructions"
    print(
        f"{platform.node()} torch {torch.__version__}, 1-device mesh: {args.ops} ops (a hit and a Free each), {what}"
    )
    print("| worker run_batch µs/op | of which run_chain (GIL released) | the rest (GIL held) |")
    print("|---|---|---|")
    print(f"| {total:.2f} | {kernels:.2f} | {total - kernels:.2f} |")
    dt.shutdown()


if __name__ == "__main__":
    main()
