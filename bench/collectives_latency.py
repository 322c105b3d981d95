"""In-memory (thread-mode) collective latency: all-reduce of 4 floats at 2 and 4 ranks, one thread per rank,
against a bare ``threading.Barrier`` round (the floor for any thread rendezvous) in the same run.

    .venv/bin/python bench/collectives_latency.py [--iters 2000]
"""

from __future__ import annotations

import argparse
import os
import statistics
import threading
import time

import torch

from torch_dtorch.collectives.memory import InMemoryWorld


def run_ranks(n: int, body) -> list[float]:  # noqa: ANN001
    """Run ``body(rank)`` on n threads; returns each thread's elapsed seconds."""
    out = [0.0] * n
    start = threading.Barrier(n)

    def target(r: int) -> None:
        start.wait()
        t0 = time.perf_counter()
        body(r)
        out[r] = time.perf_counter() - t0

    threads = [threading.Thread(target=target, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def measure(n: int, iters: int) -> tuple[float, float]:
    """Median µs per call over ranks: a bare barrier round, then an in-memory all-reduce."""
    barrier = threading.Barrier(n)
    bar = run_ranks(n, lambda r: [barrier.wait() for _ in range(iters)])
    group = InMemoryWorld(list(range(n))).group(list(range(n)))
    handles = [group.handle(d) for d in range(n)]
    x = [torch.ones(4) for _ in range(n)]
    ar = run_ranks(n, lambda r: [handles[r].all_reduce(x[r], "sum") for _ in range(iters)])
    return statistics.median(bar) / iters * 1e6, statistics.median(ar) / iters * 1e6


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--iters", type=int, default=2000)
    args = p.parse_args()
    torch.set_num_threads(1)
    print(f"# in-memory collective latency, µs per call ({os.cpu_count()} cores, torch {torch.__version__})")
    print("| ranks | threading.Barrier round | all_reduce (4 floats) | ratio |")
    print("|---|---|---|---|")
    for n in (2, 4):
        b_us, a_us = measure(n, args.iters)
        print(f"| {n} | {b_us:.0f} | {a_us:.0f} | {a_us / b_us:.1f} |")


if __name__ == "__main__":
    main()
