"""The native (C++) eager fast path: building and loading ``_native.cpp``.

The extension holds the tensor table (an entry per storage, found through the storage's ``DataPtr``; its deleter
queues the free) and a boxed PrivateUse1 kernel per fast-path overload that keys a call, replays a cached template
through one Python call and makes the output tensors itself (see docs/design/decisions.md). It is compiled once
per source/torch/Python version (``torch_dtorch/_native_build.py``; ~30 s on 2 cores) into ``DTORCH_NATIVE_DIR``
(default ``~/.cache/torch_dtorch/native``); later imports load the built module directly.

``DTORCH_NATIVE=0`` turns it off (the pure-Python table and fast path, ~2x slower per op on the controller); a
machine without a C++ compiler falls back the same way, with one warning.

    python -m torch_dtorch.device.native      # build now (``make venv`` does), print where
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from types import ModuleType

from torch_dtorch._native_build import NativeExtension, native_enabled

__all__ = ["build_dir", "enabled", "load"]

_EXTENSION = NativeExtension(
    Path(__file__).with_name("_native.cpp"),
    prefix="dtorch_native",
    what="dtorch's native fast path",
    fallback="the Python one (about 2x the controller time per op)",
)


def enabled() -> bool:
    """``DTORCH_NATIVE`` (default on)."""
    return native_enabled()


def build_dir() -> Path:
    return _EXTENSION.build_dir()


def load() -> ModuleType | None:
    """The extension module, built on first use; ``None`` when disabled or when it cannot be built here."""
    return _EXTENSION.load()


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    mod = load()
    print(f"native fast path: {'loaded from ' + str(build_dir()) if mod is not None else 'unavailable'}")
    sys.exit(0 if mod is not None or not enabled() else 1)
