"""Creation family: factories, ``*_like`` and ``new_*`` ops, random factories.

Signatures (one mesh axis):

- factories without tensor inputs (``zeros``, ``ones``, ``full``, ``empty``, ``rand``, ``randn``, ``arange``,
  ``linspace``, ``eye``): ``() -> R`` first — the result when no output placement is requested — then ``() -> S(d)``
  for every output dim, chosen with ``prefer_outputs`` (``torch.zeros(..., placements=...)``). ``scalar_tensor``
  (0-d): ``R`` only.
- ``new_zeros``/``new_ones``/``new_empty``/``new_full``: ``self`` only lends dtype and device, so whatever ``self``'s
  placement ``p`` is: ``(p) -> R``, then ``(p) -> S(d)`` — ``self`` is never redistributed.
- ``*_like``: the output follows the input, ``S(d) -> S(d)``; ``P -> P`` only for ``zeros_like`` (zero is a valid
  Partial of zero for every reduce op; ones/full/random/empty of a Partial are not), so a Partial input of the
  others is reduced first.

Local execution: size arguments become this rank's local output shape; ``arange`` shifts ``start`` by
``offset * step`` when every value is an exactly representable integer (integer dtype, or integer ``start``/``step``
within the float's mantissa), and otherwise — like ``linspace``, whose values depend on the global count — computes
the global sequence and keeps the rank's slice, so sharded results equal the global op bit for bit. ``eye`` compares
global row and column indices. ``device`` and ``pin_memory`` are dropped from the local arguments: the global
device is the ``dtorch`` device; a worker passes its own device to ops that take one (kernels find it in
``LocalContext.torch_device``), and ``device=None`` in ``*_like``/``new_*`` means "like self", which is local.

Random factories (``rand``, ``randn``, ``rand_like``, ``randn_like``) equal single-device torch under the same seed:
every rank draws the GLOBAL tensor (global shape and strides, so memory order matches) from the generator state the
op starts with — the same on every rank — and keeps its slice. That is O(global numel) work and memory per rank
(CUDA would use Philox offsets per shard instead). Ranks sharing one process (the simulator, thread runners) share
the default generator: the state is snapshotted when the first rank runs the call and every rank draws from a copy
of it, and the default generator is left exactly where one global draw leaves it (see :func:`draw_global`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from torch_dtorch.graph import TensorMeta
from torch_dtorch.placement import PARTIAL_OPS, Partial, Placement, Replicate, Shard
from torch_dtorch.placement_rules.call import LocalContext, OpCall
from torch_dtorch.placement_rules.rule import OpRule, register_rule
from torch_dtorch.placement_rules.signature import PlacementSignature, sig

__all__ = ["FactoryRule", "draw_global", "factory_signatures", "local_kwargs", "narrow_to", "rank_slice"]

aten = torch.ops.aten
_R = Replicate()
_DROPPED_KWARGS = ("device", "pin_memory")


# --- shared helpers -----------------------------------------------------------------------------------------------


def local_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    """``kwargs`` without ``device``/``pin_memory``: local kernels create tensors on the rank's own device."""
    return {k: v for k, v in kwargs.items() if k not in _DROPPED_KWARGS}


def narrow_to(t: torch.Tensor, offsets: Sequence[int], shape: Sequence[int]) -> torch.Tensor:
    """The block of ``t`` at ``offsets`` with ``shape`` (a view)."""
    for d, (o, n) in enumerate(zip(offsets, shape, strict=True)):
        if o != 0 or n != t.shape[d]:
            t = t.narrow(d, o, n)
    return t


def rank_slice(t: torch.Tensor, ctx: LocalContext, k: int = 0) -> torch.Tensor:
    """This rank's block of the global output ``k`` (a copy, so the global tensor can be freed)."""
    if tuple(t.shape) == tuple(ctx.out_shapes[k]):
        return t
    return narrow_to(t, ctx.out_offsets[k], ctx.out_shapes[k]).clone()


def factory_signatures(out_ndim: int, inputs: Sequence[Placement] = ()) -> list[PlacementSignature]:
    """``inputs -> R`` first (the default), then ``inputs -> S(d)`` for every output dim."""
    return [sig(inputs, _R)] + [sig(inputs, Shard(d)) for d in range(out_ndim)]


# --- random: one global draw, every rank keeps its slice ------------------------------------------------------------


@dataclass
class _Draw:
    state: torch.Tensor
    ranks: set[tuple[int, ...]] = field(default_factory=set)


_RNG_LOCK = threading.Lock()


def _default_generator(device: torch.device) -> torch.Generator:
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return torch.cuda.default_generators[index]
    return torch.default_generator


def draw_global(
    call: OpCall,
    ctx: LocalContext,
    draw: Callable[[torch.Generator], torch.Tensor],
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """``draw(gen)`` generates the GLOBAL random tensor from ``gen``; returns it as the single-device op would.

    Every rank draws from the state the default generator had when the first rank ran ``call`` (snapshotted on
    the call under a lock), using a private generator, so ranks that share a process (and its default generator)
    draw identical global tensors. The first rank leaves the default generator where the global draw left it — as
    if torch had run the op once — and later ranks do not touch it. A rank that runs the same call object again
    starts a new draw from the then current state. ``generator``: the call's own generator (a ``generator=``
    argument, thread mode: the workers share the controller's process) instead of the default one.
    """
    device = ctx.torch_device if ctx.torch_device is not None else torch.get_default_device()
    default = generator if generator is not None else _default_generator(device)
    device = default.device
    key = str(device)
    with _RNG_LOCK:
        records: dict[str, Any] | None = call.random_draws
        if records is None:
            records = call.random_draws = {}
        rec = records.get(key)
        if rec is None or ctx.coordinate in rec.ranks:
            rec = records[key] = _Draw(default.get_state())
            rec.ranks.add(ctx.coordinate)
            gen = torch.Generator(device)
            gen.set_state(rec.state)
            out = draw(gen)
            default.set_state(gen.get_state())
            return out
        rec.ranks.add(ctx.coordinate)
        state = rec.state
    gen = torch.Generator(device)
    gen.set_state(state)
    return draw(gen)


def _random_kernel(fill: str) -> Callable[[OpCall, LocalContext, tuple[Any, ...], dict[str, Any]], Any]:
    def kernel(call: OpCall, ctx: LocalContext, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        meta = call.out_meta[0]

        def draw(gen: torch.Generator) -> torch.Tensor:
            t = torch.empty_strided(meta.shape, meta.stride or (), dtype=meta.dtype, device=gen.device)
            return t.uniform_(0, 1, generator=gen) if fill == "uniform" else t.normal_(0, 1, generator=gen)

        return rank_slice(draw_global(call, ctx, draw), ctx)

    return kernel


# --- localize hooks -----------------------------------------------------------------------------------------------


def _size_at(index: int) -> Callable[[OpCall, LocalContext], tuple[tuple[Any, ...], dict[str, Any]]]:
    """Replace the size argument at positional ``index`` by the rank's local output shape."""

    def localize(call: OpCall, ctx: LocalContext) -> tuple[tuple[Any, ...], dict[str, Any]]:
        args = list(call.args)
        kwargs = local_kwargs(call.kwargs)
        size = list(ctx.out_shapes[0])
        if len(args) > index:
            args[index] = size
        else:
            kwargs["size"] = size
        return tuple(args), kwargs

    return localize


def _drop_device(call: OpCall, ctx: LocalContext) -> tuple[tuple[Any, ...], dict[str, Any]]:
    return call.args, local_kwargs(call.kwargs)


# --- factories without tensor inputs -------------------------------------------------------------------------------


class FactoryRule(OpRule):
    """A factory: ``() -> R`` (default) or ``() -> S(d)``; the size argument at ``size_arg`` becomes the local shape.

    Shape inference runs the factory on the ``meta`` device even when the call names no device (the base
    inference would otherwise allocate — and, for random factories, draw — the global tensor on the controller).
    """

    family = "creation"
    #: positional index of the size argument (None: no size argument)
    size_arg: int | None = 0

    def signatures(self, call: OpCall) -> Sequence[PlacementSignature]:
        return factory_signatures(call.out_ndim)

    def infer_meta(self, call: OpCall) -> list[TensorMeta]:
        return super().infer_meta(
            replace(call, kwargs={**call.kwargs, "device": torch.device("meta")}, _bound=None)
        )

    def localize(self, call: OpCall, ctx: LocalContext) -> tuple[tuple[Any, ...], dict[str, Any]]:
        if self.size_arg is None:
            return call.args, local_kwargs(call.kwargs)
        return _size_at(self.size_arg)(call, ctx)


@register_rule(
    aten.zeros.default, aten.ones.default, aten.full.default, aten.empty.memory_format, family="creation"
)
class _Fill(FactoryRule):
    """The local kernel makes the local shape."""


@register_rule(aten.rand.default, family="creation")
class _Rand(FactoryRule):
    """Every rank draws the global tensor and keeps its slice."""

    def kernel(self, call: OpCall, ctx: LocalContext, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        return _random_kernel("uniform")(call, ctx, args, kwargs)


@register_rule(aten.randn.default, family="creation")
class _Randn(FactoryRule):
    """Every rank draws the global tensor and keeps its slice."""

    def kernel(self, call: OpCall, ctx: LocalContext, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        return _random_kernel("normal")(call, ctx, args, kwargs)


@register_rule(aten.scalar_tensor.default, family="creation")
class _ScalarTensor(FactoryRule):
    """0-d: Replicate only."""

    size_arg = None

    def signatures(self, call: OpCall) -> Sequence[PlacementSignature]:
        return []


_MANTISSA_BITS = {torch.float16: 11, torch.bfloat16: 8, torch.float32: 24, torch.float64: 53}


def _arange_bounds(call: OpCall) -> tuple[Any, Any, Any]:
    if call.op is aten.arange.default:
        return 0, call.arg("end"), 1
    return call.arg("start"), call.arg("end"), call.arg("step", 1)


@register_rule(aten.arange.default, aten.arange.start, aten.arange.start_step, family="creation")
class _Arange(FactoryRule):
    """``() -> R`` or ``() -> S(0)``: each rank computes its own range."""

    size_arg = None

    def kernel(self, call: OpCall, ctx: LocalContext, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Shift ``start`` when every value is an exact integer; otherwise slice the global sequence."""
        (n,), (count,), (off,) = call.out_meta[0].shape, ctx.out_shapes[0], ctx.out_offsets[0]
        if count == n:
            return call.op(*args, **kwargs)
        start, _, step = _arange_bounds(call)
        dtype = call.out_meta[0].dtype
        integral = all(isinstance(v, int) and not isinstance(v, bool) for v in (start, step))
        exact = integral and (
            not (dtype.is_floating_point or dtype.is_complex)
            or max(abs(start), abs(start + n * step)) <= 2 ** _MANTISSA_BITS.get(dtype, 0)
        )
        if exact:
            lo = start + off * step
            return aten.arange.start_step(lo, lo + count * step, step, **{**kwargs, "dtype": dtype})
        return rank_slice(call.op(*args, **kwargs), ctx)

    def may_run_op_as_is(self, op: Any) -> bool:
        return "kernel" not in vars(self)

    def runs_op_as_is(self, call: OpCall, ctx: LocalContext) -> bool:
        return "kernel" not in vars(self) and tuple(ctx.out_shapes[0]) == tuple(call.out_meta[0].shape)


@register_rule(aten.linspace.default, family="creation")
class _Linspace(FactoryRule):
    """``() -> R`` or ``() -> S(0)``; values depend on the global count, so each rank slices the global sequence."""

    size_arg = None

    def kernel(self, call: OpCall, ctx: LocalContext, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        return rank_slice(call.op(*args, **kwargs), ctx)


@register_rule(aten.eye.default, aten.eye.m, family="creation")
class _Eye(FactoryRule):
    """``() -> R``, ``() -> S(0)`` or ``() -> S(1)``: ones where the global row equals the global column."""

    size_arg = None

    def kernel(self, call: OpCall, ctx: LocalContext, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        (r, c), (r0, c0) = ctx.out_shapes[0], ctx.out_offsets[0]
        rows = torch.arange(r0, r0 + r, device=ctx.torch_device).unsqueeze(1)
        cols = torch.arange(c0, c0 + c, device=ctx.torch_device).unsqueeze(0)
        return (rows == cols).to(call.out_meta[0].dtype)


# --- ops with a tensor input ----------------------------------------------------------------------------------------


@register_rule(
    aten.new_zeros.default, aten.new_ones.default, aten.new_empty.default, aten.new_full.default,
    family="creation", localize=_size_at(1),
)  # fmt: skip
def new_factory(call: OpCall) -> list[PlacementSignature]:
    """``self`` lends only dtype/device: any placement of it -> ``R`` (default) or ``S(d)``."""
    current = {p for axes in call.placements[:1] if axes is not None for p in axes}
    return [s for p in [_R, *sorted(current - {_R}, key=str)] for s in factory_signatures(call.out_ndim, [p])]


def like_signatures(call: OpCall, *, partial: bool = False) -> list[PlacementSignature]:
    """``S(d) -> S(d)`` for every dim (and ``P -> P`` when ``partial``)."""
    x = call.inputs[0]
    assert x is not None
    sigs = [sig([Shard(d)], Shard(d)) for d in range(x.ndim)]
    if partial:
        sigs += [sig([Partial(op)], Partial(op)) for op in PARTIAL_OPS]
    return sigs


@register_rule(
    aten.ones_like.default, aten.full_like.default, aten.empty_like.default,
    family="creation", localize=_drop_device,
)  # fmt: skip
def like(call: OpCall) -> list[PlacementSignature]:
    """The output follows the input's shards; a Partial input is reduced first."""
    return like_signatures(call)


@register_rule(aten.zeros_like.default, family="creation", localize=_drop_device)
def zeros_like(call: OpCall) -> list[PlacementSignature]:
    """The output follows the input's placement, Partial included (zeros reduce to zeros)."""
    return like_signatures(call, partial=True)


@register_rule(
    aten.rand_like.default, family="creation", localize=_drop_device, kernel=_random_kernel("uniform")
)
def rand_like(call: OpCall) -> list[PlacementSignature]:
    """The output follows the input's shards; every rank draws the global tensor and keeps its slice."""
    return like_signatures(call)


@register_rule(
    aten.randn_like.default, family="creation", localize=_drop_device, kernel=_random_kernel("normal")
)
def randn_like(call: OpCall) -> list[PlacementSignature]:
    """The output follows the input's shards; every rank draws the global tensor and keeps its slice."""
    return like_signatures(call)
