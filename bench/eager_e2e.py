"""Eager end to end per small op: what the user waits for (issue + workers done, ``dt.sync()`` included), in ONE run.

A chain of ``--ops`` small ops (``x = x * 0.5 + b``: two aten ops per step) on a 1-device mesh (thread and process
mode) and on a simulated 4-device mesh (Shard(0)), against plain torch eager on the same device. Each cell is the
median of ``--repeat`` timed chains (after a warm-up chain) in µs per aten op. Columns with workers also run with
``DTORCH_WORKER_REPLAY`` off (the general local path) for an A/B of the resolved-call replay, and the table gives
the worker overhead per op (dtorch − torch) and the ratios to torch and to upstream DTensor (world size 1, CPU only).

    python bench/eager_e2e.py [--device cpu|cuda] [--ops 2000] [--repeat 5] [--no-process]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from collections.abc import Callable

import torch

import torch_dtorch as dt
from torch_dtorch import Replicate, Shard
from torch_dtorch.config import get_config


def chain_us(step: Callable[[], None], sync: Callable[[], None], *, ops: int, repeat: int) -> float:
    """Median µs per aten op of ``repeat`` chains of ``ops // 2`` steps (each step is two aten ops)."""
    steps = ops // 2
    for _ in range(steps):
        step()
    sync()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        sync()
        times.append((time.perf_counter() - t0) / (2 * steps) * 1e6)
    return statistics.median(times)


def torch_row(device: str, *, ops: int, repeat: int) -> float:
    x, b = torch.randn(16, 16, device=device), torch.randn(16, 16, device=device)
    box = [x]

    def step() -> None:
        box[0] = box[0] * 0.5 + b

    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    return chain_us(step, sync, ops=ops, repeat=repeat)


def dtensor_row(*, ops: int, repeat: int) -> float:
    import torch.distributed as dist
    from torch.distributed.tensor import DeviceMesh as UpstreamMesh
    from torch.distributed.tensor import distribute_tensor

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29611")
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        mesh = UpstreamMesh("cpu", [0])
        x = distribute_tensor(torch.randn(16, 16), mesh, [Replicate()])
        b = distribute_tensor(torch.randn(16, 16), mesh, [Replicate()])
        box = [x]

        def step() -> None:
            box[0] = box[0] * 0.5 + b

        return chain_us(step, lambda: None, ops=ops, repeat=repeat)
    finally:
        dist.destroy_process_group()


def dtorch_row(device: str, n: int, mode: str, *, replay: bool, ops: int, repeat: int) -> float:
    get_config().worker_replay = replay
    os.environ["DTORCH_WORKER_REPLAY"] = "1" if replay else "0"  # worker processes read it at start
    try:
        mesh = dt.init_device_mesh(device, (n,), mode=mode, simulate=device == "cuda" and n > 1)
        x = dt.distribute_tensor(torch.randn(16 * n, 16), mesh, [Shard(0)] if n > 1 else [Replicate()])
        b = dt.distribute_tensor(torch.randn(16 * n, 16), mesh, [Shard(0)] if n > 1 else [Replicate()])
        box = [x]

        def step() -> None:
            box[0] = box[0] * 0.5 + b

        return chain_us(step, dt.sync, ops=ops, repeat=repeat)
    finally:
        dt.shutdown()
        get_config().worker_replay = True
        os.environ.pop("DTORCH_WORKER_REPLAY", None)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--ops", type=int, default=2000)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--no-process", action="store_true", help="skip the process-mode rows")
    args = p.parse_args()
    torch.set_num_threads(1)
    kw = {"ops": args.ops, "repeat": args.repeat}
    base = torch_row(args.device, **kw)
    rows: list[tuple[str, float]] = [("torch eager", base)]
    dtensor = dtensor_row(**kw) if args.device == "cpu" else None
    if dtensor is not None:
        rows.append(("DTensor (world 1)", dtensor))
    cases = [(1, "thread"), (4, "thread")] + ([] if args.no_process else [(1, "process")])
    for n, mode in cases:
        for replay in (True, False):
            label = f"dtorch {n}-dev {mode}" + ("" if replay else ", replay off")
            rows.append((label, dtorch_row(args.device, n, mode, replay=replay, **kw)))
    print(
        f"# eager e2e per small op (16x16 mul/add chain, dt.sync() included), µs/op; {args.device} "
        f"({platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}); median of {args.repeat} chains "
        f"of {args.ops} ops"
    )
    print("| case | µs/op | − torch | ÷ torch | ÷ DTensor |")
    print("|---|---|---|---|---|")
    for label, us in rows:
        vs_dtensor = f"{us / dtensor:.2f}" if dtensor is not None else "-"
        print(f"| {label} | {us:.1f} | {us - base:.1f} | {us / base:.2f} | {vs_dtensor} |")


if __name__ == "__main__":
    main()
