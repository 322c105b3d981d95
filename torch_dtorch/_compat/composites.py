"""Keeping CompositeImplicitAutograd ops whole while tracing dtorch tensors, on tracers that would decompose them.

Wraps ``torch._ops.OpOverload.decompose`` (patched while a thread traces, see :func:`keep_composites_whole`) and
checks for ``autograd_would_have_decomposed`` in ``torch._subclasses.functional_tensor`` and
``torch.fx.experimental.proxy_tensor`` (the tracers of torch >= 2.12 keep such ops whole by themselves).

Mutable state lives here: set :data:`FORCE_COMPOSITE_FALLBACK` on this module
(``torch_dtorch._compat.composites``), not on the ``torch_dtorch._compat`` package, which does not re-export it.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Iterator
from typing import Any

import torch

from torch_dtorch._compat.device import has_kernel_for_dispatch_key

#: tests set this to exercise the fallback of :func:`keep_composites_whole` on a torch that does not need it
FORCE_COMPOSITE_FALLBACK = False


@functools.cache
def native_composite_check() -> bool:
    """Whether this torch's tracers (functionalization and proxy tracing) keep a CompositeImplicitAutograd op whole
    where eager autograd would not have decomposed it, i.e. where the input's device has a backend kernel for it
    (``autograd_would_have_decomposed``, consulted by both). Older tracers call ``OpOverload.decompose`` on every
    functional composite op; :func:`keep_composites_whole` then steps in."""
    import importlib

    return all(
        hasattr(importlib.import_module(m), "autograd_would_have_decomposed")
        for m in ("torch._subclasses.functional_tensor", "torch.fx.experimental.proxy_tensor")
    )


_KEEP = threading.local()
_KEEP_LOCK = threading.Lock()
_KEEP_USERS = 0
_ORIGINAL_DECOMPOSE: Any = torch._ops.OpOverload.decompose


def _keeping_decompose(self: Any, *args: Any, **kwargs: Any) -> Any:
    device_type = getattr(_KEEP, "device_type", None)
    if device_type is not None:
        for a in torch.utils._pytree.tree_leaves((args, kwargs)):
            if isinstance(a, torch.Tensor):  # the first tensor decides, as in autograd_would_have_decomposed
                if a.device.type == device_type and has_kernel_for_dispatch_key(self, "PrivateUse1"):
                    return NotImplemented  # callers then trace the op whole
                break
    return _ORIGINAL_DECOMPOSE(self, *args, **kwargs)


@contextlib.contextmanager
def keep_composites_whole(device_type: str, *, force: bool = False) -> Iterator[bool]:
    """While tracing in this thread, keep a composite op whole when its first tensor input is on ``device_type``
    (the PrivateUse1 device) and the op has a PrivateUse1 kernel — what eager autograd does, and what torch's tracers
    do by themselves where :func:`native_composite_check` holds (then this is a no-op unless ``force`` or
    :data:`FORCE_COMPOSITE_FALLBACK`).

    The fallback makes ``OpOverload.decompose`` return ``NotImplemented`` for such calls, which every tracer
    (functionalization, proxy tracing, fake tensors) takes as "no decomposition": the op is recorded as called.
    ``decompose`` is patched only while some thread is inside this context, and acts only in those threads.
    Yields whether the fallback is active."""
    global _KEEP_USERS
    if not (force or FORCE_COMPOSITE_FALLBACK) and native_composite_check():
        yield False
        return
    with _KEEP_LOCK:
        if _KEEP_USERS == 0:
            torch._ops.OpOverload.decompose = _keeping_decompose  # type: ignore[method-assign]
        _KEEP_USERS += 1
    saved = getattr(_KEEP, "device_type", None)
    _KEEP.device_type = device_type
    try:
        yield True
    finally:
        _KEEP.device_type = saved
        with _KEEP_LOCK:
            _KEEP_USERS -= 1
            if _KEEP_USERS == 0:
                torch._ops.OpOverload.decompose = _ORIGINAL_DECOMPOSE  # type: ignore[method-assign]
