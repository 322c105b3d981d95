"""The controller's Python heap: freeze what exists once a model is on the mesh (``DTORCH_GC_FREEZE``).

Eager dtorch allocates a few Python objects per op (operands, instructions) that live until the workers ran them;
torch eager allocates almost none. That is enough to trigger CPython's cyclic garbage collector, and its oldest
generation walks the whole heap: a diffusers FLUX pipeline holds ~535,000 tracked objects, so one full collection
took **329 ms** on an H100 host (2026-12-06, ``.devsrc``'s gcprobe: one per 8-step call, 20 ms per step), holding
the GIL -- in thread mode the worker thread, and so the GPU, waited as long. ``gc.freeze()`` moves every object
alive now to a permanent generation the collector skips (what inference engines such as vLLM do after start-up):
the model, its modules and weights are not garbage, and later collections only walk what came after.

:func:`freeze_startup_heap` does it **once per process**, at the first call, from the functions that place a model
on a mesh (``replicate_module`` and so ``parallelize_module``, ``fully_shard``, the diffusion app's
``parallelize_pipeline``). Objects frozen then that later become garbage *in reference cycles* are not reclaimed
(ones freed by reference counting, the usual case, are); set ``DTORCH_GC_FREEZE=0`` to keep the collector as it is.
"""

from __future__ import annotations

import gc
import logging
import os
import threading

log = logging.getLogger(__name__)

_lock = threading.Lock()
_done = False


def gc_freeze_enabled() -> bool:
    """``DTORCH_GC_FREEZE`` (default on)."""
    return os.environ.get("DTORCH_GC_FREEZE", "1").strip().lower() not in ("0", "false", "no", "off")


def freeze_startup_heap(reason: str) -> bool:
    """Collect once, then freeze every object alive (``gc.freeze``), the first time a model is placed on a mesh in
    this process; ``True`` where this call froze the heap. ``reason`` names the caller (logged)."""
    global _done
    if _done or not gc_freeze_enabled():
        return False
    with _lock:
        if _done:
            return False
        _done = True
        gc.collect()
        gc.freeze()
    log.debug(
        "%s: froze the start-up heap (%d objects) out of garbage collection", reason, gc.get_freeze_count()
    )
    return True
