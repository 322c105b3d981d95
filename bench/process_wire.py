"""Process-mode wire: binary hit records (codec v2) against the all-JSON encoding, in ONE run, alternating.

1. **codec**: the batches a chain of small ops makes, and those of the tiny FLUX transformer step of
   ``bench/eager_flux.py`` (``--flux-layers``; captured from thread-mode sessions, timed over the steps after the
   warm-up), encoded and signed (controller side) and verified and decoded (worker side), with hit records and with
   every instruction as JSON: µs per op on each side, ops/s through both, bytes per op on the wire, and the share
   of the fast-path hits that travel as records.
2. **e2e**: a chain of small ops (``x = x * 0.5 + b``, 16x16, two aten ops per step, ``dt.sync()`` included) on a
   1-device process-mode mesh — all JSON in batches of 64 published as they come (the v1 wire), hit records in
   batches of 256 published as they come (the 2026-12-05 wire), and the default: hit records in chunks of 64 that
   the outbox holds while the worker is busy (``cluster/outbox.py``; same workers: ``BatchEncoder.hits``, the
   executor's batch size and ``Outbox.max_held`` are switched between chains) — against upstream DTensor (world
   size 1). Rounds alternate the four; each cell is the
   median over rounds of the median of ``--repeat`` chains.

    python bench/process_wire.py [--ops 1000] [--repeat 3] [--rounds 5] [--flux-layers 1 1] [--no-e2e]
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
from torch_dtorch.cluster.codec import VERSION, BatchDecoder, BatchEncoder
from torch_dtorch.cluster.codec.hits import FREE, HitRun
from torch_dtorch.cluster.transport import MessageKind, wire
from torch_dtorch.device.state import get_session
from torch_dtorch.executor.instructions import FastRun
from torch_dtorch.runtime import native_replay

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from eager_e2e import chain_us  # noqa: E402 - the same chain timing as the issue's bench

log = logging.getLogger("bench.process_wire")
SECRET = b"b" * 32


def _recording_mesh() -> tuple[Any, list[list[Any]]]:
    """A 1-device thread-mode mesh whose runner also keeps every batch it is given (in the returned list)."""
    mesh = dt.init_device_mesh("cpu", (1,), mode="thread")
    runner = get_session().executor.runner
    batches: list[list[Any]] = []
    submit = runner.submit

    def record(batch: Any) -> None:
        batches.append(list(batch))
        submit(batch)

    runner.submit = record
    return mesh, batches


def capture(ops: int) -> list[list[Any]]:
    mesh, batches = _recording_mesh()
    try:
        x = dt.distribute_tensor(torch.randn(16, 16), mesh, [Replicate()])
        b = dt.distribute_tensor(torch.randn(16, 16), mesh, [Replicate()])
        for _ in range(ops // 2):
            x = x * 0.5 + b
        dt.sync()
    finally:
        dt.shutdown()
    return batches


def capture_flux(layers: tuple[int, int], *, warmup: int = 2, steps: int = 3) -> tuple[list[list[Any]], int]:
    """The batches of ``warmup + steps`` tiny FLUX transformer steps (``bench/eager_flux.py``'s CPU model) on a
    1-device thread-mode mesh, and the index of the first batch after the warm-up."""
    import copy

    from compile_flux_gpu import TINY, build_model, distribute_module, make_inputs

    config = dict(TINY, num_layers=layers[0], num_single_layers=layers[1])
    cpu = torch.device("cpu")
    model = build_model(config, cpu, torch.float32)
    inputs = make_inputs(config, 64, 16, cpu, torch.float32)
    mesh, batches = _recording_mesh()
    first = 0
    try:
        model_d = copy.deepcopy(model)
        distribute_module(model_d, mesh)
        din = {k: dt.distribute_tensor(v, mesh) for k, v in inputs.items()}
        with torch.no_grad():
            for i in range(warmup + steps):
                if i == warmup:
                    dt.sync()
                    first = len(batches)
                model_d(**din, return_dict=False)
            dt.sync()
    finally:
        dt.shutdown()
    return batches, first


def codec_round(
    batches: list[list[Any]], *, hits: bool, native: bool | None = None, timed_from: int = 0
) -> tuple[float, float, float, float]:
    """(controller µs/op, worker µs/op, bytes/op, share of the hits sent as records) of one pass over ``batches``
    with fresh tables; only ``batches[timed_from:]`` count. ``native=False``: records encoded in Python only (no
    ``encode_hits`` lane)."""
    enc, dec = BatchEncoder(hits=hits, native=native), BatchDecoder()
    n = sum(type(i) is FastRun for b in batches[timed_from:] for i in b)
    t_enc = t_dec = 0.0
    nbytes = records = 0
    for seq, batch in enumerate(batches, 1):
        t0 = time.perf_counter()
        frames = wire.encode(enc.encode(batch), kind=MessageKind.BATCH, seq=seq, sender="c", secret=SECRET)
        t1 = time.perf_counter()
        decoded = dec.decode(wire.decode(frames, secret=SECRET).body)
        t2 = time.perf_counter()
        if seq > timed_from:
            t_enc += t1 - t0
            t_dec += t2 - t1
            nbytes += sum(memoryview(f).nbytes for f in frames)
            records += hit_records(dec, decoded)
    return t_enc / n * 1e6, t_dec / n * 1e6, nbytes / n, records / n


def hit_records(dec: BatchDecoder, batch: list[Any]) -> int:
    """How many hit records (frees not counted) the runs of a decoded batch hold."""
    n = 0
    for run in batch:
        if type(run) is not HitRun:
            continue
        words, p = run.words, run.start
        while p < run.end:
            w = words[p]
            if w & 3 == FREE:
                p += 1 + (w >> 2)
            else:
                n += 1
                p += 3 + dec._tables["hit"][w >> 2].n_slots
    return n


def e2e(*, ops: int, repeat: int, rounds: int) -> dict[str, list[float]]:
    import torch.distributed as dist
    from torch.distributed.tensor import DeviceMesh as UpstreamMesh
    from torch.distributed.tensor import distribute_tensor

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29613")
    dist.init_process_group("gloo", rank=0, world_size=1)
    mesh = dt.init_device_mesh("cpu", (1,), mode="process")
    executor = get_session().executor
    runner = executor.runner
    encoder, outbox, default_batch = runner._encoder, runner.outbox, executor.batch_size
    default_held = outbox.max_held
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

        #: label -> (hit records, executor batch size, outbox max_held); all JSON in batches of 64 published as
        #: they come is the wire before codec v2; max_held 1 publishes every chunk at once (no outbox holding)
        cases: dict[str, tuple[bool, int, int] | None] = {
            "DTensor (world 1)": None,
            "process, all JSON, batch 64, no holding (v1 wire)": (False, 64, 1),
            "process, hit records, batch 256, no holding (2026-12-05)": (True, 256, 1),
            f"process, hit records, chunks of {default_batch}, outbox holds up to {default_held} (default)": (
                True,
                default_batch,
                default_held,
            ),
        }
        out: dict[str, list[float]] = {label: [] for label in cases}
        for r in range(rounds):
            for label, case in cases.items():
                if case is None:
                    us = chain_us(ustep, lambda: None, ops=ops, repeat=repeat)
                else:
                    encoder.hits, executor.batch_size, outbox.max_held = case
                    us = chain_us(dstep, dt.sync, ops=ops, repeat=repeat)
                out[label].append(us)
            log.info("round %d: %s", r, {k: round(v[-1], 1) for k, v in out.items()})
        return out
    finally:
        encoder.hits, executor.batch_size, outbox.max_held = True, default_batch, default_held
        dt.shutdown()
        dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--ops", type=int, default=1000)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--flux-layers", type=int, nargs=2, default=(1, 1), metavar=("DOUBLE", "SINGLE"))
    p.add_argument("--no-e2e", action="store_true")
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    log.setLevel(logging.INFO)
    torch.set_num_threads(1)
    load = os.getloadavg()[0]
    workloads = {
        "16x16 mul/add chain": (capture(args.ops), 0),
        f"tiny FLUX step ({args.flux_layers[0]}+{args.flux_layers[1]} blocks)": capture_flux(
            tuple(args.flux_layers)
        ),
    }
    print(
        f"# process wire, {platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, load {load:.1f}; "
        f"medians of {args.rounds} alternating rounds"
    )
    print(
        "\n| codec | encoding | controller µs/op | worker µs/op | ops/s (both) | bytes/op | hits as records |"
    )
    print("|---|---|---|---|---|---|---|")
    variants = {  # label: (hits, native)
        "all JSON": (False, None),
        f"hit records (v{VERSION}), Python encoder": (True, False),
        f"hit records (v{VERSION})": (True, None),  # the default: the C++ lane where it is built
    }
    if native_replay.hit_encoder() is None:
        del variants[f"hit records (v{VERSION}), Python encoder"]
    for name, (batches, first) in workloads.items():
        cells: dict[str, list[tuple[float, float, float, float]]] = {v: [] for v in variants}
        for _ in range(args.rounds):
            for label, (hits, native) in variants.items():
                cells[label].append(codec_round(batches, hits=hits, native=native, timed_from=first))
        for label in variants:
            c, w, nb, rec = (statistics.median(col) for col in zip(*cells[label], strict=True))
            print(f"| {name} | {label} | {c:.2f} | {w:.2f} | {1e6 / (c + w):,.0f} | {nb:.0f} | {rec:.0%} |")
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
