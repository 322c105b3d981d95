"""Kernels of the overload variants that the generic dtorch kernel (one rule, one plan) does not serve as they are:
``op.out(..., out=t)`` (the functional op, then a copy into ``out``), in-place ops that would restride ``self`` (a
typed error), data-dependent output shapes (a sync point on the controller), ops whose outputs torch may leave
``None``, and in-place random fills. :mod:`torch_dtorch.device.registration` registers them."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from torch.utils import _pytree as pytree

from torch_dtorch.device import dispatch, fastpath, rng
from torch_dtorch.device.state import get_session
from torch_dtorch.device.tensors import DEVICE_NAME, is_dtorch
from torch_dtorch.device.transfer import fetch, upload
from torch_dtorch.errors import RestrideError
from torch_dtorch.placement import Replicate
from torch_dtorch.placement_rules.families.backward import present_outputs
from torch_dtorch.placement_rules.families.indexing import is_sync_call

__all__ = [
    "RESTRIDE_INPLACE",
    "masked_outputs",
    "out_kernel",
    "random_inplace",
    "restride_inplace",
    "sync_kernel",
    "sync_stats",
]

log = logging.getLogger(__name__)
aten = torch.ops.aten

_COMPOSITE_EXPLICIT = torch._C.DispatchKeySet(torch._C.DispatchKey.CompositeExplicitAutograd)


def restride_inplace(op: Any) -> Callable[..., Any]:
    """In-place ops that change ``self``'s shape or strides: a typed error naming the out-of-place form (torch's own
    kernels would fail deep inside with a storage-bounds ``RuntimeError`` on the storage-less controller tensor)."""
    name = op._schema.name.split("::", 1)[1]

    def kernel(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:

        if (
            self.numel() == 0
        ):  # nothing to address (torch's out= code restrides empty scratch tensors): torch's own
            return op.redispatch(_COMPOSITE_EXPLICIT, self, *args, **kwargs)
        raise RestrideError(
            f"aten.{name}: in-place ops that change a dtorch tensor's shape or strides are not supported (self: "
            f"{tuple(self.shape)}). Fix: use the out-of-place view and rebind the name, e.g. "
            f"`x = x.{name.rstrip('_')}(...)`"
        )

    return kernel


#: in-place ops that restride ``self`` (see :func:`restride_inplace`)
RESTRIDE_INPLACE = (
    aten.t_.default, aten.transpose_.default, aten.squeeze_.default, aten.squeeze_.dim, aten.squeeze_.dims,
    aten.unsqueeze_.default, aten.as_strided_.default, aten.swapdims_.default, aten.swapaxes_.default,
)  # fmt: skip


#: calls that ran on the controller because their output shape depends on the data (tests read this)
sync_stats = {"calls": 0}


def sync_kernel(op: Any, inner: Any):  # noqa: ANN202
    """Data-dependent output shapes (``masked_select``, ``nonzero``, ``x[mask]``, ...): a sync point. The inputs are
    gathered, the op runs on the controller, and tensor results come back Replicate on the inputs' mesh."""

    def kernel(*args: Any, **kwargs: Any) -> Any:
        if inner is not None and not is_sync_call(op, args, kwargs):
            return inner(*args, **kwargs)

        rt = get_session()
        meshes = [
            dispatch.operand_of(t, rt).mesh
            for t in pytree.tree_leaves((args, kwargs))
            if isinstance(t, torch.Tensor) and is_dtorch(t)
        ]
        mesh = next((m for m in meshes if m is not None), None)
        log.debug("%s: data-dependent output shape; inputs gathered and the op run on the controller", op)
        sync_stats["calls"] += 1
        local_args, local_kwargs = pytree.tree_map_only(
            torch.Tensor, lambda t: fetch(t) if is_dtorch(t) else t, (args, kwargs)
        )
        out = op(*local_args, **local_kwargs)
        if mesh is None:
            return pytree.tree_map_only(torch.Tensor, lambda t: t.to(DEVICE_NAME), out)
        return pytree.tree_map_only(
            torch.Tensor,
            lambda t: upload(t, mesh, [Replicate()] * mesh.ndim, what=f"{op} (on the controller)"),
            out,
        )

    kernel.__name__ = f"dtorch_sync_{op}"
    return kernel


def out_kernel(out_op: Any, functional: Any, *, via_dispatcher: bool = False):  # noqa: ANN202
    """``op.out(..., out=t)``: the functional op, then an in-place ``copy_`` into each ``out`` tensor (so views of
    ``out`` see the write). ``via_dispatcher``: call the functional op through torch's dispatcher (it has a kernel
    of its own — a sync kernel, a decomposition — rather than a rule)."""
    out_names = [a.name for a in out_op._schema.arguments if a.is_out]

    def kernel(*args: Any, **kwargs: Any) -> Any:
        outs = [kwargs.pop(n) for n in out_names]
        if via_dispatcher:
            result = functional(*args, **kwargs)
        else:
            result = dispatch.dispatch_op(functional, args, kwargs)
        results = list(result) if isinstance(result, (list, tuple)) else [result]
        if len(outs) == 1 and isinstance(outs[0], (list, tuple)):  # ``Tensor(a!)[] out``: returns nothing
            for o, r in zip(outs[0], results, strict=True):
                _copy_out(out_op, o, r)
            return None
        for o, r in zip(outs, results, strict=True):
            _copy_out(out_op, o, r)
        return outs[0] if len(outs) == 1 else tuple(outs)

    return kernel


def _copy_out(out_op: Any, o: torch.Tensor, r: torch.Tensor) -> None:
    if tuple(o.shape) != tuple(r.shape):
        raise NotImplementedError(
            f"{out_op}: out= tensor of shape {tuple(o.shape)} would be resized to {tuple(r.shape)}; "
            "dtorch tensors cannot be resized — pass an out tensor of the result's shape"
        )
    dispatch.dispatch_op(aten.copy_.default, (o, r), {})


def random_inplace(op: Any):  # noqa: ANN202
    def kernel(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return rng.random_inplace(op, self, *args, **kwargs)

    kernel.__name__ = f"dtorch_random_{op}"
    return kernel


def masked_outputs(op: Any):  # noqa: ANN202
    """Ops whose outputs torch may leave ``None`` (``native_layer_norm_backward`` with an ``output_mask`` or no
    weight/bias): the operator holds the present outputs only; the ``None`` go back where torch puts them. The
    fast path first (Python: its template holds the present outputs)."""

    fast = fastpath.fast_op(op)  # (the mask and the absent weight/bias are constants of its key)

    def kernel(*args: Any, **kwargs: Any) -> Any:
        present = present_outputs(op, args, kwargs)
        out = fastpath.MISS if fast is None else fast(args, kwargs)
        if out is fastpath.MISS:
            out = dispatch.dispatch_op(op, args, kwargs)
        got = iter(out if isinstance(out, (list, tuple)) else (out,))
        return tuple(next(got) if p else None for p in present)

    kernel.__name__ = f"dtorch_masked_{op}"
    return kernel
