"""Python kernels of the ``dtorch`` device: every intercepted overload goes through :func:`dispatch`, which turns
tensors into operands, binds unbound ones, records the op through the executor and wraps the outputs."""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch.utils import _pytree as pytree

from torch_dtorch._tree import map_only
from torch_dtorch.device import binding
from torch_dtorch.device.state import Session, _free_callback, get_session
from torch_dtorch.device.tensors import DEVICE_NAME, TABLE, is_dtorch
from torch_dtorch.errors import AsStridedError, DTorchError, PlacementError, PlacementMismatchError
from torch_dtorch.graph import Operand, TensorMeta
from torch_dtorch.placement import Replicate, is_partial, is_replicate
from torch_dtorch.placement_rules import OpCall, get_rule
from torch_dtorch.placement_rules.inplace import InplaceRule
from torch_dtorch.placement_rules.rule import add_rule_listener, const_key

__all__ = ["DeviceMismatchError", "dispatch_op", "operand_of", "wrap"]

log = logging.getLogger(__name__)


class DeviceMismatchError(DTorchError, RuntimeError):
    """A non-dtorch tensor (other than a 0-d scalar) was mixed with dtorch tensors."""


def wrap(rt: Session, operand: Operand, *, view: bool = False, layout: int | None = None) -> torch.Tensor:
    return TABLE.wrap(operand, rt.generation, _free_callback(rt), view=view, layout=layout)


def rebind(rt: Session, t: torch.Tensor, operand: Operand) -> None:
    """Make the existing dtorch tensor ``t`` (and every alias of its storage) stand for ``operand``."""
    TABLE.bind(t, operand, rt.generation, _free_callback(rt))


def operand_of(t: torch.Tensor, rt: Session | None = None) -> Operand:
    rt = rt or get_session()
    return TABLE.lookup(t, rt.generation)


def _to_operands(
    rt: Session, op: Any, args: tuple[Any, ...], kwargs: dict[str, Any], scalars: list[Operand] | None = None
) -> tuple[Any, Any, list[Operand]]:
    """``args``/``kwargs`` with operands for their tensors, and those operands. A plain 0-d tensor (a scalar on
    the CPU) becomes an unbound upload, also appended to ``scalars``."""
    found: list[Operand] = []

    def conv(t: torch.Tensor) -> Operand:
        if is_dtorch(t):
            x = TABLE.lookup(t, rt.generation)
        elif t.dim() == 0:
            x = binding.defer_upload(rt, t)
            if scalars is not None:
                scalars.append(x)
        else:
            raise DeviceMismatchError(
                f"{op}: expected all tensors on the dtorch device, but got a {t.device} tensor of shape "
                f"{tuple(t.shape)}; move it with t.to('dtorch') or dt.distribute_tensor(t, mesh, placements)"
            )
        found.append(x)
        return x

    args, kwargs = map_only(torch.Tensor, conv, (args, kwargs))
    return args, kwargs, found


#: drawn on the controller from torch's own generator, then uploaded: results and the RNG stream equal
#: single-device torch under the same seed (O(global) on the controller, O(shard) per worker)
RANDOM_OPS = {
    torch.ops.aten.rand.default,
    torch.ops.aten.randn.default,
    torch.ops.aten.rand_like.default,
    torch.ops.aten.randn_like.default,
}


def controller_device(rt: Session) -> torch.device:
    return torch.device("cpu") if rt.device_type == "cpu" else torch.device(rt.device_type, 0)


def _random(rt: Session, op: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor:
    kwargs = {k: v for k, v in kwargs.items() if k not in ("device", "pin_memory")}
    dev = controller_device(rt)
    if op in (torch.ops.aten.rand.default, torch.ops.aten.randn.default):
        value = op(*args, device=dev, **kwargs)
        mesh = binding.current_mesh()
        if mesh is None:
            return wrap(rt, binding.defer_upload(rt, value))
        placements: Any = [torch.distributed.tensor.Replicate()] * mesh.ndim
    else:
        x = TABLE.lookup(args[0], rt.generation)
        like = torch.empty_strided(x.shape, x.stride or (), dtype=x.dtype, device=dev)
        value = op(like, *args[1:], **kwargs)
        if x.mesh is None:
            return wrap(rt, binding.defer_upload(rt, value))
        mesh, placements = x.mesh, [p if not is_partial(p) else Replicate() for p in x.placements]
    operand = rt.executor.input(tuple(value.shape), mesh, placements, dtype=value.dtype)
    rt.executor.upload(operand, value)
    return wrap(rt, operand)


#: ``(op, constants) -> output metas`` of deferred factories (model code makes the same ``torch.arange(n,
#: device=x.device)`` every step; its shape inference runs on meta tensors through ``torch._refs``, ~1.8 ms)
_FACTORY_METAS: dict[tuple[Any, ...], list[TensorMeta]] = {}


def _factory_meta(op: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[TensorMeta]:
    try:
        key: tuple[Any, ...] | None = (op, const_key(args), const_key(kwargs))
        metas = _FACTORY_METAS.get(key)  # type: ignore[arg-type]
    except TypeError:  # an unhashable constant
        key, metas = None, None
    if metas is None:
        metas = get_rule(op).infer_meta(OpCall.make(op, args, kwargs))
        if key is not None:
            if len(_FACTORY_METAS) >= 4096:
                _FACTORY_METAS.clear()
            _FACTORY_METAS[key] = metas
    return metas


add_rule_listener(lambda op: _FACTORY_METAS.clear())  # (a replaced rule may infer otherwise)


def dispatch_op(op: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Record ``op`` on dtorch tensors; returns dtorch tensors at once (the workers run it asynchronously)."""
    rt = get_session()
    if op in RANDOM_OPS:
        return _random(rt, op, args, kwargs)
    original = (args, kwargs)
    scalars: list[Operand] = []
    args, kwargs, operands = _to_operands(rt, op, args, kwargs, scalars)
    if not scalars:
        return _dispatch(rt, op, args, kwargs, operands, original)
    rule = get_rule(op)
    if rule.writes_inputs or rule.output_is_input is not None:  # an in-place op rebinds what it writes
        n = len(_first_list(args, kwargs)) if rule.writes_inputs else 1
        written = {id(x) for x in operands[:n]}
        scalars = [x for x in scalars if id(x) not in written]
    out: Any = None
    try:
        out = _dispatch(rt, op, args, kwargs, operands, original)
        return out
    finally:  # the scalars' copies on the workers are only this call's inputs
        outs = [TABLE.lookup(t, rt.generation) for t in pytree.tree_leaves(out) if is_dtorch(t)]
        binding.release_uploads(rt, scalars, outs)


def _dispatch(
    rt: Session,
    op: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    operands: list[Operand],
    original: tuple[tuple[Any, ...], dict[str, Any]],
) -> Any:
    """:func:`dispatch_op` after the tensors became ``operands`` (``original``: the caller's args and kwargs)."""
    bound = [x for x in operands if x.mesh is not None]
    if len(bound) > 1 and len({x.mesh.root for x in bound}) > 1:  # type: ignore[union-attr]
        return _across_meshes(rt, op, args, kwargs, operands, bound, original)
    return _dispatch_on(rt, op, args, kwargs, operands, bound, original)


def _dispatch_on(
    rt: Session,
    op: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    operands: list[Operand],
    bound: list[Operand],
    original: tuple[tuple[Any, ...], dict[str, Any]],
) -> Any:
    """:func:`_dispatch` once the inputs' meshes are settled (``bound``: the bound operands)."""
    original_args, original_kwargs = original
    if bound:
        mesh = bound[0].mesh
    elif not operands:
        if binding.current_mesh() is None:
            # a factory with no mesh anywhere in sight: defer until a consumer gives it one
            metas = _factory_meta(op, args, kwargs)
            if len(metas) == 1:
                return wrap(rt, binding.defer_factory(rt, op, args, kwargs, metas[0]))
        mesh = binding.fallback_mesh(rt, str(op))
    else:
        in_place = get_rule(op).output_is_input is not None or get_rule(op).writes_inputs
        if binding.current_mesh() is None and rt.last_mesh is None and not in_place:
            # only unbound (small, controller-made) inputs and no mesh in sight yet — e.g. a cache's
            # ``torch.tensor([], device=x.device)`` while dynamo traces: compute it here, still unbound
            host = _on_host(rt, op, args, kwargs)
            if host is not None:
                return host
        mesh = binding.fallback_mesh(rt, str(op))
    assert mesh is not None
    if len(bound) != len(operands):
        args, kwargs = map_only(Operand, lambda x: binding.bind(rt, x, mesh), (args, kwargs))
    rt.last_mesh = mesh
    try:
        if operands:
            out = rt.executor.call(op, *args, **kwargs)
        else:  # a factory on a mesh (``with mesh:``): planned once per op, constants and mesh
            out = binding.record_factory(rt.executor, op, args, kwargs, mesh)
    except (PlacementMismatchError, PlacementError) as e:
        if get_rule(op).op_by_op_fallback:  # a list op no list signature fits: torch's per-tensor kernel
            log.debug("%s: op by op (%s)", op, str(e).splitlines()[0])
            return op.redispatch(_COMPOSITE_EXPLICIT, *original_args, **original_kwargs)
        functional = _inplace_fallback_of(op, operands) if isinstance(e, PlacementMismatchError) else None
        if functional is None:
            raise
        return _inplace_via_copy(op, functional, original_args, original_kwargs)
    rule = get_rule(op)
    if rule.writes_inputs:  # a list op in place: the caller's tensors are the result (the op returns nothing)
        for t, x, y in zip(_first_list(original_args, original_kwargs), operands, out, strict=False):
            if x.mesh is None:  # an unbound tensor was materialized: it now stands for the write
                rebind(rt, t, y)
                binding.forget(x)
        return None
    written = rule.output_is_input
    if written is not None:  # in-place: the caller's tensor is the result
        target = original_args[written]
        if (
            operands and operands[0].mesh is None
        ):  # an unbound self was materialized: it now stands for the write
            rebind(rt, target, out if isinstance(out, Operand) else out[0])
            binding.forget(operands[0])  # its controller-side value is not needed any more
        return target
    view = rule.view_of is not None and not getattr(original_args[0], "is_inference", lambda: True)()
    return map_only(Operand, lambda o: wrap(rt, o, view=view), out)


def _across_meshes(
    rt: Session,
    op: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    operands: list[Operand],
    bound: list[Operand],
    original: tuple[tuple[Any, ...], dict[str, Any]],
) -> Any:
    """An op whose inputs live on several meshes: factory results the fast path bound at once where they would not
    have gone (:func:`binding.move_eager`) move to the other inputs' mesh first, and the copies are freed after the
    op; anything else is the rule's error (an in-place op's written input is never moved)."""
    rule = get_rule(op)
    in_place = rule.output_is_input is not None or rule.writes_inputs
    moved = {} if in_place else binding.move_eager(rt, bound)
    if not moved:
        return _dispatch_on(rt, op, args, kwargs, operands, bound, original)

    def swap(x: Operand) -> Operand:
        return moved.get(x.id, x)

    args, kwargs = map_only(Operand, swap, (args, kwargs))
    operands = [swap(x) for x in operands]
    out: Any = None
    try:
        out = _dispatch_on(
            rt, op, args, kwargs, operands, [x for x in operands if x.mesh is not None], original
        )
        return out
    finally:
        outs = [TABLE.lookup(t, rt.generation) for t in pytree.tree_leaves(out) if is_dtorch(t)]
        for y in moved.values():
            if not any(o.base is y or o is y for o in outs):
                rt.executor.free(y)


_COMPOSITE_EXPLICIT = torch._C.DispatchKeySet(torch._C.DispatchKey.CompositeExplicitAutograd)


def _first_list(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
    """The tensor list an in-place list op writes (its ``self``)."""
    first = args[0] if args else kwargs.get("self", [])
    return list(first)


def _inplace_fallback_of(op: Any, operands: list[Operand]) -> Any | None:
    """The functional op to run instead of the in-place ``op`` whose bound ``self`` is placed where no signature of
    ``op`` keeps it (the op works across ``self``'s sharded dim); ``None``: no such fallback."""

    rule = get_rule(op)
    if not isinstance(rule, InplaceRule) or not operands or operands[0].mesh is None:
        return None
    return rule.functional_op


def _inplace_via_copy(
    op: Any, functional: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> torch.Tensor:
    """``op`` as the functional op (free to redistribute), then ``self.copy_(result)``: the result is moved to
    ``self``'s placements and written into ``self``'s shards in place, so views of ``self`` (and the base ``self``
    views) see the write as in torch. The in-place op's own checks (broadcast into ``self``, dtype casting) already
    ran when it was planned."""
    self = args[0]
    log.debug(
        "%s: self %s is kept by no signature; functional %s, then copy_ into self", op, self.shape, functional
    )
    result = dispatch_op(functional, args, kwargs)
    dispatch_op(torch.ops.aten.copy_.default, (self, result), {})
    return self


def _on_host(rt: Session, op: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``op`` on the controller's CPU values of unbound operands; its tensors unbound again (``None``: some input
    has no host value)."""
    missing = False

    def value(x: Operand) -> Any:
        nonlocal missing
        v = binding.host_value(x)
        missing = missing or v is None
        return v

    host_args, host_kwargs = map_only(Operand, value, (args, kwargs))
    if missing:
        return None
    # a target device of ``dtorch`` (``t.to(x.device)``, ``torch.tensor(3, device=x.device)``) means the controller's
    # CPU here: the result is wrapped as an unbound operand again (left as ``dtorch``, the op would come back to
    # this kernel forever)
    host_args, host_kwargs = map_only((torch.device, str), _host_device, (host_args, host_kwargs))
    out = op(*host_args, **host_kwargs)
    return map_only(torch.Tensor, lambda t: wrap(rt, binding.defer_upload(rt, t)), out)


def _host_device(d: torch.device | str) -> torch.device | str:
    """``d`` with the ``dtorch`` device replaced by the controller's CPU (other values unchanged)."""
    if isinstance(d, torch.device):
        return torch.device("cpu") if d.type == DEVICE_NAME else d
    return "cpu" if d.split(":", 1)[0] == DEVICE_NAME else d


def check_as_strided(op: Any, args: tuple[Any, ...]) -> None:
    """``as_strided`` addresses global memory: only meaningful on a Replicate operand."""
    x = args[0]
    if is_dtorch(x):
        operand = operand_of(x)
        if operand.mesh is not None and not all(is_replicate(p) for p in operand.placements):
            raise AsStridedError(
                f"{op}: as_strided on {operand.describe()} addresses the global tensor's memory, which a sharded "
                "or partial tensor does not have in one piece. This usually comes from an op dtorch does not "
                "intercept (so PyTorch decomposed it into as_strided); use a view op (view/transpose/narrow/...) "
                "or redistribute the tensor to Replicate first."
            )


def meta_of(value: torch.Tensor) -> TensorMeta:
    return TensorMeta.of(value)
