"""torch's autograd engine and view replay, as the ``dtorch`` device needs them.

Wraps ``torch.autograd._engine_run_backward`` (the entry both ``backward`` and ``torch.autograd.grad`` share: it
turns two INTERNAL ASSERTs of the engine that a PrivateUse1 backend provokes into a clear error or a retry on the
calling thread) and ``torch._C._is_view_replay_enabled`` / ``_set_view_replay_enabled`` (autograd's thread-local
view replay, which dtorch views need for correct gradients after in-place writes). Both are private to torch.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import torch

log = logging.getLogger(__name__)


#: the assertion torch's autograd engine raises for a backward over CUDA tensors once a PrivateUse1 backend exists
_STREAM_ASSERT = "opt_ready_stream && opt_parent_stream"


#: the assertion of an engine whose device threads started before the dtorch device existed (a backward ran before
#: ``import torch_dtorch``): its per-device queues were sized without it
_READY_QUEUE_ASSERT = "device_ready_queues_.size()"
#: set once that assertion was seen: every later backward runs on the calling thread
_ENGINE_WITHOUT_DTORCH_QUEUE = [False]


def _dtorch_roots(roots: Any) -> bool:
    """Whether every root of a backward is a dtorch tensor (or an edge of one): the engine then fails on its first
    push to the dtorch queue, after running only its graph root, so the call can be repeated."""
    items = roots if isinstance(roots, (list, tuple)) else (roots,)
    if not items:
        return False
    for r in items:
        t = r if isinstance(r, torch.Tensor) else None
        if t is None or t.device.type != "dtorch":
            return False
    return True


def explain_cuda_autograd_conflict() -> None:
    """Turn torch's INTERNAL ASSERT for a plain-CUDA backward after ``import torch_dtorch`` into a clear error.

    Registering a PrivateUse1 backend makes it torch's accelerator (``torch.accelerator.current_accelerator()``), and
    torch's autograd engine then finds no stream for nodes of CUDA tensors and asserts (pytorch/pytorch#161129). Not
    fixable from outside torch; backward and ``torch.autograd.grad`` share ``torch.autograd._engine_run_backward``,
    which is wrapped here to name the cause and the fix. dtorch's own tensors are unaffected."""
    autograd = torch.autograd
    run = getattr(autograd, "_engine_run_backward", None)
    if run is None or getattr(run, "_dtorch_explained", False):
        return

    @functools.wraps(run)
    def explained(*args: Any, **kwargs: Any) -> Any:
        if _ENGINE_WITHOUT_DTORCH_QUEUE[0]:
            with torch.autograd.set_multithreading_enabled(False):
                return run(*args, **kwargs)
        try:
            return run(*args, **kwargs)
        except RuntimeError as e:
            if _READY_QUEUE_ASSERT in str(e) and _dtorch_roots(args[0] if args else kwargs.get("t_outputs")):
                # nothing ran but the graph root: its first push to the dtorch device's queue failed
                _ENGINE_WITHOUT_DTORCH_QUEUE[0] = True
                log.warning(
                    "torch's autograd engine started its device threads before torch_dtorch was imported (a "
                    "backward ran first), so it has no queue for the dtorch device; dtorch backward passes in this "
                    "process now run on the calling thread (torch.autograd.set_multithreading_enabled(False)). "
                    "Import torch_dtorch before the first backward to keep the engine's device thread."
                )
                with torch.autograd.set_multithreading_enabled(False):
                    return run(*args, **kwargs)
            if _STREAM_ASSERT not in str(e):
                raise
            from torch_dtorch.errors import AcceleratorConflictError

            raise AcceleratorConflictError(
                "backward over CUDA tensors failed inside torch's autograd engine (INTERNAL ASSERT "
                f"'{_STREAM_ASSERT}'). Cause: `import torch_dtorch` registers the 'dtorch' device as torch's "
                "PrivateUse1 backend, which makes it the process's accelerator "
                "(torch.accelerator.current_accelerator() is dtorch), and torch's autograd then has no stream for "
                "plain CUDA tensors (pytorch/pytorch#161129). dtorch tensors are unaffected. Fix: put the model on a "
                "dtorch mesh (dt.init_device_mesh('cuda', ...)), or run plain-CUDA training in a process that does "
                "not import torch_dtorch (bench/train_gpu.py runs each mode in its own process for this)."
            ) from e

    explained._dtorch_explained = True  # type: ignore[attr-defined]
    autograd._engine_run_backward = explained  # type: ignore[attr-defined]


#: whether autograd records view functions on this thread (see :func:`replay_views`)
view_replay_enabled: Any = torch._C._is_view_replay_enabled
_set_view_replay_enabled = torch._C._set_view_replay_enabled


def replay_views() -> None:
    """Make autograd record a view function for the views the current thread makes from now on (torch's *view
    replay*, thread-local; what functionalization and backends without ``as_strided`` use). Without it, autograd
    rebuilds a view's gradient after an in-place write (``CopySlices`` for a write through a view, the view's
    regenerated ``grad_fn`` after a write to its base) with ``as_strided`` from the view's sizes, strides and
    storage offset, which on a dtorch tensor are controller-side (contiguous, offset 0), not the view's place in its
    base: wrong gradients. Called when a dtorch view op is recorded, before autograd's ``ADInplaceOrView`` kernel
    (above the dtorch kernel) reads the setting, so it holds for that view; it stays on for the thread (plain torch
    views give the same results either way; a view op then costs a little more on the CPU)."""
    if not view_replay_enabled():
        _set_view_replay_enabled(True)
