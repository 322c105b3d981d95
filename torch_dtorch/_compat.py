"""Every private torch API torch-dtorch uses, in one place (supported: torch 2.11 – 2.13).

If a torch release moves one of these, this module is the only one to change.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import logging
import sys
import threading
import types
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch

log = logging.getLogger(__name__)

__all__ = [
    "TORCH_VERSION",
    "create_empty_tensor",
    "cuda_cached_free_bytes",
    "explain_cuda_autograd_conflict",
    "dispatch_mode_depth",
    "keep_composites_whole",
    "native_composite_check",
    "has_kernel_for_dispatch_key",
    "hide_from_dynamo",
    "scaled_mm",
    "capturable_optimizers_on",
    "register_dynamo_backend",
    "setup_privateuse1_python_backend",
    "replay_views",
    "view_replay_enabled",
]

TORCH_VERSION: tuple[int, int] = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])  # type: ignore[assignment]


def has_kernel_for_dispatch_key(op: Any, key: str) -> bool:
    """Whether ``op`` (an OpOverload) has a kernel registered for dispatch key ``key``."""
    return bool(torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), key))


def cuda_cached_free_bytes(device: int) -> int:
    """Bytes PyTorch's CUDA caching allocator holds reserved but unallocated on ``device``. Read from the nested
    statistics dict: ``torch.cuda.memory_reserved`` flattens every statistic in Python first (~150 us a call, and
    the memory check reads it on the eager hot path)."""
    if not torch.cuda.is_initialized():
        return 0
    stats = torch._C._cuda_memoryStats(device)
    try:
        return max(
            0,
            int(stats["reserved_bytes"]["all"]["current"]) - int(stats["allocated_bytes"]["all"]["current"]),
        )
    except KeyError:  # a torch that reshaped its statistics: the public (slower) figures
        return max(0, torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))


def create_empty_tensor(size: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """A storage-less tensor on the PrivateUse1 device (costs ~100 bytes whatever its shape)."""
    return torch._C._acc.create_empty_tensor(tuple(size), dtype)


#: ``() -> int``: how many ``TorchDispatchMode``s are active (fake tensors, functionalization and proxy tracing of
#: torch.compile are modes): a kernel that skips the rest of the dispatcher must not do so while one is
dispatch_mode_depth = torch._C._len_torch_dispatch_stack


def setup_privateuse1_python_backend(name: str) -> None:
    """Rename PrivateUse1 and register the dummy hooks/guard a Python backend needs."""
    from torch.utils.backend_registration import _setup_privateuseone_for_python_backend

    _setup_privateuseone_for_python_backend(name)
    explain_cuda_autograd_conflict()


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


# --- torch.compile front end (torch_dtorch.backend) -----------------------------------------------------------------


def register_dynamo_backend(name: str, compiler_fn: Any) -> None:
    """Make ``torch.compile(backend=name)`` find ``compiler_fn`` once ``torch_dtorch`` is imported, also from a source
    checkout that has no installed entry points; a name already registered (the entry point, a second import) is kept."""
    from torch._dynamo.backends import registry

    if name not in registry._COMPILER_FNS:
        registry.register_backend(compiler_fn=compiler_fn, name=name)


def capturable_optimizers_on(device_type: str) -> bool:
    """Make dynamo treat parameters on ``device_type`` as it treats CUDA ones when it traces an optimizer step.

    Tracing ``opt.step``, dynamo runs ``_init_group`` eagerly and sets the group's ``capturable`` flag first when
    every parameter is a CUDA/XPU one with no state yet (``OptimizerVariable._set_capturable``), so Adam/AdamW make
    their ``step`` counters on the parameters' device; the traced code always takes the capturable path. For other
    devices the real flag stays ``False`` and ``_init_group`` makes CPU ``step`` tensors, which the compiled graph
    then updates on the device and copies back to the host after every call (one download per parameter). Wrapped
    here: groups whose parameters are all on ``device_type`` (torch's ``_get_capturable_supported_devices`` lists
    the PrivateUse1 backend) and have no state get ``capturable=True`` as CUDA groups do. Returns whether the hook
    is in place (``False`` on a torch without that method: the host copies then remain, still correct)."""
    try:
        from torch._dynamo.variables.optimizer import OptimizerVariable
    except ImportError:  # pragma: no cover - other torch versions
        return False
    original = getattr(OptimizerVariable, "_set_capturable", None)
    if original is None:
        log.debug(
            "capturable_optimizers_on: torch %s has no OptimizerVariable._set_capturable", torch.__version__
        )
        return False
    if getattr(original, "_dtorch_device", None) == device_type:
        return True

    def _set_capturable(self: Any, tx: Any) -> None:
        optimizer = self.value
        for group in optimizer.param_groups:
            params = group.get("params", [])
            if (
                "capturable" in group
                and params
                and all(p.device.type == device_type and p not in optimizer.state for p in params)
            ):
                group["capturable"] = True
        original(self, tx)

    _set_capturable._dtorch_device = device_type  # type: ignore[attr-defined]
    OptimizerVariable._set_capturable = _set_capturable  # type: ignore[method-assign]
    return True


def aot_module_simplified(gm: Any, example_inputs: Sequence[Any], **kwargs: Any) -> Any:
    """``torch._functorch.aot_autograd.aot_module_simplified`` (the functionalizing aten tracer dynamo backends use)."""
    from torch._functorch.aot_autograd import aot_module_simplified as aot

    return aot(gm, example_inputs, **kwargs)


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


def is_alias_of(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` share a storage. Works on fake and functional tensors (inductor's tracing of a worker's
    segment), where ``untyped_storage().data_ptr()`` raises "invalid python storage"."""
    return bool(torch._C._is_alias_of(a, b))  # type: ignore[attr-defined]


def is_fake_tensor(t: object) -> bool:
    """Whether ``t`` is a FakeTensor (what dynamo hands a backend as example inputs)."""
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor)


def core_decompositions(ops: Sequence[Any]) -> dict[Any, Any]:
    """``torch._decomp.get_decompositions`` restricted to ``ops`` (never the whole Core ATen table)."""
    from torch._decomp import get_decompositions

    return dict(get_decompositions(list(ops)))


def inductor_compile(
    gm: Any,
    example_inputs: Sequence[Any],
    *,
    mode: str | None = None,
    static_input_idxs: Sequence[int] | None = None,
    decompositions: Mapping[Any, Callable[..., Any]] | None = None,
) -> Any:
    """Compile an aten-level FX graph with inductor; returns a callable taking the inputs positionally.

    ``decompositions``: extra entries for inductor's decomposition table (``select_decomp_table()``, which
    ``compile_fx`` uses when given none): what inductor traces in place of those ops (dtorch's registered ops, see
    :mod:`torch_dtorch.ops.decompositions`), so that their arithmetic is lowered and fused with the graph's.

    ``static_input_idxs``: the inputs whose tensors stay the same from call to call (parameters, buffers), as
    dynamo tells inductor for a module's parameters. ``compile_fx`` called on a graph dynamo did not make treats
    no input as static, so each call would check every input's alignment (and copy a misaligned one), and CUDA
    graphs would copy every weight into their memory pool at every replay. They reach inductor's inner compile
    only while aot_autograd keeps the inputs as given (same count: no duplicate folded away).

    The graph is compiled as an inference graph whatever the calling thread's grad mode: its autograd is the outer
    aot_autograd's (dtorch's capture). A fresh thread (a worker's, or the plain-input path's compile thread) starts
    with grad enabled, and with inputs that require grad (a module's parameters) inductor then traced a joint
    graph: a forward that also returned the activations a backward would save (more ops, more buffers per call)."""
    from torch._inductor.compile_fx import compile_fx, compile_fx_inner

    config_patches: dict[str, Any] = {}
    if mode == "reduce-overhead":
        config_patches["triton.cudagraphs"] = True
        _ensure_cudagraph_tls()
    inner: Any = compile_fx_inner
    if static_input_idxs:
        count = len(example_inputs)
        static = sorted(set(static_input_idxs))

        def inner(gm: Any, inputs: Sequence[Any], **kwargs: Any) -> Any:
            if len(inputs) == count and not kwargs.get("static_input_idxs"):
                kwargs["static_input_idxs"] = static
            return compile_fx_inner(gm, inputs, **kwargs)

    table: dict[Any, Any] | None = None
    if decompositions:
        from torch._inductor.decomposition import select_decomp_table

        table = {**select_decomp_table(), **decompositions}
    with torch.no_grad():
        return compile_fx(
            gm,
            list(example_inputs),
            inner_compile=inner,
            config_patches=config_patches or None,
            decompositions=table,
        )


def static_input_indices(num_inputs: int) -> tuple[int, ...]:
    """The inputs of the graph being compiled now (called inside a backend's ``fw_compiler``) that aot_autograd
    marks static: parameters and buffers dynamo lifted (``fw_metadata.static_input_indices``); ``()`` outside one."""
    ctx = torch._guards.TracingContext.try_get()
    meta = getattr(ctx, "fw_metadata", None) if ctx is not None else None
    idxs = getattr(meta, "static_input_indices", None) or ()
    return tuple(sorted({int(i) for i in idxs if 0 <= int(i) < num_inputs}))


def _ensure_cudagraph_tls() -> None:
    """Set up CUDA graph trees' thread-local state in this thread. torch < 2.12 does it only in the thread that
    imports ``torch._inductor.cudagraph_trees`` (and copies it into autograd's threads): a dtorch worker thread
    compiling with CUDA graphs failed an ``assert torch._C._is_key_in_tls(...)`` in ``cudagraph_trees.get_obj``.
    This does what newer torch's ``_initialize_tls`` does for any thread."""
    from torch._inductor import cudagraph_trees

    local = cudagraph_trees.local
    if hasattr(local, "tree_manager_containers"):
        return
    init = getattr(cudagraph_trees, "_initialize_tls", None)
    if init is not None:
        init(local)
        return
    local.tree_manager_containers = {}
    local.tree_manager_locks = collections.defaultdict(threading.Lock)
    torch._C._stash_obj_in_tls("tree_manager_containers", local.tree_manager_containers)
    torch._C._stash_obj_in_tls("tree_manager_locks", local.tree_manager_locks)


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


# --- dynamo must not trace dtorch's own code (graph breaks) ------------------------------------------------------

#: torch_dtorch packages that hold model code (layers, model glue): dynamo traces them like user code
DYNAMO_VISIBLE = ("torch_dtorch.nn", "torch_dtorch.apps", "torch_dtorch.cli")
_HIDDEN_MODULES: set[str] = set()
_MAX_TABLE = 256


def _skip_strategy() -> Any:
    """``FrameExecStrategy(SKIP, SKIP)``: the eval-frame hook runs the frame, and every frame it calls, as plain
    Python (torch >= 2.7; ``None`` on a torch without per-code strategies)."""
    try:
        from torch._C._dynamo.eval_frame import (  # type: ignore[attr-defined]
            _FrameAction,
            _FrameExecStrategy,
        )
    except ImportError:
        return None
    return _FrameExecStrategy(_FrameAction.SKIP, _FrameAction.SKIP)


def _codes(roots: Iterable[Any], module: str) -> list[types.CodeType]:
    """The code objects defined in ``module`` reachable from ``roots`` (its globals): functions, class bodies,
    nested functions and lambdas (``co_consts``), and functions held in small module-level tables (kernel tables;
    large ones are registries filled at run time)."""
    out: list[types.CodeType] = []
    seen: set[int] = set()
    stack: list[tuple[Any, int]] = [(r, 0) for r in roots]
    while stack:
        obj, depth = stack.pop()
        if isinstance(obj, (str, int, float, bool, type(None), torch._ops.OpOverload)) or id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, types.CodeType):
            out.append(obj)
            stack.extend((c, depth) for c in obj.co_consts if isinstance(c, types.CodeType))
        elif isinstance(obj, (staticmethod, classmethod)):
            stack.append((obj.__func__, depth))
        elif isinstance(obj, property):
            stack.extend((f, depth) for f in (obj.fget, obj.fset, obj.fdel) if f is not None)
        elif isinstance(obj, functools.partial):
            stack.append((obj.func, depth))
        elif isinstance(obj, (tuple, list, set, frozenset, dict)):
            if depth == 0 and len(obj) <= _MAX_TABLE:
                stack.extend((v, 1) for v in (obj.values() if isinstance(obj, dict) else obj))
        elif getattr(obj, "__module__", None) == module:
            code = getattr(obj, "__code__", None)
            if isinstance(code, types.CodeType):
                stack.append((code, depth))
            wrapped = getattr(obj, "__wrapped__", None)  # functools.wraps / cache
            if wrapped is not None:
                stack.append((wrapped, depth))
            if isinstance(obj, type):
                stack.extend((v, depth) for v in vars(obj).values())
    return out


def hide_from_dynamo(modules: Iterable[types.ModuleType] | None = None) -> int:
    """Make dynamo's frame hook run dtorch's own code as plain Python, and everything that code calls.

    Model code compiled with ``torch.compile`` runs eagerly around a graph break, with dynamo's frame hook still
    installed: every Python frame entered from there is a candidate for compilation, the ``dtorch`` device's
    dispatch kernels (called by the dispatcher for each op on a dtorch tensor) included. Dynamo then traced the
    fast path's bookkeeping as if it were model code and handed the backend graphs of integers. Each code object
    of the given modules (default: every loaded ``torch_dtorch`` module outside :data:`DYNAMO_VISIBLE`) gets the
    frame strategy ``(SKIP, SKIP)``: the frame and its callees run untraced, at no cost outside ``torch.compile``.
    Dynamo still inlines these functions where it traces model code that calls them (the strategy only governs
    frames the hook sees). Idempotent per module; returns the number of code objects marked (0 on a torch without
    per-code strategies)."""
    strategy = _skip_strategy()
    if strategy is None:
        return 0
    from torch._C._dynamo.eval_frame import set_code_exec_strategy  # type: ignore[attr-defined]

    if modules is None:
        modules = [
            m
            for name, m in list(sys.modules.items())
            if m is not None
            and (name == "torch_dtorch" or name.startswith("torch_dtorch."))
            and not name.startswith(DYNAMO_VISIBLE)
        ]
    marked = 0
    for m in modules:
        if m.__name__ in _HIDDEN_MODULES:
            continue
        _HIDDEN_MODULES.add(m.__name__)
        try:
            codes = _codes([v for k, v in vars(m).items() if not k.startswith("__")], m.__name__)
        except Exception:  # noqa: BLE001 - an odd module global must never break ``import torch_dtorch``
            log.debug("hide_from_dynamo: could not walk %s", m.__name__, exc_info=True)
            continue
        for code in codes:
            set_code_exec_strategy(code, strategy)
            marked += 1
    return marked


# --- quantized matmul (placement_rules/families/quantized.py) -----------------------------------------------------


def scaled_mm(
    a: torch.Tensor,
    b: torch.Tensor,
    *,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
    use_fast_accum: bool = False,
) -> torch.Tensor:
    """``torch._scaled_mm`` (fp8 GEMM with scales; row-wise scales: ``scale_a [M, 1]``, ``scale_b [1, N]``)."""
    return torch._scaled_mm(
        a, b, scale_a=scale_a, scale_b=scale_b, bias=bias, out_dtype=out_dtype, use_fast_accum=use_fast_accum
    )


def sym_expr(s: Any) -> Any:
    """The sympy expression of a ``torch.SymInt`` (its ``SymNode``'s ``expr``; 2.11–2.13 alike); anything else (an
    ``int``, a sympy expression) as is."""
    return s.node.expr if isinstance(s, torch.SymInt) else s


def sym_hint(s: Any) -> int:
    """The concrete value a ``torch.SymInt`` had when traced (the shape env's hint); an ``int`` as is."""
    if isinstance(s, int):
        return s
    hint = s.node.hint
    if hint is None:
        raise ValueError(f"symbolic size {s} has no hint (a data-dependent size)")
    return int(hint)
