"""Reliability: faults and load, one table (issue 18; docs/reliability.md holds the long run's figures).

Rows:

- ``fuzz thread`` / ``fuzz process``: random chains of ops (pointwise, matmul, reductions, views, redistributes) on
  random placements of a 2-device CPU mesh, each compared with plain torch on the same inputs (``rtol=1e-4``,
  ``atol=1e-5`` times the largest magnitude the chain went through: sharded sums add in another order): ops and
  mismatches. A chain whose
  float32 torch result is itself off its float64 result by more than that is ill-conditioned (counted apart).
- ``soak thread`` / ``soak process``: controller memory slope (Python heap, ``tracemalloc``; and RSS) per op over a
  long loop of ops, uploads, redistributes and fetches after a warm-up; process mode also the workers' RSS slope.
- ``worker SIGKILL`` / ``worker SIGSTOP``: time until the controller raises ``WorkerLostError``; then leftover
  processes and files after ``dt.shutdown()``.
- ``controller SIGKILL``: a controller process killed: time until its workers exit; leftover processes and files
  (the workers remove their dead controller's socket directories and shared-memory store).
- ``no dt.shutdown()``: a script that ends without it: seconds from its last line to its exit; leftovers.
- ``bad input``: calls that must raise a clear typed error at the call (dtype errors, shape errors, bad placements,
  allocations larger than RAM, wrong options): how many did.
- ``signed-message flood``: badly signed messages sent to the controller's reply socket: all counted, controller
  heap growth.

    .venv/bin/python bench/reliability.py --short      # ~1.5 min on 2 cores (tests/executor/test_reliability_bench.py)
    .venv/bin/python bench/reliability.py              # the long run: ~10 min
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
import tracemalloc
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.tensor import Replicate, Shard

import torch_dtorch as dt
from torch_dtorch.cluster.heartbeat import HeartbeatMonitor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclass
class Row:
    name: str
    figure: str
    ok: bool
    note: str = ""


# --- helpers ------------------------------------------------------------------------------------------------------


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _wait_gone(pids: list[int], timeout: float) -> tuple[list[int], float]:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        left = [p for p in pids if _alive(p)]
        if not left:
            return [], time.monotonic() - t0
        time.sleep(0.01)
    return [p for p in pids if _alive(p)], time.monotonic() - t0


def _runner() -> Any:
    return dt.device.state.get_session().executor.runner


def _owned_paths(r: Any) -> list[str]:
    paths = [r._tmpdir, *(s._tmpdir for s in (r.net.pub, r.net.pull) if s is not None and s._tmpdir)]
    if r.net.shm is not None:
        paths.append(str(r.net.shm.path))
    return paths


def _leftovers(pids: list[int], paths: list[str], timeout: float = 3.0) -> tuple[int, int]:
    left, _ = _wait_gone(pids, timeout)
    deadline = time.monotonic() + timeout
    while any(os.path.exists(p) for p in paths) and time.monotonic() < deadline:
        time.sleep(0.02)
    return len(left), sum(os.path.exists(p) for p in paths)


def _rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS"):
                return int(line.split()[1])
    return 0


# --- fuzz ---------------------------------------------------------------------------------------------------------

_PLACEMENTS = [[Shard(0)], [Shard(1)], [Replicate()]]
_UNARY: list[tuple[str, Callable[[Any], Any]]] = [
    ("relu", torch.relu),
    ("exp", lambda a: torch.exp(a.clamp(-5, 5))),
    ("tanh", torch.tanh),
    ("neg", lambda a: -a),
    ("mul2", lambda a: a * 2.0),
    ("add1", lambda a: a + 1.0),
    ("t", lambda a: a.t().contiguous().t()),
    ("sum0", lambda a: a.sum(0, keepdim=True).expand_as(a)),
    ("sum1", lambda a: a.sum(1, keepdim=True) + a),
    ("softmax", lambda a: torch.softmax(a, -1)),
    ("square", lambda a: a * a),
]
_BINARY: list[tuple[str, Callable[[Any, Any], Any]]] = [
    ("add", torch.add),
    ("sub", torch.sub),
    ("mul", torch.mul),
    ("matmul", lambda a, b: a @ b.t() @ b / 8.0),
    ("maximum", torch.maximum),
]


def _close(got: torch.Tensor, ref: torch.Tensor, peak: float) -> bool:
    # sharded sums and matmuls add in another order: float32 rounding is relative to the largest magnitude the
    # chain went through (``peak``; an element that cancels to ~0, or a tanh of a large value, keeps that error)
    return torch.allclose(got.double(), ref.double(), rtol=1e-4, atol=1e-5 * max(1.0, peak), equal_nan=True)


def _peak(t: torch.Tensor) -> float:
    finite = t[t.isfinite()]
    return float(finite.abs().max()) if finite.numel() else 0.0


def fuzz(mode: str, seconds: float, seed: int) -> tuple[int, int, int, list[str]]:
    """Random op chains on a 2-device mesh in ``mode``; returns (ops, mismatches, ill-conditioned chains, first
    mismatches). A chain whose float32 torch result is itself not close to its float64 result (e.g. a softmax of
    values ~1e6: any rounding moves it) cannot be held to that tolerance: it is counted as ill-conditioned, not as a
    mismatch."""
    rng = random.Random(seed)
    mesh = dt.init_device_mesh("cpu", (2,), mode=mode)
    ops = mismatches = ill = 0
    bad: list[str] = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        a0 = torch.randn(8, 8, generator=torch.Generator().manual_seed(rng.randrange(1 << 30)))
        b = torch.randn(8, 8, generator=torch.Generator().manual_seed(rng.randrange(1 << 30)))
        a = a0
        da = dt.distribute_tensor(a, mesh, rng.choice(_PLACEMENTS))
        db = dt.distribute_tensor(b, mesh, rng.choice(_PLACEMENTS))
        chain: list[str] = []
        steps: list[tuple[Callable[..., Any], bool]] = []
        peak = max(_peak(a), _peak(b))
        for _ in range(rng.randrange(4, 16)):
            if rng.random() < 0.4:
                name, f2 = rng.choice(_BINARY)
                a, da = f2(a, b), f2(da, db)
                steps.append((f2, True))
            elif rng.random() < 0.15:
                name = "redistribute"
                da = da.redistribute(mesh, rng.choice(_PLACEMENTS))
            else:
                name, f1 = rng.choice(_UNARY)
                a, da = f1(a), f1(da)
                steps.append((f1, False))
            chain.append(name)
            peak = max(peak, _peak(a))
            ops += 1
        got = da.full_tensor()
        if _close(got, a, peak):
            continue
        exact, b64 = a0.double(), b.double()
        for f, binary in steps:
            exact = f(exact, b64) if binary else f(exact)
        if not _close(a, exact, peak):
            ill += 1
            continue
        mismatches += 1
        if len(bad) < 3:
            bad.append(" -> ".join(chain))
    dt.shutdown()
    return ops, mismatches, ill, bad


# --- soak ---------------------------------------------------------------------------------------------------------


def soak(mode: str, ops: int) -> tuple[float, float, float | None]:
    """Bytes per op: controller Python heap slope, controller RSS slope, worst worker RSS slope (process mode)."""
    mesh = dt.init_device_mesh("cpu", (2,), mode=mode)
    x = dt.distribute_tensor(torch.randn(16, 16), mesh, [Shard(0)])
    pids = [m.proc.pid for m in _runner().members.values()] if mode == "process" else []

    def run(n: int) -> int:
        done = 0
        y = x
        for i in range(n // 8):
            y = torch.relu(y * 0.5 + x)  # 3 ops (fast path)
            z = dt.distribute_tensor(torch.full((16, 16), float(i)), mesh, [Shard(1)])  # an upload
            w = z.redistribute(mesh, [Replicate()])  # a redistribute
            y = y + w.sum(0, keepdim=True) * 0.0  # 3 ops
            done += 8
            if i % 32 == 31:
                y.full_tensor()
                y = x
        y.full_tensor()
        return done

    run(max(2000, ops // 5))  # warm-up: caches and pools reach their steady size
    gc.collect()
    tracemalloc.start()
    heap0, rss0, w0 = tracemalloc.get_traced_memory()[0], _rss_kib(os.getpid()), [_rss_kib(p) for p in pids]
    n = run(ops)
    gc.collect()
    heap1, rss1, w1 = tracemalloc.get_traced_memory()[0], _rss_kib(os.getpid()), [_rss_kib(p) for p in pids]
    tracemalloc.stop()
    dt.shutdown()
    worker = max((b - a) * 1024 / n for a, b in zip(w0, w1, strict=True)) if pids else None
    return (heap1 - heap0) / n, (rss1 - rss0) * 1024 / n, worker


# --- faults -------------------------------------------------------------------------------------------------------


def worker_fault(sig: signal.Signals) -> tuple[float, int, int]:
    """Seconds until the controller notices ``sig`` sent to a worker; leftover processes and paths after shutdown."""
    mesh = dt.init_device_mesh("cpu", (2,), mode="process")
    x = dt.distribute_tensor(torch.arange(4.0), mesh, [Shard(0)])
    (x + 1).full_tensor()
    r = _runner()
    pids, paths = [m.proc.pid for m in r.members.values()], _owned_paths(r)
    t0 = time.monotonic()
    os.kill(pids[0], sig)
    while r.failure is None and time.monotonic() - t0 < 30:
        time.sleep(0.005)
    took = time.monotonic() - t0
    try:
        (x * 2).full_tensor()
        raised = False
    except Exception:  # noqa: BLE001 - WorkerLostError expected
        raised = True
    dt.shutdown()
    if sig == signal.SIGSTOP:
        try:
            os.kill(pids[0], signal.SIGKILL)  # the runner killed it; make sure
        except ProcessLookupError:
            pass
    procs, files = _leftovers(pids, paths)
    return (took if raised else float("inf")), procs, files


_CONTROLLER = textwrap.dedent(
    """
    import json, sys, time, torch
    import torch_dtorch as dt
    from torch.distributed.tensor import Shard
    sys.path.insert(0, sys.argv[2])
    from bench.reliability import _owned_paths, _runner
    mesh = dt.init_device_mesh("cpu", (2,), mode="process")
    x = dt.distribute_tensor(torch.arange(8.0), mesh, [Shard(0)])
    (x * 2).full_tensor()
    r = _runner()
    print(json.dumps({"pids": [m.proc.pid for m in r.members.values()], "paths": _owned_paths(r)}), flush=True)
    print("END", flush=True)
    if sys.argv[1] == "hang":
        time.sleep(600)
    """
)


def baseline_exit_s() -> float:
    """Seconds a script that only imports torch and torch_dtorch takes to exit after its last line (interpreter
    teardown; over a second on a loaded 2-core machine): what ``no dt.shutdown()`` is compared with."""
    code = "import time, torch, torch_dtorch\nprint('END', flush=True)"
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    assert proc.stdout is not None
    proc.stdout.readline()
    t0 = time.monotonic()
    proc.wait(timeout=60)
    return time.monotonic() - t0


def controller_script(mode: str) -> tuple[float, int, int]:
    """``hang``: SIGKILL the controller, seconds until its workers are gone. ``exit``: a script without
    ``dt.shutdown()``, seconds from its last line to its exit. Both: leftover processes and paths."""
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    proc = subprocess.Popen(
        [sys.executable, "-c", _CONTROLLER, mode, ROOT], stdout=subprocess.PIPE, text=True, env=env, cwd=ROOT
    )
    assert proc.stdout is not None
    info = json.loads(proc.stdout.readline())
    proc.stdout.readline()
    t0 = time.monotonic()
    if mode == "hang":
        proc.kill()
        proc.wait()
        _wait_gone(info["pids"], 30)
        took = time.monotonic() - t0
    else:
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        took = time.monotonic() - t0
    procs, files = _leftovers(info["pids"], info["paths"])
    return took, procs, files


# --- bad input ----------------------------------------------------------------------------------------------------


def bad_inputs() -> tuple[int, int, list[str]]:
    """Calls that must raise a clear error at the call: (tried, clear, the unclear ones)."""
    from torch_dtorch.backend.options import CompileOptions
    from torch_dtorch.executor.memory_check import host_available_bytes

    mesh = dt.init_device_mesh("cpu", (2,))
    i = dt.distribute_tensor(torch.arange(16).reshape(4, 4), mesh, [Shard(0)])
    f = dt.distribute_tensor(torch.randn(4, 4), mesh, [Shard(0)])
    m = dt.distribute_tensor(torch.rand(4, 4) > 0.5, mesh, [Replicate()])
    g = dt.distribute_tensor(torch.randn(3, 5), mesh, [Replicate()])
    rows = (host_available_bytes() or 1 << 40) // 4096 + 1
    cases: dict[str, Callable[[], Any]] = {
        "int @ float": lambda: i @ f,
        "bool & float": lambda: m & f,
        "integer // 0": lambda: i // 0,
        "integer % 0": lambda: i % 0,
        "float | float": lambda: f | f,
        "shape mismatch add": lambda: f + g,
        "shape mismatch mm": lambda: f @ g,
        "bad view": lambda: f.view(5, 3),
        "Shard dim out of range": lambda: dt.distribute_tensor(torch.randn(4), mesh, [Shard(3)]),
        "too many placements": lambda: dt.distribute_tensor(torch.randn(4), mesh, [Shard(0), Shard(0)]),
        "ones larger than RAM": lambda: dt.ones(rows, 1024, device_mesh=mesh, placements=[Replicate()]),
        "unknown compile option": lambda: CompileOptions.parse({"nope": 1}, backend="dtorch"),
        "bad compile file option": lambda: CompileOptions.parse({"file": 3}, backend="dtorch_debug"),
        "in-place int += float": lambda: i.add_(f),
    }
    unclear: list[str] = []
    for name, fn in cases.items():
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - what we measure
            text = str(e)
            if len(text) < 20 or type(e).__name__ in (
                "RecursionError",
                "AttributeError",
                "KeyError",
                "IndexError",
            ):
                unclear.append(f"{name}: {type(e).__name__}: {text[:80]}")
            continue
        unclear.append(f"{name}: no error at the call")
    torch.testing.assert_close((f + 1).full_tensor().shape, torch.Size([4, 4]))  # the mesh still works
    dt.shutdown()
    return len(cases), len(cases) - len(unclear), unclear


def flood(messages: int) -> tuple[int, int]:
    """Badly signed messages to the controller: (counted, controller heap growth in bytes)."""
    import zmq

    from torch_dtorch.cluster.transport import MessageKind
    from torch_dtorch.cluster.transport.wire import encode

    mesh = dt.init_device_mesh("cpu", (2,), mode="process")
    x = dt.distribute_tensor(torch.arange(4.0), mesh, [Shard(0)])
    r = _runner()
    push = zmq.Context.instance().socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 0)
    push.connect(r.net.pull.endpoint)
    bad = encode({"v": "y" * 200}, kind=MessageKind.ACK, seq=1, sender="w0", secret=b"z" * 32)
    warm = min(1000, messages // 4)
    for _ in range(warm):
        push.send_multipart(bad)
    while len(r.rejected) < warm:
        time.sleep(0.01)
    gc.collect()
    tracemalloc.start()
    h0 = tracemalloc.get_traced_memory()[0]
    for _ in range(messages):
        push.send_multipart(bad)
    deadline = time.monotonic() + 120
    while len(r.rejected) < warm + messages and time.monotonic() < deadline:
        time.sleep(0.01)
    gc.collect()
    grown = tracemalloc.get_traced_memory()[0] - h0
    tracemalloc.stop()
    push.close()
    counted = len(r.rejected) - warm
    (x + 1).full_tensor()
    dt.shutdown()
    return counted, grown


# --- main ---------------------------------------------------------------------------------------------------------


def run(*, short: bool, seed: int = 0) -> list[Row]:
    fuzz_s = 3.0 if short else 240.0
    soak_ops = 3000 if short else 100_000
    flood_n = 2000 if short else 50_000
    rows: list[Row] = []
    for mode in ("thread", "process"):
        n, bad, ill, first = fuzz(mode, fuzz_s, seed)
        figure = (
            f"{n} ops, {bad} mismatches ({ill} ill-conditioned chains: float32 torch is off its float64 too)"
        )
        rows.append(Row(f"fuzz {mode}", figure, bad == 0, "; ".join(first)))
    for mode in ("thread", "process"):
        heap, rss, worker = soak(mode, soak_ops)
        w = f", workers RSS {worker:+.1f} B/op" if worker is not None else ""
        # flat: the controller's Python heap grows <= 1 MB over the run after the warm-up (<= 10 B/op over 100k
        # ops); RSS moves in pages and allocator arenas: reported, not judged
        figure = f"heap {heap:+.1f} B/op, RSS {rss:+.1f} B/op{w} ({soak_ops} ops)"
        rows.append(Row(f"soak {mode}", figure, heap * soak_ops <= 1 << 20))
    silence = HeartbeatMonitor().death_timeout_s  # DTORCH_HEARTBEAT_TIMEOUT_S, default 5 s
    for sig in (signal.SIGKILL, signal.SIGSTOP):
        took, procs, files = worker_fault(sig)
        # a killed worker breaks its stream (at once); a stopped one is only silent (the timeout, + detection)
        limit = 2.0 if sig == signal.SIGKILL else silence + 1.0
        rows.append(
            Row(
                f"worker {sig.name}",
                f"WorkerLostError after {took:.2f} s (heartbeat timeout {silence:g} s); leftovers: {procs} "
                f"processes, {files} paths",
                took < limit and procs == 0 and files == 0,
            )
        )
    took, procs, files = controller_script("hang")
    rows.append(
        Row(
            "controller SIGKILL",
            f"workers gone after {took:.2f} s; leftovers: {procs} processes, {files} paths",
            took < 5 and procs == 0 and files == 0,
        )
    )
    took, procs, files = controller_script("exit")
    base = baseline_exit_s()
    rows.append(
        Row(
            "no dt.shutdown()",
            f"exited {took:.2f} s after its last line (import-only script: {base:.2f} s); leftovers: {procs} "
            f"processes, {files} paths",
            took < base + 2.0 and procs == 0 and files == 0,
        )
    )
    tried, clear, unclear = bad_inputs()
    rows.append(
        Row(
            "bad input",
            f"{clear}/{tried} raised a clear error at the call",
            clear == tried,
            "; ".join(unclear),
        )
    )
    counted, grown = flood(flood_n)
    rows.append(
        Row(
            "signed-message flood",
            f"{counted}/{flood_n} counted, controller heap {grown / 1024:+.1f} KiB",
            counted == flood_n and grown < 256 << 10,
        )
    )
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--short", action="store_true", help="small sizes (~1 min; what the test suite runs)")
    p.add_argument("--seed", type=int, default=0, help="fuzzer seed")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.ERROR)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    t0 = time.monotonic()
    rows = run(short=args.short, seed=args.seed)
    width = max(len(r.name) for r in rows)
    print(f"{'check':{width}s}  {'result':78s}  ok")
    for r in rows:
        print(f"{r.name:{width}s}  {r.figure:78s}  {'yes' if r.ok else 'NO'}")
        if r.note:
            print(f"{'':{width}s}    {r.note}")
    print(f"({time.monotonic() - t0:.0f} s, {'short' if args.short else 'long'} mode)")
    return 0 if all(r.ok for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
