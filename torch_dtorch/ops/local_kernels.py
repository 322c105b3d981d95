"""Local kernels compiled per worker: a plain-torch reference function, compiled with inductor (Triton) on CUDA.

The fused and quantized ops (``placement_rules/families/fused.py``, ``quantized.py``) are ``torch.library`` custom
ops whose device implementation is a :class:`LocalKernel`: on CPU tensors it runs the reference function as it is
(the yardstick the tests compare with); on CUDA tensors it runs ``torch.compile(reference, fullgraph=True)``, one
compiled function per CUDA device — so each worker (thread or process) compiles and caches its own kernel for its
own local shapes: static for the first shape, one dynamic-shape kernel after a second one arrives (dynamo's
automatic dynamic shapes), so the many (tokens, features) shapes of a transformer stay well under dynamo's
recompile limit. ``DTORCH_LOCAL_KERNEL_COMPILE=0`` runs the
reference on CUDA too (for debugging, or where no Triton is installed).

Compilation happens outside any trace: inside a compiled dtorch program the op is opaque (the worker's inductor
sees a call to it) and the call lands here at run time — unless its family registered a decomposition
(:mod:`torch_dtorch.ops.decompositions`; the quantized linears and the fused ops do): then inductor lowers the
op's arithmetic with the rest of the graph and this kernel is not called.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["LocalKernel", "local_kernel", "local_kernel_compile_enabled"]

log = logging.getLogger(__name__)


def local_kernel_compile_enabled() -> bool:
    """``DTORCH_LOCAL_KERNEL_COMPILE`` (default ``1``): compile local kernels on CUDA."""
    return os.environ.get("DTORCH_LOCAL_KERNEL_COMPILE", "1").strip() != "0"


def _device_of(args: tuple[Any, ...]) -> torch.device | None:
    for a in args:
        if isinstance(a, torch.Tensor):
            return a.device
    return None


class LocalKernel:
    """``reference`` on CPU; compiled per CUDA device (see the module docstring). Call it like ``reference``."""

    def __init__(self, reference: Callable[..., Any], *, name: str | None = None) -> None:
        self.reference = reference
        self.name = name or reference.__name__
        self._compiled: dict[int, Callable[..., Any]] = {}
        self._lock = threading.Lock()

    def compiled_for(self, device: torch.device) -> Callable[..., Any]:
        """The compiled kernel of one CUDA device (made at the first call)."""
        index = device.index if device.index is not None else torch.cuda.current_device()
        fn = self._compiled.get(index)
        if fn is None:
            with self._lock:
                fn = self._compiled.get(index)
                if fn is None:
                    log.debug("local kernel %s: compiling for cuda:%d", self.name, index)
                    fn = torch.compile(self.reference, fullgraph=True)
                    self._compiled[index] = fn
        return fn

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        device = _device_of(args)
        if device is None or device.type != "cuda" or not local_kernel_compile_enabled():
            return self.reference(*args, **kwargs)
        return self.compiled_for(device)(*args, **kwargs)

    def __repr__(self) -> str:
        return f"LocalKernel({self.name}, compiled on {sorted(self._compiled)})"


def local_kernel(reference: Callable[..., Any]) -> LocalKernel:
    """Decorator form of :class:`LocalKernel`."""
    return LocalKernel(reference)
