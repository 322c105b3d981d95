"""Tensor-parallel layers: ``Linear`` (column / row / replicated), its named variants, and ``Embedding``.

Every layer owns ONE mesh axis (``tp_dim``, default ``"tp"``) and leaves the other axes alone (a batch sharded on
``"dp"`` stays sharded). Inputs are global-view dtorch tensors; the layer converts the input's placement on its
axis to the one it needs (documented per layer; ``strict=True`` raises a :class:`PlacementError` instead) and
converts its output to the documented placement. A plain torch tensor input is distributed (Replicate).

=================================================  ==================  ===================  ===========================
layer                                              input on ``tp``     output on ``tp``     collective (forward)
=================================================  ==================  ===================  ===========================
``Linear(tp_shard_type="col")`` /                  ``R``               ``S(-1)``            none
``ColumnParallelLinear``
``ColumnParallelLinearReplicateOutput``            ``R``               ``R``                all-gather (last dim)
``Linear(tp_shard_type="row")`` /                  ``S(-1)``           ``R``                all-reduce
``RowParallelLinear``
``RowParallelLinear(output_layout=Shard(1))``      ``S(-1)``           ``S(1)``             reduce-scatter
``RowParallelLinearReplicateInputOutput``          ``R`` (local slice) ``R``                all-reduce
``Linear(tp_shard_type=None)``                     any                 as the op's rule     none
``Embedding(tp_shard_type="row")`` (vocab)         ``R``               ``R``                all-reduce
``Embedding(tp_shard_type="col")``                 ``R``               ``S(-1)``            none
``EmbeddingReplicateOutput``                       ``R``               ``R``                all-gather (last dim)
=================================================  ==================  ===================  ===========================

Input conversions (``strict=False``): ``S(d) -> R`` all-gather, ``P -> R`` all-reduce, ``R -> S(-1)`` local slice,
``S(d) -> S(-1)`` all-to-all, ``P -> S(-1)`` reduce-scatter.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn

from torch_dtorch.api import distribute_tensor
from torch_dtorch.device.autograd import match_grad_placements
from torch_dtorch.device.tensors import is_dtorch
from torch_dtorch.errors import PlacementError
from torch_dtorch.mesh import DeviceMesh
from torch_dtorch.nn._layout import (
    AxisRef,
    current_axis_placement,
    distribute_param,
    resolve_axis,
    set_axis_placement,
)
from torch_dtorch.placement import Placement, Replicate, Shard
from torch_dtorch.placement_rules.families.backward_embedding import vocab_parallel_embedding

__all__ = [
    "ColumnParallelLinear",
    "ColumnParallelLinearReplicateOutput",
    "Embedding",
    "EmbeddingReplicateOutput",
    "Linear",
    "RowParallelLinear",
    "RowParallelLinearReplicateInputOutput",
]

ShardType = Literal["col", "row"] | None
_R = Replicate()


def _check_shard_type(t: Any, what: str) -> None:
    if t not in ("col", "row", None):
        raise ValueError(f"{what}: tp_shard_type must be 'col', 'row' or None, got {t!r}")


class _TPLayer(nn.Module):
    """Shared input/output conversion of the parallel layers."""

    axis: AxisRef
    input_layout: Placement | None
    output_layout: Placement | None
    strict: bool

    def _prepare_input(self, x: Any) -> Any:
        if (
            self.input_layout is not None
            and isinstance(x, torch.Tensor)
            and not is_dtorch(x)
            and not torch.compiler.is_compiling()
        ):
            # a plain tensor is the global value: distributed Replicate first, so the input layout applies to it
            x = distribute_tensor(x, self.axis.root, list(self.axis.placements(_R)))
        return set_axis_placement(
            x, self.axis, self.input_layout, what=f"{type(self).__name__}", strict=self.strict
        )

    def _prepare_output(self, y: Any) -> Any:
        return set_axis_placement(y, self.axis, self.output_layout, what=f"{type(self).__name__} output")


class Linear(_TPLayer):
    """``nn.Linear`` with its weight sharded on one mesh axis.

    Args:
        in_features, out_features, bias: as ``nn.Linear``.
        device_mesh: the mesh (a root mesh or a view such as ``mesh["tp"]``).
        tp_dim: the mesh axis this layer shards over (name or index; default ``"tp"``, or the only axis).
        tp_shard_type: ``"col"`` (weight ``S(0)``, bias ``S(0)``: input ``R`` -> output ``S(-1)``, no
            communication), ``"row"`` (weight ``S(1)``, bias ``R``: input ``S(-1)`` -> partial sums -> output
            ``R`` by all-reduce), ``None`` (replicated weight).
        input_layout / output_layout: override the placement on ``tp_dim`` the input is converted to / the output
            is converted to (e.g. ``output_layout=Shard(1)``: reduce-scatter over the sequence for sequence
            parallelism; ``Partial()`` keeps the row-parallel partial sums).
        strict: raise instead of converting an input that arrives with another placement on ``tp_dim``.
        weight / bias_value: initial global values (default: ``nn.Linear``'s initialization on the controller,
            each worker receives only its shard).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        device_mesh: DeviceMesh,
        tp_dim: int | str | None = "tp",
        tp_shard_type: ShardType = "col",
        input_layout: Placement | None = None,
        output_layout: Placement | None = None,
        strict: bool = False,
        dtype: torch.dtype | None = None,
        weight: torch.Tensor | None = None,
        bias_value: torch.Tensor | None = None,
    ) -> None:
        super().__init__()
        _check_shard_type(tp_shard_type, type(self).__name__)
        self.in_features, self.out_features = in_features, out_features
        self.tp_shard_type = tp_shard_type
        self.strict = strict
        if tp_dim == "tp" and (device_mesh.mesh_dim_names is None or "tp" not in device_mesh.mesh_dim_names):
            tp_dim = None if device_mesh.ndim == 1 else tp_dim
        self.axis = resolve_axis(device_mesh, tp_dim, what=type(self).__name__)
        if weight is None or (bias and bias_value is None):
            ref = nn.Linear(in_features, out_features, bias=bias, dtype=dtype)
            weight = ref.weight.detach() if weight is None else weight
            if bias and bias_value is None:
                assert ref.bias is not None
                bias_value = ref.bias.detach()
        if tuple(weight.shape) != (out_features, in_features):
            raise PlacementError(
                f"{type(self).__name__}: weight has shape {tuple(weight.shape)}, expected "
                f"({out_features}, {in_features})"
            )
        w_pl, b_pl = self._param_layouts(tp_shard_type)
        self.weight = nn.Parameter(distribute_param(weight, *self.axis.layout(w_pl), name="weight"))
        if bias:
            assert bias_value is not None
            self.bias: nn.Parameter | None = nn.Parameter(
                distribute_param(bias_value, *self.axis.layout(b_pl), name="bias")
            )
        else:
            self.register_parameter("bias", None)
        default_in, default_out = {
            "col": (_R, Shard(-1)),
            "row": (Shard(-1), _R),
            None: (None, None),
        }[tp_shard_type]
        self.input_layout = input_layout if input_layout is not None else default_in
        self.output_layout = output_layout if output_layout is not None else default_out
        match_grad_placements(self)  # gradients arrive in the parameters' placements (Partial reduced)

    @staticmethod
    def _param_layouts(tp_shard_type: ShardType) -> tuple[Placement, Placement]:
        if tp_shard_type == "col":
            return Shard(0), Shard(0)
        if tp_shard_type == "row":
            return Shard(1), _R
        return _R, _R

    @classmethod
    def from_linear(
        cls,
        module: nn.Linear,
        *,
        device_mesh: DeviceMesh,
        tp_dim: int | str | None = "tp",
        **kwargs: Any,
    ) -> Linear:
        """A parallel copy of an ``nn.Linear`` (its weights are sliced per shard; a meta module raises)."""
        bias = module.bias is not None
        return cls(
            module.in_features,
            module.out_features,
            bias,
            device_mesh=device_mesh,
            tp_dim=tp_dim,
            weight=module.weight.detach(),
            bias_value=module.bias.detach() if module.bias is not None else None,
            **kwargs,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self._prepare_input(x)
        return self._prepare_output(F.linear(x, self.weight, self.bias))

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
            f"tp_dim={self.axis.name!r}, tp_shard_type={self.tp_shard_type!r}, input={self.input_layout}, "
            f"output={self.output_layout}"
        )


class ColumnParallelLinear(Linear):
    """Column-parallel ``Linear``: input ``R`` on ``tp_dim`` -> output ``S(-1)``; no communication."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, **kwargs: Any) -> None:
        kwargs.setdefault("tp_shard_type", "col")
        super().__init__(in_features, out_features, bias, **kwargs)


class ColumnParallelLinearReplicateOutput(ColumnParallelLinear):
    """Column-parallel ``Linear`` whose output is all-gathered: input ``R`` -> output ``R``."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, **kwargs: Any) -> None:
        kwargs.setdefault("output_layout", _R)
        super().__init__(in_features, out_features, bias, **kwargs)


class RowParallelLinear(Linear):
    """Row-parallel ``Linear``: input ``S(-1)`` on ``tp_dim`` -> partial sums -> output ``R`` (all-reduce);
    ``output_layout=Shard(d)`` reduce-scatters instead, ``Partial()`` leaves the reduction to a later op."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, **kwargs: Any) -> None:
        kwargs.setdefault("tp_shard_type", "row")
        super().__init__(in_features, out_features, bias, **kwargs)


class RowParallelLinearReplicateInputOutput(RowParallelLinear):
    """Row-parallel ``Linear`` taking a replicated input (sliced locally, no communication) -> output ``R``."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, **kwargs: Any) -> None:
        if kwargs.get("strict"):
            raise ValueError(
                "RowParallelLinearReplicateInputOutput: strict=True contradicts its replicated input (the input "
                "is sliced locally by design)"
            )
        super().__init__(in_features, out_features, bias, **kwargs)

    def _prepare_input(self, x: Any) -> Any:
        if is_dtorch(x) and type(current_axis_placement(x, self.axis)) is not Replicate:
            raise PlacementError(
                f"RowParallelLinearReplicateInputOutput: input {x.shape} must be Replicate on mesh axis "
                f"{self.axis.name!r}, got {x.placements}.\n  fix: use RowParallelLinear for a "
                "last-dim-sharded input, or redistribute the input to Replicate"
            )
        return super()._prepare_input(x)


class Embedding(_TPLayer):
    """``nn.Embedding`` sharded on one mesh axis.

    ``tp_shard_type="row"`` (vocab parallel, upstream ``RowwiseParallel``): weight ``S(0)``; indices ``R`` on
    ``tp_dim``; each rank looks up its vocab rows -> partial sums -> output ``R`` by all-reduce
    (``output_layout=Shard(1)``: reduce-scatter over the sequence). ``"col"`` (upstream ``ColwiseParallel``):
    weight ``S(1)``; output ``S(-1)``, no communication. ``None``: replicated weight.
    Indices sharded on ``tp_dim`` are all-gathered first (``strict=True`` raises instead). ``padding_idx`` only
    affects initialization (forward only: no gradient masking).
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        padding_idx: int | None = None,
        *,
        device_mesh: DeviceMesh,
        tp_dim: int | str | None = "tp",
        tp_shard_type: ShardType = "row",
        output_layout: Placement | None = None,
        strict: bool = False,
        dtype: torch.dtype | None = None,
        weight: torch.Tensor | None = None,
    ) -> None:
        super().__init__()
        _check_shard_type(tp_shard_type, type(self).__name__)
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.padding_idx = padding_idx
        self.tp_shard_type = tp_shard_type
        self.strict = strict
        if tp_dim == "tp" and (device_mesh.mesh_dim_names is None or "tp" not in device_mesh.mesh_dim_names):
            tp_dim = None if device_mesh.ndim == 1 else tp_dim
        self.axis = resolve_axis(device_mesh, tp_dim, what=type(self).__name__)
        if weight is None:
            weight = nn.Embedding(num_embeddings, embedding_dim, padding_idx, dtype=dtype).weight.detach()
        w_pl = {"row": Shard(0), "col": Shard(1), None: _R}[tp_shard_type]
        self.weight = nn.Parameter(distribute_param(weight, *self.axis.layout(w_pl), name="weight"))
        self.input_layout = _R if tp_shard_type is not None else None
        default_out = {"row": _R, "col": Shard(-1), None: None}[tp_shard_type]
        self.output_layout = output_layout if output_layout is not None else default_out
        match_grad_placements(self)

    @classmethod
    def from_embedding(
        cls, module: nn.Embedding, *, device_mesh: DeviceMesh, tp_dim: int | str | None = "tp", **kwargs: Any
    ) -> Embedding:
        if module.max_norm is not None or module.scale_grad_by_freq or module.sparse:
            raise NotImplementedError(
                f"{cls.__name__}.from_embedding: max_norm / scale_grad_by_freq / sparse embeddings are not "
                "supported on dtorch tensors"
            )
        return cls(
            module.num_embeddings,
            module.embedding_dim,
            module.padding_idx,
            device_mesh=device_mesh,
            tp_dim=tp_dim,
            weight=module.weight.detach(),
            **kwargs,
        )

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        ids = self._prepare_input(ids)
        if self.tp_shard_type == "row":  # vocab parallel: the weight gradient is computed on each rank's rows
            return self._prepare_output(vocab_parallel_embedding(ids, self.weight, None, False))
        return self._prepare_output(F.embedding(ids, self.weight))

    def extra_repr(self) -> str:
        return (
            f"{self.num_embeddings}, {self.embedding_dim}, tp_dim={self.axis.name!r}, "
            f"tp_shard_type={self.tp_shard_type!r}, output={self.output_layout}"
        )


class EmbeddingReplicateOutput(Embedding):
    """``Embedding`` with a replicated output: ``"col"`` all-gathers the embedding dim; ``"row"`` all-reduces."""

    def __init__(
        self, num_embeddings: int, embedding_dim: int, padding_idx: int | None = None, **kwargs: Any
    ):
        kwargs.setdefault("tp_shard_type", "col")
        kwargs.setdefault("output_layout", _R)
        super().__init__(num_embeddings, embedding_dim, padding_idx, **kwargs)
