"""Replicate-only family: ops whose sharded form dtorch does not (or cannot) compute locally.

Each op below has exactly one signature, all-Replicate -> all-Replicate. Called on sharded or Partial inputs, the
matcher picks the cheapest way to Replicate (all-gather, all-reduce; logged at DEBUG on ``torch_dtorch``) and every
rank computes the whole op — slower than a sharded rule, never a wrong answer. ``DTORCH_REDISTRIBUTE=never`` turns
the move into a ``PlacementMismatchError`` instead.

An op only qualifies when its result is a deterministic function of its inputs with a shape known from metadata:
no random draws (the workers' generators are not the controller's), no mutated arguments (e.g. ``native_batch_norm``
updating running statistics, which would change only the workers' copies), no data-dependent output shape (those
are sync points, see :data:`~torch_dtorch.placement_rules.families.indexing.SYNC_OPS`). :func:`register_replicate_only`
checks the schema part of that.

Families: dense linear algebra (factorizations, solves, eigen-decompositions), FFTs, losses, histograms, distance
matrices and a few reductions whose sharded form is not written yet.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch

from torch_dtorch.errors import RuleRegistrationError, ShapeError
from torch_dtorch.graph import TensorMeta
from torch_dtorch.placement_rules.call import OpCall, map_operands
from torch_dtorch.placement_rules.rule import OpRule, register_rule
from torch_dtorch.placement_rules.signature import PlacementSignature

__all__ = ["DEVICE_SHAPED_OPS", "REPLICATE_ONLY_OPS", "ReplicateOnlyRule", "register_replicate_only"]

aten = torch.ops.aten

REPLICATE_ONLY_OPS = [
    # linear algebra
    aten._linalg_det.default, aten._linalg_eigh.default, aten._linalg_eigvals.default, aten._linalg_slogdet.default,
    aten._linalg_solve_ex.default, aten._linalg_svd.default, aten.cholesky.default, aten.cholesky_inverse.default,
    aten._cholesky_solve_helper.default, aten.geqrf.default, aten.linalg_cholesky_ex.default, aten.linalg_eig.default,
    aten.linalg_householder_product.default, aten.linalg_inv_ex.default, aten.linalg_ldl_factor_ex.default,
    aten.linalg_ldl_solve.default, aten.linalg_lstsq.default, aten.linalg_lu.default,
    aten.linalg_lu_factor_ex.default, aten.linalg_lu_solve.default, aten.linalg_matrix_exp.default,
    aten.linalg_qr.default, aten.linalg_solve_triangular.default, aten.lu_unpack.default, aten.ormqr.default,
    aten.triangular_solve.default, aten.linalg_cross.default, aten.addbmm.default, aten.trace.default,
    aten._cdist_forward.default, aten._pdist_forward.default,
    # FFT
    aten._fft_c2c.default, aten._fft_r2c.default, aten._fft_c2r.default,
    # losses with extra buffers or class indices
    aten.binary_cross_entropy.default, aten.multi_margin_loss.default, aten.multilabel_margin_loss_forward.default,
    aten.nll_loss2d_forward.default, aten._ctc_loss.default,  # nll_loss_forward: loss_nll.py
    # reductions, histograms, searches
    aten.nansum.default, aten.std_mean.correction, aten.aminmax.default, aten.count_nonzero.dim_IntList,
    aten.histc.default, aten.histogram.bin_ct, aten.histogram.bins_tensor,
    aten._histogramdd_bin_edges.default, aten._histogramdd_from_bin_cts.default,
    aten._histogramdd_from_bin_tensors.default, aten.searchsorted.Tensor, aten.searchsorted.Scalar,
    aten.nonzero_static.default, aten.segment_reduce.default, aten._embedding_bag_forward_only.default,
    aten.hash_tensor.default,
]  # fmt: skip


def _check_schema(op: Any) -> None:
    for a in op._schema.arguments:
        if a.alias_info is not None and a.alias_info.is_write:
            raise RuleRegistrationError(
                f"register_replicate_only: {op} writes its argument {a.name!r}; a Replicate-only rule would update "
                "only the workers' copies. Write a rule that pins that argument (see inplace.py) instead"
            )


#: ops whose auxiliary outputs have device-specific shapes (the meta kernel follows CUDA; e.g. the CPU
#: ``_embedding_bag_forward_only`` returns an empty ``offset2bag`` in sum mode): shapes come from the mesh's device
DEVICE_SHAPED_OPS = frozenset({aten._embedding_bag_forward_only.default})


class ReplicateOnlyRule(OpRule):
    """All-Replicate only. Shapes come from meta tensors; an op without a meta kernel (``geqrf``, ``linalg_lstsq``,
    ``histogram``, ...) or in :data:`DEVICE_SHAPED_OPS` is run once on zero-filled tensors of the inputs' shapes on
    the mesh's device type instead (its output shapes depend only on the input shapes: O(global) work on the
    controller, once per new shape — the plan is cached)."""

    family = "replicate"

    def signatures(self, call: OpCall) -> Sequence[PlacementSignature]:
        return []

    def infer_meta(self, call: OpCall) -> list[TensorMeta]:
        if call.op not in DEVICE_SHAPED_OPS:
            try:
                return super().infer_meta(call)
            except ShapeError as e:
                if "meta" not in str(e).lower():
                    raise
        kind = call.mesh.device_type if call.mesh is not None else "cpu"
        device = torch.device("cpu") if kind == "cpu" else torch.device(kind, 0)
        args, kwargs = map_operands(
            (call.args, call.kwargs), lambda o: torch.zeros(o.shape, dtype=o.dtype, device=device)
        )
        out = call.op(*args, **kwargs)
        outs = out if isinstance(out, (list, tuple)) else (out,)
        return [TensorMeta.of(t) for t in outs if isinstance(t, torch.Tensor)]


def register_replicate_only(ops: Iterable[Any], *, family: str = "replicate") -> ReplicateOnlyRule:
    """Register ``ops`` with the all-Replicate signature only (see the module docstring for what qualifies)."""
    ops = list(dict.fromkeys(ops))
    for op in ops:
        _check_schema(op)

    rule = ReplicateOnlyRule()
    rule.family = family
    register_rule(*ops, family=family)(rule)
    return rule


register_replicate_only(REPLICATE_ONLY_OPS)
