"""Process-mode wire: binary hit records (codec v2) against the all-JSON encoding, in ONE run, alternating.

1. **codec**: the batches a chain of small ops makes (captured from a thread-mode session), encoded and signed
   (controller side) and verified and decoded (worker side), with hit records and with every instruction as JSON:
   µs per op on each side, ops/s through both, bytes per op on the wire.
2. **e2e**: a chain of small ops (``x = x * 0.5 + b``, 16x16, two aten ops per step, ``dt.sync()`` included) on a
   1-device process-mode mesh — all JSON in batches of 64 (the v1 wire), hit records in batches of 64, hit records
   in process mode's default batches (same workers: ``BatchEncoder.hits`` and the executor's batch size are
   switched between chains) — against upstream DTensor (world size 1). Rounds alternate the four; each cell is the
   median over rounds of the median of ``--repeat`` chains.

    python bench/process_wire.py [--ops 1000] [--repeat 3] [--rounds 5] [--no-e2e]
"""

from __future__ import annotations

import argparse
import logging
import os
import platform
import statistics
import sys
import time
from typing import Any

import torch

import torch_dtorch as dt
from torch_dtorch import Replicate
from torch_dtorch.cluster.codec import BatchDecoder, BatchEncoder
from torch_dtorch.cluster.transport import MessageKind, wire
from torch_dtorch.device.state import get_session
from torch_dtorch.executor.instructions import FastRun

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from eager_e2e import chain_us  # noqa: E402 - the same chain timing as the issue's bench

log = logging.getLogger("bench.process_wire")
SECRET = b"b" * 32


def capture(ops: int) -> list[list[Any]]:
    mesh = dt.init_device_mesh("cpu", (1,), mode="thread")
    runner = get_session().executor.runner
    batches: list[list[Any]] = []
    submit = runner.submit

    def record(batch: Any) -> None:
        batches.append(list(batch))
        submit(batch)

    runner.submit = record  # type: ignore[method-assign]
    try:
        x = dt.distribute_tensor(torch.randn(16, 16), mesh, [Replicate()])
        b = dt.distribute_tensor(torch.randn(16, 16), mesh, [Replicate()])
        for _ in range(ops // 2):
            x = x * 0.5 + b
        dt.sync()
    finally:
        dt.shutdown()
    return batches


def codec_round(batches: list[list[Any]], *, hits: bool) -> tuple[float, float, float]:
    """(controller µs/op, worker µs/op, bytes/op) of one pass over ``batches`` with fresh tables."""
    enc, dec = BatchEncoder(hits=hits), BatchDecoder()
    n = sum(type(i) is FastRun for b in batches for i in b)
    t_enc = t_dec = 0.0
    nbytes = 0
    for seq, batch in enumerate(batches, 1):
        t0 = time.perf_counter()
        frames = wire.encode(enc.encode(batch), kind=MessageKind.BATCH, seq=seq, sender="c", secret=SECRET)
        t1 = time.perf_counter()
        dec.decode(wire.decode(frames, secret=SECRET).body)
        t2 = time.perf_counter()
        t_enc += t1 - t0
        t_dec += t2 - t1
        nbytes += sum(memoryview(f).nbytes for f in frames)
    return t_enc / n * 1e6, t_dec / n * 1e6, nbytes / n


def e2e(*, ops: int, repeat: int, rounds: int) -> dict[str, list[float]]:
    import torch.distributed as dist
    from torch.distributed.tensor import DeviceMesh as UpstreamMesh
    from torch.distributed.tensor import distribute_tensor

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29613")
    dist.init_process_group("gloo", rank=0, world_size=1)
    mesh = dt.init_device_mesh("cpu", (1,), mode="process")
    executor = get_session().executor
    encoder, default_batch = executor.runner._encoder, executor.batch_size
    try:
        um = UpstreamMesh("cpu", [0])
        ux = [distribute_tensor(torch.randn(16, 16), um, [Replicate()])]
        ub = distribute_tensor(torch.randn(16, 16), um, [Replicate()])
        dx = [dt.distribute_tensor(torch.randn(16, 16), mesh, [Replicate()])]
        db = dt.distribute_tensor(torch.randn(16, 16), mesh, [Replicate()])

        def ustep() -> None:
            ux[0] = ux[0] * 0.5 + ub

        def dstep() -> None:
            dx[0] = dx[0] * 0.5 + db

        #: label -> (hit records, batch size); all JSON in batches of 64 is the wire before codec v2
        cases: dict[str, tuple[bool, int] | None] = {
            "DTensor (world 1)": None,
            "process, all JSON, batch 64 (v1 wire)": (False, 64),
            "process, hit records, batch 64": (True, 64),
            f"process, hit records, batch {default_batch} (default)": (True, default_batch),
        }
        out: dict[str, list[float]] = {label: [] for label in cases}
        for r in range(rounds):
            for label, case in cases.items():
                if case is None:
                    us = chain_us(ustep, lambda: None, ops=ops, repeat=repeat)
                else:
                    encoder.hits, executor.batch_size = case
                    us = chain_us(dstep, dt.sync, ops=ops, repeat=repeat)
                out[label].append(us)
            log.info("round %d: %s", r, {k: round(v[-1], 1) for k, v in out.items()})
        return out
    finally:
        encoder.hits, executor.batch_size = True, default_batch
        dt.shutdown()
        dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--ops", type=int, default=1000)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--no-e2e", action="store_true")
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    log.setLevel(logging.INFO)
    torch.set_num_threads(1)
    load = os.getloadavg()[0]
    batches = capture(args.ops)
    cells: dict[bool, list[tuple[float, float, float]]] = {True: [], False: []}
    for _ in range(args.rounds):
        for hits in (False, True):
            cells[hits].append(codec_round(batches, hits=hits))
    print(
        f"# process wire, {platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, load {load:.1f}; "
        f"medians of {args.rounds} alternating rounds"
    )
    print("\n| codec (16x16 mul/add chain) | controller µs/op | worker µs/op | ops/s (both) | bytes/op |")
    print("|---|---|---|---|---|")
    for hits in (False, True):
        c, w, nb = (statistics.median(col) for col in zip(*cells[hits], strict=True))
        label = "hit records (v2)" if hits else "all JSON"
        print(f"| {label} | {c:.2f} | {w:.2f} | {1e6 / (c + w):,.0f} | {nb:.0f} |")
    if args.no_e2e:
        return
    rows = e2e(ops=args.ops, repeat=args.repeat, rounds=args.rounds)
    base = statistics.median(rows["DTensor (world 1)"])
    print(
        f"\n| e2e per op, 1 device (median of {args.rounds} rounds x {args.repeat} chains of {args.ops} ops) "
        "| µs/op | ÷ DTensor | rounds |"
    )
    print("|---|---|---|---|")
    for label, v in rows.items():
        m = statistics.median(v)
        print(f"| {label} | {m:.1f} | {m / base:.2f} | {' '.join(f'{x:.1f}' for x in v)} |")


if __name__ == "__main__":
    main()
