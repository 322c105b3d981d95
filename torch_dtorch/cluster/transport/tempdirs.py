"""Private socket directories of a controller, named after their owner: ``<tmp>/dtorch-<kind>-<pid>-<random>``.

A controller's ``ipc://`` sockets live in directories it creates mode ``0700`` (:func:`private_dir`) and removes at
shutdown. A controller that dies without shutting down (SIGKILL, OOM kill, killed while hung at exit) cannot remove
them, so whoever notices cleans up after it, once the owner process is gone:

* the next controller that starts (:func:`cleanup_stale_dirs`, for every such directory of this user);
* its workers, when they notice the controller is gone (:func:`remove_if_orphaned` on the endpoints they used).

The owner is the pid in the name; a directory whose owner still runs (or is not ours) is never touched.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import stat
import tempfile
import time
from pathlib import Path

from torch_dtorch._proc import pid_alive

__all__ = [
    "cleanup_stale_dirs",
    "owner_pid",
    "pid_alive",
    "private_dir",
    "remove_if_orphaned",
    "remove_store_if_orphaned",
]

log = logging.getLogger(__name__)

_NAME = re.compile(r"^dtorch-(?:cluster|sock)-(\d+)-[A-Za-z0-9_]+$")
_STORE_NAME = re.compile(
    r"^dtorch-store-(\d+)-[A-Za-z0-9_-]+$"
)  # collectives.shm_store's session directories


def private_dir(kind: str) -> str:
    """A fresh ``0700`` directory ``dtorch-<kind>-<this pid>-<random>`` in the temp directory (``kind``: ``cluster``
    for the control socket, ``sock`` for a transport socket)."""
    if kind not in ("cluster", "sock"):
        raise ValueError(f"private_dir: kind must be 'cluster' or 'sock', got {kind!r}")
    return tempfile.mkdtemp(prefix=f"dtorch-{kind}-{os.getpid()}-")


def owner_pid(path: str | os.PathLike[str]) -> int | None:
    """The owner pid in the name of a directory made by :func:`private_dir`; ``None`` for any other path."""
    m = _NAME.match(Path(path).name)
    return int(m.group(1)) if m else None


def _remove(path: str, pid: int, *, wait_s: float = 0.0) -> bool:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
        return False
    deadline = time.monotonic() + wait_s
    while pid_alive(pid):  # a killed process may still be tearing down (its sockets close before it is gone)
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.02)
    shutil.rmtree(path, ignore_errors=True)
    log.info("removed %s: its owner (pid %d) is gone", path, pid)
    return True


def cleanup_stale_dirs(base: str | os.PathLike[str] | None = None) -> list[str]:
    """Remove this user's ``dtorch-{cluster,sock}-<pid>-*`` directories in ``base`` (default: the temp directory)
    whose owner process is gone; returns the removed paths."""
    root = str(base) if base is not None else tempfile.gettempdir()
    removed: list[str] = []
    try:
        entries = list(os.scandir(root))
    except OSError:
        return removed
    for entry in entries:
        m = _NAME.match(entry.name)
        if m is not None and _remove(entry.path, int(m.group(1))):
            removed.append(entry.path)
    return removed


def remove_store_if_orphaned(path: str | os.PathLike[str], *, wait_s: float = 0.0) -> bool:
    """A shared-memory store directory ``dtorch-store-<pid>-*`` whose owner is gone (a zombie counts as gone;
    ``wait_s``: how long to wait for it to go): remove it. True when removed."""
    m = _STORE_NAME.match(Path(path).name)
    return m is not None and _remove(str(path), int(m.group(1)), wait_s=wait_s)


def remove_if_orphaned(endpoint: str, *, wait_s: float = 0.0) -> bool:
    """``ipc://<dir>/<name>.sock`` with ``dir`` made by :func:`private_dir` and its owner gone (``wait_s``: how
    long to wait for it to go): remove ``dir``. Anything else (TCP, another directory, an owner still running) is
    left alone. True when removed."""
    if not endpoint.startswith("ipc://"):
        return False
    directory = os.path.dirname(endpoint[len("ipc://") :])
    pid = owner_pid(directory)
    return pid is not None and _remove(directory, pid, wait_s=wait_s)
