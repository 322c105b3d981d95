"""Building and loading dtorch's C++ extensions (the controller's eager fast path, the workers' replay loop).

Each extension is one C++ source compiled with :mod:`torch.utils.cpp_extension` once per source/torch/Python version
(~30 s on 2 cores) into ``DTORCH_NATIVE_DIR`` (default ``~/.cache/torch_dtorch/native``); later imports load the
built module directly. ``DTORCH_NATIVE=0`` turns every extension off, and a machine without a C++ compiler falls back
the same way, with one warning per extension: dtorch then runs the Python paths.
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import logging
import os
import sys
import sysconfig
import threading
import time
from pathlib import Path
from types import ModuleType

import torch

__all__ = ["NativeExtension", "native_enabled"]

log = logging.getLogger(__name__)

#: a build lock older than this is a killed build's (a build takes ~30 s, a few minutes on a loaded 2-core box)
_STALE_LOCK_S = 300.0
#: how often a waiting process re-checks another process's build lock
_LOCK_POLL_S = 1.0


def native_enabled() -> bool:
    """``DTORCH_NATIVE`` (default on)."""
    return os.environ.get("DTORCH_NATIVE", "1").strip().lower() not in ("0", "false", "no", "off")


class NativeExtension:
    """One C++ source built and loaded on first use.

    Args:
        source: the ``.cpp`` file.
        prefix: the module name's prefix (the build directory is ``<prefix>_<hash of source and versions>``).
        what: what it is, for log lines (``"dtorch's native fast path"``).
        fallback: what runs without it, for the warning.
    """

    def __init__(self, source: Path, *, prefix: str, what: str, fallback: str) -> None:
        self.source = source
        self.prefix = prefix
        self.what = what
        self.fallback = fallback
        self._lock = threading.Lock()
        self._loaded: ModuleType | None = None
        self._tried = False

    def _tag(self) -> str:
        h = hashlib.sha256(self.source.read_bytes())
        h.update(f"{torch.__version__}|{sys.version}|{sysconfig.get_platform()}".encode())
        return h.hexdigest()[:16]

    def build_dir(self) -> Path:
        root = os.environ.get("DTORCH_NATIVE_DIR") or os.path.join(
            os.path.expanduser("~"), ".cache", "torch_dtorch", "native"
        )
        return Path(root) / f"{self.prefix}_{self._tag()}"

    def load(self) -> ModuleType | None:
        """The extension module, built on first use; ``None`` when disabled or when it cannot be built here."""
        if self._tried:
            return self._loaded
        with self._lock:
            if self._tried:
                return self._loaded
            if native_enabled():
                where = self.build_dir()
                name = where.name
                try:
                    so = (
                        next((p for p in where.glob(f"{name}*.so") if p.is_file()), None)
                        if where.exists()
                        else None
                    )
                    self._loaded = _import(so, name) if so is not None else self._build(where, name)
                except Exception as e:  # noqa: BLE001 - any build/load failure falls back to the Python path
                    log.warning(
                        "%s could not be built or loaded (%s: %s); using %s. Needs a C++ compiler and ninja; "
                        "DTORCH_NATIVE=0 silences this.",
                        self.what,
                        type(e).__name__,
                        str(e).splitlines()[0] if str(e) else "",
                        self.fallback,
                    )
                    self._loaded = None
            self._tried = True
            return self._loaded

    def _build(self, where: Path, name: str) -> ModuleType:
        from torch.utils.cpp_extension import load as cpp_load

        where.mkdir(parents=True, exist_ok=True)
        wait_for_build_lock(where / "lock", what=self.what)
        # ninja from the venv (pip's ``ninja``) when the venv is not activated
        os.environ["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")])
        t0 = time.perf_counter()
        log.info("building %s in %s (once per version, ~30 s)", self.what, where)
        module = cpp_load(
            name=name,
            sources=[str(self.source)],
            build_directory=str(where),
            extra_cflags=["-O2", "-DNDEBUG"],
            verbose=False,
        )
        log.info("built %s in %.1f s", self.what, time.perf_counter() - t0)
        return module


def wait_for_build_lock(lock: Path, *, what: str) -> None:
    """Wait while another process builds into the same folder (its ``lock``), at most until the lock is
    ``_STALE_LOCK_S`` old; an older lock is a killed build's and is removed. torch's own file lock waits forever on
    such a lock: a build killed once (Ctrl-C, a timeout) hung every later process."""
    warned = False
    while True:
        try:
            age = time.time() - lock.stat().st_mtime
        except FileNotFoundError:
            return
        if age > _STALE_LOCK_S:
            log.warning("removing %s: a build of %s that stopped %.0f s ago (killed)", lock, what, age)
            lock.unlink(missing_ok=True)
            return
        if not warned:
            log.warning(
                "waiting for another process's build of %s (%s, %.0f s old; removed as stale at %.0f s)",
                what, lock, age, _STALE_LOCK_S,
            )  # fmt: skip
            warned = True
        time.sleep(_LOCK_POLL_S)


def _import(path: Path, name: str) -> ModuleType:
    loader = importlib.machinery.ExtensionFileLoader(name, str(path))
    spec = importlib.util.spec_from_file_location(name, path, loader=loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module
