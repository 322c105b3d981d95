"""Command line of a cluster-mode worker process: ``python -m torch_dtorch.cluster.worker --controller ENDPOINT
--device D (--secret-fd FD | --secret-file F)`` (one device, :class:`~torch_dtorch.cluster.worker.process.WorkerProcess`), and
:func:`serve`, behind ``dtorch worker`` (one such process per device of a remote host, supervised).

Exit codes: 0 ok, 1 error, 2 usage, 3 controller lost.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

from torch_dtorch.cluster.protocol import (
    DEFAULT_START_TIMEOUT_S,
    EXIT_ERROR,
    EXIT_OK,
    EXIT_USAGE,
    read_secret_fd,
    read_secret_file,
)
from torch_dtorch.cluster.transport import MessageKind, TransportError
from torch_dtorch.cluster.worker.process import WorkerProcess

__all__ = ["main", "run_and_exit", "serve"]

log = logging.getLogger("torch_dtorch.worker")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m torch_dtorch.cluster.worker", description="One dtorch worker process (one device)."
    )
    p.add_argument(
        "--controller",
        required=True,
        help="control endpoint of the controller (tcp://HOST:PORT or ipc://PATH)",
    )
    p.add_argument("--device", required=True, type=int, help="device id (mesh rank) this worker serves")
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument(
        "--secret-fd", type=int, help="read the cluster secret from this inherited file descriptor"
    )
    g.add_argument("--secret-file", help="read the cluster secret from this file (mode 0600)")
    p.add_argument(
        "--host", default=None, help="this worker's address (connect from it; reported to the controller)"
    )
    p.add_argument(
        "--local-index", type=int, default=None, help="CUDA device index on this host (default: --device)"
    )
    p.add_argument(
        "--start-timeout",
        type=float,
        default=DEFAULT_START_TIMEOUT_S,
        help="seconds to wait for the controller",
    )
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of a worker process; returns its exit code."""
    level = os.environ.get("DTORCH_LOG_LEVEL", "WARNING").strip().upper() or "WARNING"
    logging.basicConfig(
        level=level if isinstance(logging.getLevelName(level), int) else logging.WARNING,
        format=f"%(asctime)s %(levelname)s worker[pid {os.getpid()}] %(name)s: %(message)s",
    )
    args = _parser().parse_args(argv)
    try:
        secret = (
            read_secret_fd(args.secret_fd)
            if args.secret_fd is not None
            else read_secret_file(args.secret_file)
        )
    except ValueError as e:
        log.error("%s", e)
        return EXIT_USAGE
    proc = WorkerProcess(
        controller=args.controller,
        device=args.device,
        secret=secret,
        host=args.host,
        local_index=args.local_index,
        start_timeout_s=args.start_timeout,
    )
    try:
        return proc.run()
    except Exception as e:  # noqa: BLE001 - the process ends here; say why
        log.error("worker w%d failed: %s", args.device, e)
        pusher = getattr(proc, "pusher", None)
        if pusher is not None and not pusher.closed:
            try:
                pusher.send({"fatal": f"{type(e).__name__}: {e}"}, kind=MessageKind.ERROR)
                pusher.close_after_flush()
            except TransportError:
                pass
        return EXIT_ERROR


def run_and_exit(argv: Sequence[str] | None = None) -> None:
    """``main`` then ``os._exit`` (no interpreter teardown: backend threads may still hold sockets)."""
    code = main(argv)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def serve(
    *,
    controller: str,
    secret_file: str,
    devices: str,
    host: str | None = None,
    local_indices: str | None = None,
    start_timeout_s: float = DEFAULT_START_TIMEOUT_S,
) -> int:
    """``dtorch worker``: start one worker process per device of ``devices`` and supervise them; returns the first
    non-zero exit code (the others are then terminated), or 0 once every worker exited cleanly."""
    import signal
    import subprocess

    from torch_dtorch.cluster.protocol import parse_devices

    try:
        read_secret_file(secret_file)  # fail here, once, with the fix in the message
        ids = parse_devices(devices, what="--devices")
        idx = (
            parse_devices(local_indices, what="--local-indices") if local_indices else tuple(range(len(ids)))
        )
    except ValueError as e:
        log.error("dtorch worker: %s", e)
        return EXIT_USAGE
    if not ids or len(idx) != len(ids):
        log.error(
            "dtorch worker: --devices %r and --local-indices %r must name the same number of devices",
            devices,
            local_indices,
        )
        return EXIT_USAGE
    procs: list[subprocess.Popen[bytes]] = []
    for d, i in zip(ids, idx):
        cmd = [sys.executable, "-m", "torch_dtorch.cluster.worker", "--controller", controller, "--device", str(d),
               "--secret-file", secret_file, "--local-index", str(i), "--start-timeout", str(start_timeout_s)]  # fmt: skip
        if host:
            cmd += ["--host", host]
        procs.append(subprocess.Popen(cmd, stdin=subprocess.DEVNULL))

    def forward(signum: int, _frame: Any) -> None:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    code = EXIT_OK
    try:
        while any(p.poll() is None for p in procs):
            failed = [p.returncode for p in procs if p.returncode not in (None, EXIT_OK)]
            if failed and code == EXIT_OK:
                code = failed[0]
                forward(signal.SIGTERM, None)
            time.sleep(0.1)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
    failed = [p.returncode for p in procs if p.returncode != EXIT_OK]
    return code if code != EXIT_OK else (failed[0] if failed else EXIT_OK)
