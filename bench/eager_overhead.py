"""Eager per-op overhead: torch eager vs upstream DTensor (world size 1, gloo) vs dtorch, in ONE run.

dtorch's **controller issue time** is the time the Python call takes to return (the workers run asynchronously);
end-to-end throughput (issue + workers finishing) is reported separately. Prints a table and the ratio
dtorch issue time / DTensor time (target <= 0.5). The header says which fast path ran (``DTORCH_NATIVE=0``: the
Python one).

    .venv/bin/python bench/eager_overhead.py [--iters 400] [--no-process]
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import statistics
import threading
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DeviceMesh as UpstreamMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor import distribute_tensor as upstream_distribute

import torch_dtorch as dt
from torch_dtorch.device.state import get_session


def per_op_us(fn: Callable[[], object], iters: int, rounds: int = 40) -> float:
    """Best of ``rounds`` timed loops, with the cyclic garbage collector off while timing, as ``timeit`` does (its
    passes over every live object landed on random rounds). The development VMs have slow spells of ~50–100 ms
    (every op 1.5–2 × slower, DTensor's included), so the rounds are many and short."""
    for _ in range(min(200, iters)):
        fn()
    best = float("inf")
    gc.collect()
    gc.disable()
    try:
        for _ in range(rounds):
            t0 = time.perf_counter()
            for _ in range(iters):
                fn()
            best = min(best, (time.perf_counter() - t0) / iters * 1e6)
    finally:
        gc.enable()
    return best


def ops(a: torch.Tensor, b: torch.Tensor) -> dict[str, Callable[[], object]]:
    q, k = a.view(1, 1, 16, 16), b.view(1, 1, 16, 16)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    return {
        "add 16x16": lambda: a + b,
        "mm 16x16": lambda: a @ b,
        "view": lambda: a.view(256),
        "sdpa [1,1,16,16]": lambda: sdpa(q, k, k),
        "to(device, float64)": lambda: a.to(a.device, torch.float64),
    }


def measure(args: argparse.Namespace, port: int) -> dict[str, dict[str, float]]:
    """One pass over every cell of the table."""
    a, b = torch.randn(16, 16), torch.randn(16, 16)
    rows: dict[str, dict[str, float]] = {}

    for name, fn in ops(a, b).items():
        rows.setdefault(name, {})["torch"] = per_op_us(fn, args.iters)

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=0, world_size=1)
    umesh = UpstreamMesh("cpu", [0])
    ua, ub = upstream_distribute(a, umesh, [Replicate()]), upstream_distribute(b, umesh, [Replicate()])
    for name, fn in ops(ua, ub).items():
        rows[name]["DTensor"] = per_op_us(fn, args.iters)
    dist.destroy_process_group()

    for n in (1, 4):
        mesh = dt.init_device_mesh("cpu", (n,))
        ex = get_session().executor
        placements = [Shard(0)] if n > 1 else [Replicate()]
        da, db = dt.distribute_tensor(a, mesh, placements), dt.distribute_tensor(b, mesh, [Replicate()])
        for name, fn in ops(da, db).items():
            # controller alone: batches are dropped instead of sent while timing (no worker thread competes for the
            # GIL, and nothing piles up); the dropped results are never read
            # (and the idle-flush timer stays parked: its wake-ups would take the GIL mid-loop)
            submit, wake = ex.runner.submit, ex._wake
            ex.runner.submit, ex._wake = (lambda batch: None), threading.Event()
            rows[name][f"dtorch issue {n}-dev, controller only"] = per_op_us(fn, args.iters)
            ex.runner.submit, ex._wake = submit, wake
            wake.set()
            dt.sync()
            rows[name][f"dtorch issue {n}-dev"] = per_op_us(fn, args.iters)
            dt.sync()  # the issue loops above leave thousands of ops queued: e2e starts from idle workers
            t0 = time.perf_counter()
            for _ in range(args.iters):
                fn()
            dt.sync()
            rows[name][f"dtorch e2e {n}-dev"] = (time.perf_counter() - t0) / args.iters * 1e6
    dt.shutdown()

    if not args.no_process:
        # the worker in another process: the controller shares the GIL only with its own sender threads
        mesh = dt.init_device_mesh("cpu", (1,), mode="process")
        da, db = dt.distribute_tensor(a, mesh, [Replicate()]), dt.distribute_tensor(b, mesh, [Replicate()])
        for name, fn in ops(da, db).items():
            rows[name]["dtorch issue 1-dev, process mode"] = per_op_us(fn, args.iters)
            dt.sync()
        dt.shutdown()

    return rows


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--iters", type=int, default=400)
    p.add_argument("--repeat", type=int, default=3, help="passes over the table; each cell is their median")
    p.add_argument("--no-process", action="store_true", help="skip the process-mode row")
    args = p.parse_args()
    torch.set_num_threads(1)
    passes = [measure(args, 29533 + i) for i in range(args.repeat)]
    rows = {
        name: {col: statistics.median(r[name][col] for r in passes) for col in cells}
        for name, cells in passes[0].items()
    }

    cols = list(next(iter(rows.values())).keys())
    from torch_dtorch.device.tensors import TABLE

    print(
        f"# eager per-op overhead, µs/op ({platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
        f"fast path: {'native' if TABLE.native else 'python'}; median of {args.repeat} passes)"
    )
    ratios = [
        ("controller 1-dev ÷ DTensor", "dtorch issue 1-dev, controller only"),
        ("controller 4-dev ÷ DTensor", "dtorch issue 4-dev, controller only"),
        ("issue 1-dev ÷ DTensor", "dtorch issue 1-dev"),
        ("issue 4-dev ÷ DTensor", "dtorch issue 4-dev"),
        ("issue 1-dev process ÷ DTensor", "dtorch issue 1-dev, process mode"),
    ]
    ratios = [(r, c) for r, c in ratios if c in cols]
    print("| op | " + " | ".join(cols) + " | " + " | ".join(r for r, _ in ratios) + " |")
    print("|---" * (len(cols) + len(ratios) + 1) + "|")
    for name, r in rows.items():
        cells = [f"{r[c]:.1f}" for c in cols] + [f"{r[c] / r['DTensor']:.2f}" for _, c in ratios]
        print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
