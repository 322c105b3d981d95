"""The native (C++) eager fast path: building and loading ``_native.cpp``.

The extension holds the tensor table (an entry per storage, found through the storage's ``DataPtr``; its deleter
queues the free) and a boxed PrivateUse1 kernel per fast-path overload that keys a call, replays a cached template
through one Python call and makes the output tensors itself (see docs/design/decisions.md). It is compiled once
per source/torch/Python version with :mod:`torch.utils.cpp_extension` (~30 s on 2 cores) into
``DTORCH_NATIVE_DIR`` (default ``~/.cache/torch_dtorch/native``); later imports load the built module directly.

``DTORCH_NATIVE=0`` turns it off (the pure-Python table and fast path, ~2x slower per op on the controller); a
machine without a C++ compiler falls back the same way, with one warning.

    python -m torch_dtorch.device.native      # build now (``make venv`` does), print where
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

__all__ = ["build_dir", "enabled", "load"]

log = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("_native.cpp")
_LOCK = threading.Lock()
_STALE_LOCK_S = 600.0
_loaded: ModuleType | None = None
_tried = False


def enabled() -> bool:
    """``DTORCH_NATIVE`` (default on)."""
    return os.environ.get("DTORCH_NATIVE", "1").strip().lower() not in ("0", "false", "no", "off")


def _tag() -> str:
    h = hashlib.sha256(_SOURCE.read_bytes())
    h.update(f"{torch.__version__}|{sys.version}|{sysconfig.get_platform()}".encode())
    return h.hexdigest()[:16]


def build_dir() -> Path:
    root = os.environ.get("DTORCH_NATIVE_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "torch_dtorch", "native"
    )
    return Path(root) / f"dtorch_native_{_tag()}"


def _import(path: Path, name: str) -> ModuleType:
    loader = importlib.machinery.ExtensionFileLoader(name, str(path))
    spec = importlib.util.spec_from_file_location(name, path, loader=loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def _build(where: Path, name: str) -> ModuleType:
    from torch.utils.cpp_extension import load as cpp_load

    where.mkdir(parents=True, exist_ok=True)
    lock = where / "lock"
    if lock.exists() and time.time() - lock.stat().st_mtime > _STALE_LOCK_S:
        lock.unlink(missing_ok=True)  # a build that was killed: torch's file lock would wait forever
    # ninja from the venv (pip's ``ninja``) when the venv is not activated
    os.environ["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")])
    t0 = time.perf_counter()
    log.info("building dtorch's native fast path in %s (once per version, ~30 s)", where)
    module = cpp_load(
        name=name,
        sources=[str(_SOURCE)],
        build_directory=str(where),
        extra_cflags=["-O2", "-DNDEBUG"],
        verbose=False,
    )
    log.info("built dtorch's native fast path in %.1f s", time.perf_counter() - t0)
    return module


def load() -> ModuleType | None:
    """The extension module, built on first use; ``None`` when disabled or when it cannot be built here."""
    global _loaded, _tried
    if _tried:
        return _loaded
    with _LOCK:
        if _tried:
            return _loaded
        if enabled():
            where = build_dir()
            name = where.name
            try:
                so = (
                    next((p for p in where.glob(f"{name}*.so") if p.is_file()), None)
                    if where.exists()
                    else None
                )
                _loaded = _import(so, name) if so is not None else _build(where, name)
            except Exception as e:  # noqa: BLE001 - any build/load failure falls back to the Python fast path
                log.warning(
                    "dtorch's native fast path could not be built or loaded (%s: %s); using the Python one "
                    "(about 2x the controller time per op). Needs a C++ compiler and ninja; DTORCH_NATIVE=0 "
                    "silences this.",
                    type(e).__name__,
                    str(e).splitlines()[0] if str(e) else "",
                )
                _loaded = None
        _tried = True
        return _loaded


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    mod = load()
    print(f"native fast path: {'loaded from ' + str(build_dir()) if mod is not None else 'unavailable'}")
    sys.exit(0 if mod is not None or not enabled() else 1)
