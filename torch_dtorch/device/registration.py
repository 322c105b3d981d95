"""Registers the ``dtorch`` device: PrivateUse1 renamed, a Python kernel per intercepted/ruled overload, the
special kernels every backend needs (empty, copies across devices, ``item``), and ``AutogradPrivateUse1`` kernels
that decompose composite ops when an input requires grad (so backward stays possible)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

import torch

from torch_dtorch._compat import (
    dispatch_mode_depth,
    has_kernel_for_dispatch_key,
    setup_privateuse1_python_backend,
)
from torch_dtorch.device import binding, dispatch, fastpath, fastpath_native, rng
from torch_dtorch.device.attention_grad import sdpa_autograd
from torch_dtorch.device.dropout import dropout_autograd, dropout_kernel, native_dropout_kernel
from torch_dtorch.device.rng import install_rng_functions
from torch_dtorch.device.special_overloads import (
    RESTRIDE_INPLACE,
    masked_outputs,
    out_kernel,
    random_inplace,
    restride_inplace,
    sync_kernel,
    sync_stats,
)
from torch_dtorch.device.state import get_session
from torch_dtorch.device.tensors import DEVICE_NAME, is_dtorch
from torch_dtorch.device.transfer import fetch
from torch_dtorch.errors import BackwardNotSupportedError, NoRuleError
from torch_dtorch.placement_rules import get_rule, intercept_list, registered_ops
from torch_dtorch.placement_rules import register_rule as _register_rule
from torch_dtorch.placement_rules.families.backward import MASKED_OUTPUT_OPS
from torch_dtorch.placement_rules.families.indexing import SYNC_OPS
from torch_dtorch.placement_rules.inplace import _OUT_TO_FUNCTIONAL, functional_overload
from torch_dtorch.placement_rules.rule import serve_kernel_requests

__all__ = [
    "ensure_registered",
    "register_kernels",
    "register_rule",
    "registered_kernels",
    "sync_stats",  # re-exported: tests read it here
]

log = logging.getLogger(__name__)
aten = torch.ops.aten

_LOCK = threading.Lock()
_DONE = False
_LIBS: list[torch.library.Library] = []
_KERNELS: dict[Any, str] = {}

#: overloads with a hand-written kernel instead of the generic one
_SPECIAL = {
    aten.to.dtype_layout,
    aten.to.device,
    aten.to.other,
    aten._to_copy.default,
    aten._copy_from.default,
    aten._local_scalar_dense.default,
    aten.empty_strided.default,
    aten.as_strided.default,
    aten.multinomial.default,
    aten.dropout.default,
    aten.native_dropout.default,
}


def _generic(op: Any):  # noqa: ANN202
    fast = fastpath.fast_op(op)
    if fast is None:

        def kernel(*args: Any, **kwargs: Any) -> Any:
            return dispatch.dispatch_op(op, args, kwargs)

    else:
        miss = fastpath.MISS

        def kernel(*args: Any, **kwargs: Any) -> Any:
            out = fast(args, kwargs)
            if out is miss:
                return dispatch.dispatch_op(op, args, kwargs)
            return out

    kernel.__name__ = f"dtorch_{op}"
    return kernel


def _requires_grad(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether any tensor argument (top level or in a list) requires grad."""
    Tensor = torch.Tensor
    for a in (*args, *kwargs.values()) if kwargs else args:
        if isinstance(a, Tensor):
            if a.requires_grad:
                return True
        elif type(a) is list or type(a) is tuple:
            for t in a:
                if isinstance(t, Tensor) and t.requires_grad:
                    return True
    return False


#: the PrivateUse1 kernel registered for each overload (the autograd kernels of composite ops call it directly)
_BACKEND_KERNELS: dict[Any, Any] = {}


def _autograd(op: Any):  # noqa: ANN202
    """Composite ops arrive whole unless an input requires grad; then they decompose so autograd sees primitives.
    Without grad the backend kernel is called directly (what the dispatcher would reach below autograd, without a
    second trip through it)."""

    def kernel(*args: Any, **kwargs: Any) -> Any:
        if torch.is_grad_enabled() and _requires_grad(args, kwargs):
            return op.decompose(*args, **kwargs)
        backend = _BACKEND_KERNELS.get(op)
        if (
            backend is not None and not dispatch_mode_depth()
        ):  # torch.compile's fake/functional tracing: redispatch
            return backend(*args, **kwargs)
        with torch._C._AutoDispatchBelowAutograd():
            return op(*args, **kwargs)

    return kernel


def _to_copy(self: torch.Tensor, **kwargs: Any) -> torch.Tensor:
    device = kwargs.get("device")
    if not is_dtorch(self):
        # cpu/cuda tensor .to("dtorch"): an unbound Replicate value, uploaded when a mesh is known

        rt = get_session()
        value = self.detach().to(dtype=kwargs.get("dtype") or self.dtype)
        mesh = binding.current_mesh()
        if mesh is None:
            return dispatch.wrap(rt, binding.defer_upload(rt, value.clone()))
        operand = rt.executor.input(tuple(value.shape), mesh, None, dtype=value.dtype)
        rt.executor.upload(operand, value)
        return dispatch.wrap(rt, operand)
    if device is None or torch.device(device).type == DEVICE_NAME:
        # (under grad ``x.to(dtype)`` decomposes to this: RMSNorm's casts of a bf16 model, every layer and step)
        kw = {k: v for k, v in kwargs.items() if k != "device"}
        fast = fastpath.fast_op(aten._to_copy.default)
        out = fastpath.MISS if fast is None else fast((self,), kw)
        if out is fastpath.MISS:
            out = dispatch.dispatch_op(aten._to_copy.default, (self,), kw)
        return out
    # leaving the dtorch device: a sync point that gathers the global value
    value = fetch(self)
    return value.to(device=device, dtype=kwargs.get("dtype") or value.dtype)


def _leaving(op: Any, target: Any):  # noqa: ANN202
    """``to`` overloads: stay on dtorch through the rule (the fast path first), or leave it (a sync point) when the
    target is elsewhere."""
    fast = fastpath.fast_op(op)
    miss = fastpath.MISS

    def kernel(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        device = target(args, kwargs)
        if device is None or torch.device(device).type == DEVICE_NAME:
            if fast is not None:
                out = fast((self, *args), kwargs)
                if out is not miss:
                    return out
            return dispatch.dispatch_op(op, (self, *args), kwargs)
        return op(fetch(self), *args, **kwargs)  # the same overload on the gathered torch tensor

    return kernel


def _device_kw(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    return kwargs.get("device")


def _device_pos(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    return args[0] if args else kwargs.get("device")


def _other_device(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    other = args[0] if args else kwargs.get("other")
    return other.device if isinstance(other, torch.Tensor) else None


def _copy_from(src: torch.Tensor, dst: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:

    rt = get_session()
    if is_dtorch(dst) and not is_dtorch(src):
        value = src.detach().to(dst.dtype).expand(dst.shape).clone()
        dst_operand = dispatch.operand_of(dst, rt)
        if dst_operand.mesh is None:
            dispatch.rebind(rt, dst, binding.defer_upload(rt, value))
            # dst's storage (the only one standing for the old value) now holds the upload: free the old value
            dispatch._free_callback(rt)(dst_operand)
        else:
            # uploaded in dst's placements, then copied into dst's shards in place: views of dst (and copy-views,
            # refreshed after the write) see the new value, as in torch
            new = rt.executor.input(value.shape, dst_operand.mesh, dst_operand.placements, dtype=dst.dtype)
            rt.executor.upload(new, value)
            rt.executor.call(aten.copy_.default, dst_operand, new)
            rt.executor.release(new.id)
        return dst
    if is_dtorch(src) and not is_dtorch(dst):
        dst.copy_(fetch(src))
        return dst
    # dtorch -> dtorch: the functional copy, then dst's storage stands for the result
    out = dispatch.dispatch_op(aten.copy.default, (dst, src), {})
    dispatch.rebind(rt, dst, dispatch.operand_of(out, rt))
    return dst


def _impl_generic(lib: torch.library.Library, op: Any) -> None:
    """Register ``op``'s generic dtorch kernel (``copy_`` also uploads plain sources)."""
    generic = _generic(op)
    if op is aten.copy_.default:
        generic = _copy_inplace(generic)
    fast = fastpath.fast_op(op)
    if isinstance(fast, fastpath.FastOp) and fastpath.NATIVE is not None and fast.native_ok:
        # the native kernel on the dtorch key; the Python one behind it, on PrivateUse2, serves its misses
        lib.impl(_schema_name(op), fastpath_native.native_kernel(op, fast), "PrivateUse2")
        fastpath_native.register_native(op, fast)
    else:
        lib.impl(_schema_name(op), generic, "PrivateUse1")
    _KERNELS[op] = "generic"
    _BACKEND_KERNELS[op] = generic


def _copy_inplace(generic: Callable[..., Any]) -> Callable[..., Any]:
    """``dtorch_t.copy_(cpu_or_cuda_t)`` (``load_state_dict`` into a distributed model) uploads ``src`` in
    ``dtorch_t``'s placements, as ``cuda_t.copy_(cpu_t)`` copies across devices in torch."""

    def kernel(self: torch.Tensor, src: Any, non_blocking: bool = False) -> torch.Tensor:
        if isinstance(src, torch.Tensor) and not is_dtorch(src) and src.dim() > 0 and is_dtorch(self):
            return _copy_from(src, self, non_blocking)
        if isinstance(src, torch.Tensor) and is_dtorch(src) and not is_dtorch(self):
            return _copy_from(src, self, non_blocking)  # a download into a plain tensor
        return generic(self, src, non_blocking)

    return kernel


def _local_scalar_dense(self: torch.Tensor) -> Any:
    return fetch(self).item()


def _empty_strided(size: Any, stride: Any, **kwargs: Any) -> torch.Tensor:
    return dispatch.dispatch_op(aten.empty.memory_format, (list(size),), kwargs)


def _as_strided(self: torch.Tensor, size: Any, stride: Any, storage_offset: Any = None) -> torch.Tensor:
    dispatch.check_as_strided(aten.as_strided.default, (self,))
    return dispatch.dispatch_op(aten.as_strided.default, (self, size, stride, storage_offset), {})


#: per thread, the ``out=`` overloads whose fallback (see :func:`_fallback`) is running
_OUT_FALLBACK = threading.local()


def _fallback(op: Any, *args: Any, **kwargs: Any) -> Any:
    """Every overload that reaches the dtorch key without a kernel: run it if a rule was registered after the
    device was set up (``placement_rules.register_rule`` at run time), else a typed error naming it and the fix."""

    try:
        get_rule(op)
    except NoRuleError:
        functional = functional_overload(op)
        active: set[Any] = _OUT_FALLBACK.__dict__.setdefault("ops", set())
        if functional is None or op in active:
            # (re-entered: the functional op is a structured kernel that calls ``op`` itself, e.g. gcd -> gcd.out)
            if "backward" in op._schema.name:
                raise BackwardNotSupportedError(op) from None
            raise NoRuleError(
                op, detail="(it reached the dtorch device, which has no kernel for it)"
            ) from None
        # ``op.out`` of a functional op served otherwise: a sync kernel, a decomposition, a special kernel
        active.add(op)
        try:
            return out_kernel(op, functional, via_dispatcher=True)(*args, **kwargs)
        finally:
            active.discard(op)
    return dispatch.dispatch_op(op, args, kwargs)


def register_kernels(ops: Any) -> list[Any]:
    """Give ruled overloads registered after :func:`ensure_registered` (custom ops of any namespace included) their
    dtorch kernel; returns the overloads that got one. A ``torch.library.custom_op`` has a default
    (CompositeExplicitAutograd) implementation that would otherwise run its Python body on dtorch tensors."""

    added = []
    with _LOCK:
        for op in ops:
            if isinstance(op, str) or op in _KERNELS or op in _SPECIAL or op in _GENERIC_ALIASES:
                continue
            get_rule(op)  # NoRuleError: register the rule first
            lib = _NAMESPACE_LIBS.get(op.namespace)
            if lib is None:
                lib = _NAMESPACE_LIBS[op.namespace] = torch.library.Library(op.namespace, "IMPL")
            _impl_generic(lib, op)
            added.append(op)
    return added


#: one ``IMPL`` library per namespace of late-registered kernels (``aten``'s from ``ensure_registered`` aside)
_NAMESPACE_LIBS: dict[str, torch.library.Library] = {}


#: overloads PyTorch implements by aliasing the storage (CompositeExplicitAutograd): registering a kernel would
#: break ``nn.Parameter(t)`` and ``detach()``, which must return a tensor over the same storage with no Python object
_GENERIC_ALIASES = {aten.detach.default, aten.alias.default}

_SPECIAL_KERNELS = {
    aten.to.dtype_layout: _leaving(aten.to.dtype_layout, _device_kw),
    aten.to.device: _leaving(aten.to.device, _device_pos),
    aten.to.other: _leaving(aten.to.other, _other_device),
    aten._to_copy.default: _to_copy,
    aten._copy_from.default: _copy_from,
    aten._local_scalar_dense.default: _local_scalar_dense,
    aten.empty_strided.default: _empty_strided,
    aten.as_strided.default: _as_strided,
    aten.multinomial.default: rng.multinomial,  # drawn on the controller (device/rng.py)
    # the noise drawn on the controller (device/dropout.py), the rest through the rule
    aten.dropout.default: dropout_kernel(_generic(aten.dropout.default)),
    aten.native_dropout.default: native_dropout_kernel(_generic(aten.native_dropout.default)),
}


#: the special kernels a native kernel may front (``to`` that stays on dtorch: a bf16 model's casts, every layer)
_NATIVE_SPECIALS = {aten.to.dtype_layout, aten.to.device, aten.to.other, aten._to_copy.default}


def _schema_name(op: Any) -> str:
    name = op._schema.name.split("::", 1)[1]
    overload = op._overloadname
    return name if overload == "default" else f"{name}.{overload}"


#: overloads whose kernel first checks for a data-dependent output shape (see ``sync_kernel``)
_MAYBE_SYNC = (*SYNC_OPS, aten.index.Tensor, aten.index_put.default)


def ensure_registered() -> None:
    """Idempotent: rename PrivateUse1 to ``dtorch`` and register every kernel (once per process)."""
    global _DONE
    with _LOCK:
        if _DONE:
            return
        setup_privateuse1_python_backend(DEVICE_NAME)
        install_rng_functions(
            DEVICE_NAME
        )  # fork_rng / manual_seed over the dtorch device (see device/rng.py)
        lib = torch.library.Library("aten", "IMPL")
        _LIBS.append(lib)
        _NAMESPACE_LIBS["aten"] = lib
        ops = [op for op in registered_ops() if not isinstance(op, str) and op.namespace == "aten"]
        ops += [op for op in _MAYBE_SYNC if op not in ops]
        for op in ops:
            if op in _SPECIAL or op in _GENERIC_ALIASES:
                continue
            if op in MASKED_OUTPUT_OPS:
                lib.impl(_schema_name(op), masked_outputs(op), "PrivateUse1")
                _KERNELS[op] = "masked"
                continue
            if op in _MAYBE_SYNC:
                inner = _generic(op) if op not in SYNC_OPS else None
                lib.impl(_schema_name(op), sync_kernel(op, inner), "PrivateUse1")
                _KERNELS[op] = "sync"
                continue
            _impl_generic(lib, op)

        for out_op, functional in _OUT_TO_FUNCTIONAL.items():
            if functional in _SPECIAL or functional in _GENERIC_ALIASES or out_op in _KERNELS:
                continue
            lib.impl(_schema_name(out_op), out_kernel(out_op, functional), "PrivateUse1")
            _KERNELS[out_op] = "out"
        for op in rng.RANDOM_INPLACE_OPS:
            if op not in _KERNELS:
                lib.impl(_schema_name(op), random_inplace(op), "PrivateUse1")
                _KERNELS[op] = "random"
        for op, fn in _SPECIAL_KERNELS.items():
            fast = fastpath.fast_op(op) if op in _NATIVE_SPECIALS else None
            if isinstance(fast, fastpath.FastOp) and fastpath.NATIVE is not None and fast.native_ok:
                # the native kernel on the dtorch key serves the calls that stay on dtorch; its misses (the first
                # call of a layout, leaving dtorch, uploading) reach the special kernel on PrivateUse2
                lib.impl(_schema_name(op), fn, "PrivateUse2")
                fastpath_native.register_native(op, fast)
            else:
                lib.impl(_schema_name(op), fn, "PrivateUse1")
            _KERNELS[op] = "special"
        for op in RESTRIDE_INPLACE:
            if op not in _KERNELS:
                lib.impl(_schema_name(op), restride_inplace(op), "PrivateUse1")
                _KERNELS[op] = "refused"
        for op in intercept_list():
            if op is aten.scaled_dot_product_attention.default:
                # autograd through the fused attention pair, whose rules keep CP in the backward; without grad,
                # the native gate goes on to the native kernel (no Python on an inference call)
                gated = fastpath.NATIVE is not None
                key = "AutogradPrivateUse2" if gated else "AutogradPrivateUse1"
                lib.impl(_schema_name(op), sdpa_autograd(_autograd(op)), key)
                if gated:
                    fastpath.NATIVE.register_composite(op.namespace, _schema_name(op), own_autograd=True)
                continue
            if op is aten.dropout.default:
                # training draws CPU torch's unfused noise on the controller (torch's decomposition: native_dropout)
                lib.impl(_schema_name(op), dropout_autograd(_autograd(op)), "AutogradPrivateUse1")
                continue
            if not isinstance(op, str) and has_kernel_for_dispatch_key(op, "CompositeImplicitAutograd"):
                if fastpath.NATIVE is not None:
                    fastpath.NATIVE.register_composite(op.namespace, _schema_name(op))
                else:
                    lib.impl(_schema_name(op), _autograd(op), "AutogradPrivateUse1")
        fallback = torch.library.Library("_", "IMPL")
        _LIBS.append(fallback)
        fallback.fallback(_fallback, "PrivateUse1")
        _DONE = True
        log.debug("dtorch device registered: %d kernels", len(_KERNELS))
    serve_kernel_requests(register_kernels)  # overloads of other namespaces whose rules asked for one


def registered_kernels() -> dict[Any, str]:
    return dict(_KERNELS)


def register_rule(*ops: Any, family: str = "custom", **kwargs: Any) -> Callable[[Any], Any]:
    """Public decorator (``torch_dtorch.register_rule``): :func:`torch_dtorch.placement_rules.register_rule`, plus the
    dtorch kernel for the overloads — needed for ops registered after ``import torch_dtorch``, such as a
    ``torch.library.custom_op``. Keyword arguments are ``placement_rules.register_rule``'s (``localize``, ``cost``,
    ``check``, ``kernel``, ``view_of``, ...). See docs/adding_an_op.md."""

    inner = _register_rule(*ops, family=family, **kwargs)

    def deco(target: Any) -> Any:
        out = inner(target)
        if _DONE:
            register_kernels(ops)
        return out

    return deco
