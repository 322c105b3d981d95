"""Layer styles for :func:`torch_dtorch.nn.parallelize_module`, and the translation of upstream
``torch.distributed.tensor.parallel`` ParallelStyles into them.

A style shards a module's parameters on one mesh axis and converts its inputs / outputs on that axis with forward
hooks (the module keeps its class, so model code that checks types still works). Upstream styles are *read*
(``input_layouts``, ``output_layouts``, ``desired_input_layouts``, ``sequence_sharding``, ...), never run: their
``_apply`` builds SPMD DTensors, which a controller does not have.

Global view: a dtorch tensor always has its global shape, so upstream's ``use_local_output`` has no effect (model
code that reshapes with ``-1`` sees global sizes and stays correct), and an input's *declared* layout
(``input_layouts``) only matters for plain torch tensors. It means what it means upstream: a plain tensor declared
``Shard(d)`` (or ``Partial``) is each rank's LOCAL shard (upstream's ``DTensor.from_local``: every rank of the
style's axis holds that tensor, so the global batch is ``n`` x local); declared ``Replicate`` it is the global value.
"""

from __future__ import annotations

import logging
import types
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from torch_dtorch.api import distribute_tensor, from_local
from torch_dtorch.device.autograd import match_grad_placements
from torch_dtorch.device.tensors import is_dtorch
from torch_dtorch.errors import PlacementError
from torch_dtorch.nn._layout import AxisRef, distribute_param, set_axis_placement
from torch_dtorch.placement import Placement, Replicate, Shard
from torch_dtorch.placement_rules.families.backward_embedding import vocab_parallel_embedding

log = logging.getLogger("torch_dtorch.nn")

__all__ = [
    "ColumnParallel",
    "LayerStyle",
    "PrepareInput",
    "PrepareOutput",
    "RowParallel",
    "SequenceParallel",
    "from_upstream",
]

_R = Replicate()
StateDict = Mapping[str, torch.Tensor]


class LayerStyle:
    """Base of the styles: :meth:`apply` shards ``module``'s parameters and installs its hooks."""

    def apply(self, module: nn.Module, axis: AxisRef, *, fqn: str, state_dict: StateDict | None) -> nn.Module:
        raise NotImplementedError(f"{type(self).__name__}.apply")


def _place_params(
    module: nn.Module,
    axis: AxisRef,
    layouts: Mapping[str, Placement],
    *,
    fqn: str,
    state_dict: StateDict | None,
    default: Placement = _R,
) -> None:
    """Put ``module``'s own parameters on ``axis`` (``layouts[name]``, else ``default``), Replicate elsewhere."""
    for name, p in list(module.named_parameters(recurse=False)):
        full = f"{fqn}.{name}" if fqn else name
        new = distribute_param(p, *axis.layout(layouts.get(name, default)), name=full, state_dict=state_dict)
        param = new if isinstance(new, nn.Parameter) else nn.Parameter(new)
        module.register_parameter(name, param)
        match_grad_placements([param])  # gradients arrive in the parameter's placements (Partial reduced)


def _what(module: nn.Module, fqn: str, style: Any) -> str:
    return f"{type(style).__name__} on {fqn or '<root>'} ({type(module).__name__})"


def _plain_input_as_local(
    t: Any, axis: AxisRef, declared: Placement | None, desired: Placement | None, what: str
) -> Any:
    """A plain torch tensor whose ``input_layouts`` say ``Shard(d)`` (or ``Partial``) is, as upstream, the LOCAL
    shard of every rank of the style's axis (upstream's ``DTensor.from_local(x, mesh, input_layouts)`` on each rank
    of an SPMD program, where every rank passes its own tensor): the global tensor is ``n`` copies along ``d`` (the
    global batch is ``n`` x local). Other values pass through unchanged (a dtorch tensor is already global; a
    ``Replicate`` declaration distributes the tensor as it is). An input with no desired layout is left alone."""
    if desired is None or not isinstance(t, torch.Tensor) or is_dtorch(t) or torch.compiler.is_compiling():
        return t
    if declared is None or isinstance(declared, Replicate):
        # the global value, Replicate on every axis (then converted to the desired layout by the caller)
        return distribute_tensor(t, axis.root, list(axis.placements(_R)))
    if isinstance(declared, Shard) and not -t.ndim <= declared.dim < t.ndim:
        raise PlacementError(
            f"{what}: input_layouts {declared} is out of range for the {t.ndim}-d input of shape {tuple(t.shape)}"
        )
    mesh, placements = axis.layout(declared)
    devices = mesh.root.devices
    n = axis.size
    log.info(
        "%s: plain torch input %s with input_layouts %s is each rank's LOCAL shard, as upstream: the global "
        "tensor has %d of them (pass a dtorch tensor, e.g. dt.distribute_tensor(x, mesh, ...), to give the "
        "global value instead)",
        what,
        tuple(t.shape),
        declared,
        n,
    )
    return from_local({d: t.detach() for d in devices}, mesh, placements)


def _input_hook(
    axis: AxisRef, declared: Placement | None, desired: Placement | None, what: str
) -> Callable[..., Any]:
    def hook(mod: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
        if not args:
            return None
        first = _plain_input_as_local(args[0], axis, declared, desired, what)
        first = set_axis_placement(first, axis, desired, what=what, declared=declared)
        return (first, *args[1:])

    return hook


def _output_hook(axis: AxisRef, desired: Placement | None, what: str) -> Callable[..., Any]:
    def hook(mod: nn.Module, args: tuple[Any, ...], out: Any) -> Any:
        return set_axis_placement(out, axis, desired, what=f"{what} output")

    return hook


@dataclass
class ColumnParallel(LayerStyle):
    """``nn.Linear``: weight/bias ``S(0)``; ``nn.Embedding``: weight ``S(1)``. The input is converted to
    ``desired_input_layout`` (``R``: an ``S`` input is all-gathered), the output to ``output_layout``
    (``S(-1)``: no communication; ``R``: all-gather)."""

    input_layout: Placement | None = None
    output_layout: Placement = field(default_factory=lambda: Shard(-1))
    desired_input_layout: Placement = field(default_factory=Replicate)

    def apply(self, module: nn.Module, axis: AxisRef, *, fqn: str, state_dict: StateDict | None) -> nn.Module:
        what = _what(module, fqn, self)
        if isinstance(module, nn.Linear):
            layouts = {"weight": Shard(0), "bias": Shard(0)}
        elif isinstance(module, nn.Embedding):
            layouts = {"weight": Shard(1)}
        else:
            raise NotImplementedError(f"{what}: column parallelism supports nn.Linear and nn.Embedding only")
        _place_params(module, axis, layouts, fqn=fqn, state_dict=state_dict)
        module.register_forward_pre_hook(
            _input_hook(axis, self.input_layout, self.desired_input_layout, what)
        )
        module.register_forward_hook(_output_hook(axis, self.output_layout, what))
        return module


@dataclass
class RowParallel(LayerStyle):
    """``nn.Linear``: weight ``S(1)``, bias ``R``, input converted to ``S(-1)`` (an ``R`` input is sliced
    locally); ``nn.Embedding``: weight ``S(0)`` (vocab parallel), input ``R``. The partial sums become
    ``output_layout``: ``R`` by all-reduce, ``S(d)`` by reduce-scatter."""

    input_layout: Placement | None = None
    output_layout: Placement = field(default_factory=Replicate)

    def apply(self, module: nn.Module, axis: AxisRef, *, fqn: str, state_dict: StateDict | None) -> nn.Module:
        what = _what(module, fqn, self)
        desired: Placement
        if isinstance(module, nn.Linear):
            layouts, desired = {"weight": Shard(1), "bias": _R}, Shard(-1)
        elif isinstance(module, nn.Embedding):
            layouts, desired = {"weight": Shard(0)}, _R
        else:
            raise NotImplementedError(f"{what}: row parallelism supports nn.Linear and nn.Embedding only")
        _place_params(module, axis, layouts, fqn=fqn, state_dict=state_dict)
        if isinstance(module, nn.Embedding) and module.max_norm is None and not module.sparse:
            # vocab parallel: the weight gradient is computed on each rank's rows (not the whole [V, D])
            module.forward = types.MethodType(_vocab_parallel_forward, module)  # type: ignore[method-assign]
        module.register_forward_pre_hook(_input_hook(axis, self.input_layout, desired, what))
        module.register_forward_hook(_output_hook(axis, self.output_layout, what))
        return module


@dataclass
class SequenceParallel(LayerStyle):
    """Replicated parameters (norms, dropout); the first input is converted to ``S(sequence_dim)`` (an ``R``
    input is sliced locally), the output keeps the placement the module's ops give it (``S(sequence_dim)`` for
    elementwise / normalization modules)."""

    sequence_dim: int = 1

    def apply(self, module: nn.Module, axis: AxisRef, *, fqn: str, state_dict: StateDict | None) -> nn.Module:
        what = _what(module, fqn, self)
        _place_params(module, axis, {}, fqn=fqn, state_dict=state_dict)
        seq = Shard(self.sequence_dim)
        module.register_forward_pre_hook(_input_hook(axis, seq, seq, what))
        return module


def _vocab_parallel_forward(self: nn.Embedding, input: torch.Tensor) -> torch.Tensor:
    return vocab_parallel_embedding(input, self.weight, self.padding_idx, self.scale_grad_by_freq)


def _layouts(xs: Any) -> tuple[Placement | None, ...]:
    if xs is None:
        return ()
    if isinstance(xs, Placement):
        return (xs,)
    return tuple(xs)


@dataclass
class PrepareInput(LayerStyle):
    """Convert positional inputs to ``desired_input_layouts`` (``None`` entries are left alone) and keyword
    inputs to ``desired_input_kwarg_layouts``; ``input_layouts`` declare how plain torch tensors are
    distributed."""

    input_layouts: Sequence[Placement | None] = ()
    desired_input_layouts: Sequence[Placement | None] = ()
    input_kwarg_layouts: Mapping[str, Placement] = field(default_factory=dict)
    desired_input_kwarg_layouts: Mapping[str, Placement] = field(default_factory=dict)

    def apply(self, module: nn.Module, axis: AxisRef, *, fqn: str, state_dict: StateDict | None) -> nn.Module:
        what = _what(module, fqn, self)
        declared = tuple(self.input_layouts)
        desired = tuple(self.desired_input_layouts)
        if declared and len(declared) != len(desired):
            raise ValueError(f"{what}: input_layouts and desired_input_layouts differ in length")
        kw_declared = dict(self.input_kwarg_layouts)
        kw_desired = dict(self.desired_input_kwarg_layouts)

        def hook(
            mod: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
        ) -> tuple[tuple[Any, ...], dict[str, Any]]:
            new_args = list(args)
            for i, want in enumerate(desired):
                if i < len(new_args):
                    decl = declared[i] if declared else None
                    x = _plain_input_as_local(new_args[i], axis, decl, want, f"{what} input {i}")
                    new_args[i] = set_axis_placement(x, axis, want, what=f"{what} input {i}", declared=decl)
            new_kwargs = dict(kwargs)
            for k, want in kw_desired.items():
                if k in new_kwargs:
                    decl = kw_declared.get(k)
                    x = _plain_input_as_local(new_kwargs[k], axis, decl, want, f"{what} input {k!r}")
                    new_kwargs[k] = set_axis_placement(
                        x, axis, want, what=f"{what} input {k!r}", declared=decl
                    )
            return tuple(new_args), new_kwargs

        module.register_forward_pre_hook(hook, with_kwargs=True)
        return module


@dataclass
class PrepareOutput(LayerStyle):
    """Convert the module's output(s) to ``desired_output_layouts`` on the style's axis."""

    output_layouts: Sequence[Placement | None] = ()
    desired_output_layouts: Sequence[Placement | None] = ()

    def apply(self, module: nn.Module, axis: AxisRef, *, fqn: str, state_dict: StateDict | None) -> nn.Module:
        what = _what(module, fqn, self)
        desired = tuple(self.desired_output_layouts)

        def hook(mod: nn.Module, args: tuple[Any, ...], out: Any) -> Any:
            if isinstance(out, torch.Tensor):
                if len(desired) != 1:
                    raise ValueError(f"{what}: one output, {len(desired)} desired_output_layouts")
                return set_axis_placement(out, axis, desired[0], what=f"{what} output")
            if isinstance(out, (tuple, list)):
                if len(out) != len(desired):
                    raise ValueError(f"{what}: {len(out)} outputs, {len(desired)} desired_output_layouts")
                items = [
                    set_axis_placement(o, axis, d, what=f"{what} output {i}")
                    for i, (o, d) in enumerate(zip(out, desired, strict=True))
                ]
                return type(out)(items)
            raise TypeError(f"{what}: cannot convert an output of type {type(out).__name__}")

        module.register_forward_hook(hook)
        return module


@dataclass
class _Both(LayerStyle):
    styles: tuple[LayerStyle, ...]

    def apply(self, module: nn.Module, axis: AxisRef, *, fqn: str, state_dict: StateDict | None) -> nn.Module:
        for s in self.styles:
            module = s.apply(module, axis, fqn=fqn, state_dict=state_dict)
        return module


def from_upstream(style: Any) -> LayerStyle:
    """Translate an upstream ``torch.distributed.tensor.parallel`` ParallelStyle by reading its attributes."""
    if isinstance(style, LayerStyle):
        return style
    from torch.distributed.tensor import parallel as tp

    name = type(style).__name__
    if isinstance(style, tp.ColwiseParallel):
        return ColumnParallel(
            input_layout=_layouts(style.input_layouts)[0],
            output_layout=_layouts(style.output_layouts)[0] or Shard(-1),
            desired_input_layout=_layouts(style.desired_input_layouts)[0] or _R,
        )
    if isinstance(style, tp.RowwiseParallel):
        return RowParallel(
            input_layout=_layouts(style.input_layouts)[0],
            output_layout=_layouts(style.output_layouts)[0] or _R,
        )
    if isinstance(style, tp.SequenceParallel):
        (seq,) = style.sequence_sharding
        return SequenceParallel(sequence_dim=seq.dim)
    io_cls = getattr(tp, "PrepareModuleInputOutput", None)
    if io_cls is not None and isinstance(style, io_cls):
        return _Both((from_upstream(style.prepare_module_input), from_upstream(style.prepare_module_output)))
    if isinstance(style, tp.PrepareModuleInput):
        return PrepareInput(
            input_layouts=_layouts(style.input_layouts),
            desired_input_layouts=_layouts(style.desired_input_layouts),
            input_kwarg_layouts=dict(style.input_kwarg_layouts or {}),
            desired_input_kwarg_layouts=dict(style.desired_input_kwarg_layouts or {}),
        )
    if isinstance(style, tp.PrepareModuleOutput):
        return PrepareOutput(
            output_layouts=_layouts(style.output_layouts),
            desired_output_layouts=_layouts(style.desired_output_layouts),
        )
    raise NotImplementedError(
        f"parallelize_module: the ParallelStyle {name} is not supported; use ColwiseParallel, RowwiseParallel, "
        "SequenceParallel, PrepareModuleInput, PrepareModuleOutput (torch.distributed.tensor.parallel) or the "
        "styles of torch_dtorch.nn"
    )
