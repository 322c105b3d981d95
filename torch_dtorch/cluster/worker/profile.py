"""``DTORCH_WORKER_PROFILE=<dir>``: a cProfile of each worker process's kernel thread (where batches are received,
decoded and run), written to ``<dir>/worker-<device>-<pid>.prof`` when the batch loop ends (``SHUTDOWN``, a fatal
error). Read it with ``python -m pstats``, or ``snakeviz``. Off (no profiler, no cost) when the variable is unset."""

from __future__ import annotations

import contextlib
import cProfile
import logging
import os
from collections.abc import Iterator

__all__ = ["ENV_WORKER_PROFILE", "kernel_thread_profile"]

log = logging.getLogger("torch_dtorch.worker")

ENV_WORKER_PROFILE = "DTORCH_WORKER_PROFILE"


@contextlib.contextmanager
def kernel_thread_profile(device: int) -> Iterator[None]:
    """Profile the calling thread for the duration of the block when ``DTORCH_WORKER_PROFILE`` names a directory."""
    where = os.environ.get(ENV_WORKER_PROFILE, "").strip()
    if not where:
        yield
        return
    prof = cProfile.Profile()
    prof.enable()
    try:
        yield
    finally:
        prof.disable()
        path = os.path.join(where, f"worker-{device}-{os.getpid()}.prof")
        try:
            os.makedirs(where, exist_ok=True)
            prof.dump_stats(path)
            log.info("worker w%d: profile written to %s", device, path)
        except OSError as e:
            log.warning("worker w%d: could not write the profile %s: %s", device, path, e)
