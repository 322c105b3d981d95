"""Samples for rules added for OpInfo coverage (indexing, sorting, spatial, Replicate-only, special functions),
captured from PyTorch's OpInfo database: every aten call the OpInfo's float32 samples make on the CPU, for the ops
below that no other ``samples_*.py`` module covers (at most two calls per op)."""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from tests.rules.harness import Sample
from torch_dtorch.placement_rules import rules_by_family

_FAMILIES = ("indexing", "sorting", "spatial", "replicate")
_PER_OP = 2
#: outputs torch leaves partly uninitialized (``_ctc_loss``'s ``log_alpha`` workspace)
_UNSPECIFIED_OUTPUTS = {torch.ops.aten._ctc_loss.default: (1,)}


def _wanted() -> set[Any]:
    from torch_dtorch.placement_rules.families.pointwise import (
        _REGISTERED,
        SPECIAL_BINARY_OPS,
        SPECIAL_UNARY_OPS,
    )

    fams = rules_by_family()
    ops = {op for f in _FAMILIES for op in fams.get(f, [])}
    ops |= {op for op in (*SPECIAL_UNARY_OPS, *SPECIAL_BINARY_OPS) if op not in _REGISTERED}
    from torch_dtorch.placement_rules.families.normalization import BatchNormRule  # noqa: F401 - registered there

    ops |= {
        torch.ops.aten.native_batch_norm.default,
        torch.ops.aten.bucketize.Tensor,
        torch.ops.aten.isin.Tensor_Tensor,
    }
    return {op for op in ops if not str(op).split(".")[1].endswith("_")}


class _Capture(TorchDispatchMode):
    def __init__(self, wanted: set[Any], out: dict[Any, list[Sample]]) -> None:
        super().__init__()
        self.wanted, self.out = wanted, out

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        got = self.out.setdefault(func, []) if func in self.wanted else None
        if got is not None and len(got) < _PER_OP:
            a, k = pytree.tree_map_only(
                torch.Tensor, lambda t: t.detach().clone(), (tuple(args), dict(kwargs))
            )
            options = lambda slot, t: (
                [torch.distributed.tensor.Replicate()]
                + [torch.distributed.tensor.Shard(d) for d in range(t.ndim)]
            )
            unspecified = _UNSPECIFIED_OUTPUTS.get(func, ())
            got.append(Sample(a, k, atol=1e-4, rtol=1e-4, options=options, unspecified_outputs=unspecified))
        return func(*args, **kwargs)


def _capture() -> dict[Any, list[Sample]]:
    from torch.testing._internal.common_methods_invocations import op_db

    from tests.opinfo_samples import quick_sample_inputs

    wanted = _wanted()
    out: dict[Any, list[Sample]] = {}
    with quick_sample_inputs():
        return _capture_all(op_db, wanted, out)


def _capture_all(op_db: Any, wanted: Any, out: dict[Any, list[Sample]]) -> dict[Any, list[Sample]]:
    for info in op_db:
        if torch.float32 not in info.supported_dtypes("cpu"):
            continue
        with contextlib.suppress(Exception):
            for i, s in enumerate(info.sample_inputs("cpu", torch.float32)):
                if i >= 2:
                    break
                with _Capture(wanted, out):
                    info.op(s.input, *s.args, **s.kwargs)
    return {op: v for op, v in out.items() if v}


def _hand_written() -> dict[Any, list[Sample]]:
    """Ops the first OpInfo samples do not reach (overloads, 1-d/3-d spatial variants, eval batch norm)."""
    aten = torch.ops.aten
    g = torch.Generator().manual_seed(7)
    x = torch.randn(5, 3, generator=g)
    pos = x.abs() + 0.5
    idx = torch.randint(0, 5, (5, 3), generator=g)
    ints = torch.randint(0, 4, (5, 3), generator=g)
    x3 = torch.randn(2, 3, 8, generator=g)
    x4 = torch.randn(2, 3, 5, 6, generator=g)
    x5 = torch.randn(2, 3, 4, 5, 6, generator=g)
    bn = (torch.randn(4, 3, 5, generator=g), torch.rand(3, generator=g) + 0.5, torch.randn(3, generator=g))
    stats = (torch.randn(3, generator=g), torch.rand(3, generator=g) + 0.5)
    lower = torch.linalg.cholesky(torch.eye(4) * 4 + 0.1 * torch.randn(4, 4, generator=g).tril(-1))
    out = torch.log_softmax(x, 1)
    return {
        aten.zero.default: [Sample((x,))],
        aten.xlogy.Scalar_Self: [Sample((2.0, pos))],
        aten.xlogy.Scalar_Other: [Sample((pos, 3.0))],
        aten.isin.Tensor_Scalar: [Sample((ints, 2))],
        aten.native_batch_norm.default: [Sample((*bn, *stats, False, 0.1, 1e-5), atol=1e-4, rtol=1e-4)],
        aten._native_batch_norm_legit.default: [
            Sample((*bn, *stats, False, 0.1, 1e-5), atol=1e-4, rtol=1e-4)
        ],
        aten._batch_norm_with_update.default: [Sample((*bn, *stats, 0.1, 1e-5), atol=1e-4, rtol=1e-4)],
        aten.scatter.value: [Sample((x, 0, idx, 1.5)), Sample((x, 1, idx[:, :2] % 3, -2.0))],
        aten.scatter.value_reduce: [
            Sample((x, 0, idx, 1.5), {"reduce": "add"}),
            Sample((x, 1, idx % 3, 2.0), {"reduce": "multiply"}),
        ],
        aten.sort.stable: [
            Sample((x,), {"stable": True, "dim": 1}),
            Sample((ints,), {"stable": True, "dim": 0}),
        ],
        aten.argsort.default: [Sample((x, 1)), Sample((x, 0, True))],
        aten.argsort.stable: [Sample((ints,), {"stable": True, "dim": 0, "descending": True})],
        aten._log_softmax_backward_data.default: [
            Sample((torch.randn(5, 3, generator=g), out, 1, torch.float32))
        ],
        aten.reflection_pad2d.default: [Sample((x4, [1, 2, 2, 1]))],
        aten.reflection_pad3d.default: [Sample((x5, [1, 1, 2, 0, 1, 2]))],
        aten.replication_pad3d.default: [Sample((x5, [1, 1, 2, 0, 1, 2]))],
        aten.upsample_nearest2d.default: [Sample((x4, [7, 9]))],
        aten.upsample_nearest3d.default: [Sample((x5, [5, 7, 9]))],
        aten._upsample_nearest_exact2d.default: [Sample((x4, [7, 9]))],
        aten._upsample_nearest_exact3d.default: [Sample((x5, [5, 7, 9]))],
        aten._upsample_bicubic2d_aa.default: [Sample((x4, [3, 4], False), atol=1e-4, rtol=1e-4)],
        aten.max_pool1d.default: [Sample((x3, [2])), Sample((x3, [3], [2], [1]))],
        aten.avg_pool1d.default: [Sample((x3, [2])), Sample((x3, [3], [2], [1]))],
        aten.adaptive_max_pool1d.default: [Sample((x3, [3]))],
        aten.max_pool1d_with_indices.default: [Sample((x3, [2])), Sample((x3, [3], [2], [1]))],
        aten.col2im.default: [
            Sample((torch.randn(2, 12, 12, generator=g), [4, 5], [2, 2], [1, 1], [0, 0], [1, 1]))
        ],
        aten._linalg_eigvals.default: [Sample((torch.randn(2, 4, 4, generator=g),), atol=1e-4, rtol=1e-4)],
        aten._cholesky_solve_helper.default: [
            Sample((torch.randn(4, 3, generator=g), lower, False), atol=1e-4)
        ],
        aten.nll_loss2d_forward.default: [
            Sample((torch.log_softmax(x4, 1), torch.randint(0, 3, (2, 5, 6), generator=g), None, 1, -100))
        ],
        aten.count_nonzero.dim_IntList: [Sample((ints, [0])), Sample((ints, [0, 1]))],
        aten._conj.default: [Sample((torch.randn(5, 3, dtype=torch.complex64, generator=g),))],
        aten.conj_physical.default: [
            Sample((torch.randn(5, 3, dtype=torch.complex64, generator=g),)),
            Sample((x,)),
        ],
        aten._conj_physical.default: [Sample((torch.randn(4, 2, dtype=torch.complex64, generator=g),))],
        aten._neg_view.default: [
            Sample((x,)),
            Sample((torch.randn(4, 2, dtype=torch.complex64, generator=g),)),
        ],
        aten.searchsorted.Scalar: [Sample((torch.sort(x.flatten()).values, 0.25))],
    }


def _merged() -> dict[object, list[Sample]]:
    captured, hand = _capture(), _hand_written()
    return {op: captured.get(op, []) + hand.get(op, []) for op in {*captured, *hand}}


SAMPLES: dict[object, list[Sample]] = _merged()
