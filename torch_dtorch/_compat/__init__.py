"""Every private torch API torch-dtorch uses, in one package (supported: torch 2.11 – 2.13).

If a torch release moves one of these, this package is the only place to change. One module per concern:

- :mod:`.device`: PrivateUse1 registration, dispatch keys, the dispatch-mode stack, storage-less tensors, CUDA
  allocator statistics, alias and fake-tensor checks
- :mod:`.autograd`: the autograd engine's asserts under a PrivateUse1 backend, view replay
- :mod:`.frontend`: ``torch.compile`` front end (dynamo backend registry, capturable optimizer steps,
  aot_autograd, decompositions, static inputs)
- :mod:`.inductor`: inductor's ``compile_fx`` on aten graphs, CUDA graph trees in worker threads
- :mod:`.composites`: keeping composite ops whole while tracing on older tracers (``OpOverload.decompose``)
- :mod:`.dynamo_skip`: dynamo's per-code frame strategies (:func:`hide_from_dynamo`)
- :mod:`.quantized`: ``torch._scaled_mm``
- :mod:`.symbolic`: a ``SymInt``'s sympy expression and hint

The functions are re-exported here (``from torch_dtorch._compat import X``, ``_compat.X``). Module-level state is
not: read or set it on the module that owns it (e.g. ``torch_dtorch._compat.composites.FORCE_COMPOSITE_FALLBACK``),
since rebinding a name on this package would not reach the code that reads it.
"""

from __future__ import annotations

import torch

from torch_dtorch._compat.autograd import (
    explain_cuda_autograd_conflict,
    replay_views,
    view_replay_enabled,
)
from torch_dtorch._compat.composites import keep_composites_whole, native_composite_check
from torch_dtorch._compat.device import (
    create_empty_tensor,
    cuda_cached_free_bytes,
    dispatch_mode_depth,
    has_kernel_for_dispatch_key,
    is_alias_of,
    is_fake_tensor,
    setup_privateuse1_python_backend,
)
from torch_dtorch._compat.dynamo_skip import DYNAMO_VISIBLE, hide_from_dynamo
from torch_dtorch._compat.frontend import (
    aot_module_simplified,
    capturable_optimizers_on,
    core_decompositions,
    register_dynamo_backend,
    static_input_indices,
)
from torch_dtorch._compat.inductor import inductor_compile, inductor_compile_symbolic
from torch_dtorch._compat.quantized import scaled_mm
from torch_dtorch._compat.symbolic import sym_expr, sym_hint

TORCH_VERSION: tuple[int, int] = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])  # type: ignore[assignment]

__all__ = [
    "DYNAMO_VISIBLE",
    "TORCH_VERSION",
    "aot_module_simplified",
    "capturable_optimizers_on",
    "core_decompositions",
    "create_empty_tensor",
    "cuda_cached_free_bytes",
    "dispatch_mode_depth",
    "explain_cuda_autograd_conflict",
    "has_kernel_for_dispatch_key",
    "hide_from_dynamo",
    "inductor_compile",
    "inductor_compile_symbolic",
    "is_alias_of",
    "is_fake_tensor",
    "keep_composites_whole",
    "native_composite_check",
    "register_dynamo_backend",
    "replay_views",
    "scaled_mm",
    "setup_privateuse1_python_backend",
    "static_input_indices",
    "sym_expr",
    "sym_hint",
    "view_replay_enabled",
]
