"""Drawing OpInfo samples outside unittest, quickly (shared by tests/rules and tests/conformance)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


@contextlib.contextmanager
def quick_sample_inputs() -> Iterator[None]:
    """``OpInfo.sample_inputs`` looks for the calling unittest test with ``inspect.stack()``, which reads the source
    of every frame of pytest's deep stack (a third of the samples' time): there is no unittest test to find here."""
    from torch.testing._internal import common_utils
    from torch.testing._internal.opinfo import core

    modules = [m for m in (common_utils, core) if hasattr(m, "extract_test_fn")]  # core imports it by name
    saved = [m.extract_test_fn for m in modules]
    for m in modules:
        m.extract_test_fn = lambda: None
    try:
        yield
    finally:
        for m, fn in zip(modules, saved):
            m.extract_test_fn = fn
