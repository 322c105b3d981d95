"""The native kernel's side of the eager fast path (``torch_dtorch/device/_native.cpp``): the hooks the C++ kernel
calls on a hit (record the operator), and the registration of an op's native kernel with its Python fallback (the
Python fast path of :mod:`torch_dtorch.device.fastpath`, run on the native kernel's misses)."""

from __future__ import annotations

from typing import Any

from torch_dtorch.device import dispatch, state
from torch_dtorch.device.fastpath import _LEARNED, MISS, NATIVE, FastOp, layout_of, stats
from torch_dtorch.device.fastpath_template import Template
from torch_dtorch.graph import Operand

__all__ = ["native_kernel", "register_native"]


def _native_hit(tpl: Template, inputs: list[Operand | None]) -> list[Operand] | None:
    """A hit of the native kernel: record the operator; the kernel makes the output tensors. ``None``: no runtime."""
    rt = state._SESSION
    if rt is None:
        return None
    outs = rt.executor.record_fast(tpl.plan, None, inputs)  # args are built where the run is expanded
    stats["hit"] += 1
    rt.last_mesh = tpl.mesh
    return outs


def _layout_of_operand(x: Operand) -> int:
    return -2 if x.mesh is None else layout_of(x)


def _take_learned() -> Template | None:
    tpl = getattr(_LEARNED, "tpl", None)
    _LEARNED.tpl = None
    return tpl


if NATIVE is not None:
    NATIVE.set_hooks(_native_hit, _layout_of_operand, _take_learned)


def native_kernel(op: Any, fast: FastOp) -> Any:
    """The Python kernel behind ``op``'s native kernel (it runs on the native kernel's misses): the Python fast
    path, counted as one miss."""
    miss = MISS

    def kernel(*args: Any, **kwargs: Any) -> Any:
        hits, misses = stats["hit"], stats["miss"]
        out = fast(args, kwargs)
        if out is miss:
            out = dispatch.dispatch_op(op, args, kwargs)
        stats["hit"], stats["miss"] = hits, misses + 1
        return out

    kernel.__name__ = f"dtorch_native_miss_{op}"
    return kernel


def register_native(op: Any, fast: FastOp) -> bool:
    """Put ``op``'s native kernel on the dtorch key (its Python kernel on PrivateUse2, where the native one
    redispatches on a miss). False when the extension is not loaded."""
    if NATIVE is None:
        return False
    name = op._schema.name.split("::", 1)[1]
    if op._overloadname != "default":
        name = f"{name}.{op._overloadname}"
    kind = {"single": 0, "tuple": 1, "list": 2}[fast.kind]
    list_pos = -1 if fast.list_pos is None else fast.list_pos
    NATIVE.register_kernel(
        op.namespace, name, fast, kind, fast.view_of is not None, list(fast.slot_pos), list_pos
    )
    return True
