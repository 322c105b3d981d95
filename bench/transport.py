"""Controller <-> worker transport: thread mode against process mode, and process mode against a raw ZMQ round trip
measured in the same run (the floor for any message between two processes).

- ``sync``: ``dt.sync()`` on an idle 2-device mesh = one batch (a barrier) published and a marker back from every
  worker: the per-batch round trip.
- ``1 MiB`` / ``64 MiB``: ``distribute_tensor`` (Replicate: the whole tensor to each of 2 workers) then
  ``full_tensor`` (one copy back): 3x the size moved.
- ``raw zmq``: PUSH -> child process -> PUSH back of a 16-byte message over ``ipc://`` (no signing, no codec).

    .venv/bin/python bench/transport.py [--iters 200]
"""

from __future__ import annotations

import argparse
import logging
import statistics
import subprocess
import sys
import tempfile
import time

import torch

import torch_dtorch as dt
from torch_dtorch import Replicate

ECHO = """
import sys, zmq
ctx = zmq.Context()
pull = ctx.socket(zmq.PULL); pull.connect(sys.argv[1])
push = ctx.socket(zmq.PUSH); push.connect(sys.argv[2])
while True:
    m = pull.recv_multipart()
    if m == [b"stop"]:
        break
    push.send_multipart(m)
"""


def raw_zmq_rtt_us(iters: int) -> float:
    import zmq

    d = tempfile.mkdtemp(prefix="dtorch-bench-")
    a, b = f"ipc://{d}/a", f"ipc://{d}/b"
    ctx = zmq.Context.instance()
    out = ctx.socket(zmq.PUSH)
    out.bind(a)
    back = ctx.socket(zmq.PULL)
    back.bind(b)
    child = subprocess.Popen([sys.executable, "-c", ECHO, a, b])
    try:
        msg = [b"x" * 16]
        for _ in range(20):  # warm-up (and wait for the child to connect)
            out.send_multipart(msg)
            back.recv_multipart()
        times = []
        for _ in range(iters):
            t0 = time.perf_counter()
            out.send_multipart(msg)
            back.recv_multipart()
            times.append(time.perf_counter() - t0)
        out.send_multipart([b"stop"])
        child.wait(10)
    finally:
        if child.poll() is None:
            child.kill()
        out.close(0)
        back.close(0)
    return statistics.median(times) * 1e6


def measure(mode: str, iters: int) -> dict[str, float]:
    mesh = dt.init_device_mesh("cpu", (2,), mode=mode)
    dt.sync()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        dt.sync()
        times.append(time.perf_counter() - t0)
    out = {"sync_us": statistics.median(times) * 1e6}
    for label, numel in (("1MiB", 1 << 18), ("64MiB", 1 << 24)):
        x = torch.randn(numel)
        reps = 20 if numel < (1 << 20) else 3
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            y = dt.distribute_tensor(x, mesh, [Replicate()]).full_tensor()
            ts.append(time.perf_counter() - t0)
        assert torch.equal(y, x)
        out[f"{label}_ms"] = statistics.median(ts) * 1e3
    dt.shutdown()
    return out


def main() -> None:
    logging.basicConfig(level=logging.WARNING)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--iters", type=int, default=200)
    args = p.parse_args()
    torch.set_num_threads(1)
    raw = raw_zmq_rtt_us(args.iters)
    thread = measure("thread", args.iters)
    proc = measure("process", args.iters)
    print(f"raw zmq round trip (ipc, 2 processes): {raw:8.1f} us")
    print(f"{'':28s}{'thread':>12s}{'process':>12s}{'process/thread':>16s}{'process/raw zmq':>17s}")
    print(
        f"{'per-batch round trip (sync)':28s}{thread['sync_us']:10.1f}us{proc['sync_us']:10.1f}us"
        f"{proc['sync_us'] / thread['sync_us']:16.1f}{proc['sync_us'] / raw:17.1f}"
    )
    for label in ("1MiB", "64MiB"):
        t, q = thread[f"{label}_ms"], proc[f"{label}_ms"]
        print(f"{'upload + fetch ' + label:28s}{t:10.2f}ms{q:10.2f}ms{q / t:16.1f}{'':>17s}")


if __name__ == "__main__":
    main()
