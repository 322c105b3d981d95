"""Helpers to run a heartbeat worker in a subprocess, started fast (no ``import torch``)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch_dtorch

PKG_DIR = Path(torch_dtorch.__file__).resolve().parent

# Registers bare parent packages so that only the heartbeat modules (and torch_dtorch.errors) are imported:
# the real package __init__ imports torch, which costs seconds per process on the CI machines.
WORKER_SCRIPT = r"""
import os, sys, time, types
pkg, addr, wid, mode = sys.argv[1:5]
for name, sub in (("torch_dtorch", ""), ("torch_dtorch.executor", "executor")):
    m = types.ModuleType(name)
    m.__path__ = [os.path.join(pkg, sub)]
    sys.modules[name] = m
from torch_dtorch.cluster.heartbeat import HeartbeatClient
assert "torch" not in sys.modules
client = HeartbeatClient(addr, wid, interval_s=0.05).start()
client.set_state("aten.mm.default")
print("ready", flush=True)
if mode == "busy":
    time.sleep(1.0)                    # main thread blocked in a GIL-releasing call
    end = time.monotonic() + 1.0
    while time.monotonic() < end:      # main thread spinning in pure Python (holds the GIL)
        pass
    client.set_state(None)
    print("done", flush=True)
time.sleep(60)
"""


def spawn_worker(addr: str, worker_id: str, mode: str = "idle") -> subprocess.Popen[str]:
    env = dict(os.environ)
    return subprocess.Popen(
        [sys.executable, "-c", WORKER_SCRIPT, str(PKG_DIR), addr, worker_id, mode],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


def reap(proc: subprocess.Popen[str]) -> None:
    """Kill (after SIGCONT, in case it was stopped) and wait: no leaked processes."""
    if proc.poll() is None:
        try:
            proc.send_signal(__import__("signal").SIGCONT)
        except ProcessLookupError:
            pass
        proc.kill()
    proc.wait(timeout=10)
    for stream in (proc.stdout, proc.stderr):
        if stream is not None:
            stream.close()
