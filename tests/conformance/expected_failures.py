"""The reviewed expected failures of the OpInfo conformance (``test_opinfo.py``): OpInfo key -> reason.

The only way to skip an op. The test fails when a listed op passes on every mesh, so this list only shrinks.
``MORE_SAMPLES_FAILURES`` lists ops that pass on the first sample (``test_opinfo``) but fail on a later one (the
``slow`` run, ``test_opinfo_more_samples``, checks ``EXPECTED_FAILURES`` and this list together).
"""

from __future__ import annotations

EXPECTED_FAILURES: dict[str, str] = {
    "as_strided": "decomposes to as_strided on a sharded operand (no view/scatter rule for it yet): typed AsStridedError or a local storage error",
    "as_strided.partial_views": "decomposes to as_strided on a sharded operand (no view/scatter rule for it yet): typed AsStridedError or a local storage error",
    "as_strided_copy": "decomposes to as_strided on a sharded operand (no view/scatter rule for it yet): typed AsStridedError or a local storage error",
    "as_strided_scatter": "decomposes to as_strided on a sharded operand (no view/scatter rule for it yet): typed AsStridedError or a local storage error",
    "jiterator_2inputs_2outputs": "CUDA-only OpInfo (jiterator): no CPU sample runs",
    "jiterator_4inputs_with_extra_args": "CUDA-only OpInfo (jiterator): no CPU sample runs",
    "jiterator_binary": "CUDA-only OpInfo (jiterator): no CPU sample runs",
    "jiterator_binary_return_by_ref": "CUDA-only OpInfo (jiterator): no CPU sample runs",
    "jiterator_unary": "CUDA-only OpInfo (jiterator): no CPU sample runs",
    "max_pool2d_with_indices_backward": "no rule yet: aten.max_pool2d_with_indices_backward.grad_input",
    "nanquantile": "decomposes to as_strided on a sharded operand (no view/scatter rule for it yet): typed AsStridedError or a local storage error",
    "nn.functional.bilinear": "decomposes to as_strided on a sharded operand (no view/scatter rule for it yet): typed AsStridedError or a local storage error",
    "nn.functional.fractional_max_pool2d": "no rule yet: aten.fractional_max_pool2d.output (a random op: a rule must replay torch's stream, see device/rng.py)",
    "nn.functional.fractional_max_pool3d": "no rule yet: aten.fractional_max_pool3d.output (a random op: a rule must replay torch's stream, see device/rng.py)",
    "nn.functional.rrelu": "no rule yet: aten.rrelu_with_noise.default (a random op: a rule must replay torch's stream, see device/rng.py)",
    "nn.functional.smooth_l1_loss": "uses resize_ (out= of a different shape); dtorch tensors cannot be resized",
    "nn.functional.soft_margin_loss": "out= tensor of another shape: dtorch tensors cannot be resized",
    "normal": "no rule yet: aten.normal.Tensor_Tensor (a random op: a rule must replay torch's stream, see device/rng.py)",
    "quantile": "decomposes to as_strided on a sharded operand (no view/scatter rule for it yet): typed AsStridedError or a local storage error",
    "resize_": "uses resize_ (out= of a different shape); dtorch tensors cannot be resized",
    "resize_as_": "uses resize_ (out= of a different shape); dtorch tensors cannot be resized",
    "sparse.mm.reduce": "sparse layouts are not supported by dtorch tensors",
    "sparse.sampled_addmm": "sparse layouts are not supported by dtorch tensors",
    "stft": "decomposes to as_strided on a sharded operand (no view/scatter rule for it yet): typed AsStridedError or a local storage error",
    "tensor_split": "error on 2x2/3/1: RuntimeError: tensor_split expected tensor_indices_or_sections to be on cpu, but it's on dtorch:0",
    "to_sparse": "sparse layouts are not supported by dtorch tensors",
}

MORE_SAMPLES_FAILURES: dict[str, str] = {
    "addr": "WRONG (1 ulp): sample 2 on the 1-device mesh is not bit-identical (relative 1.3e-6); to be investigated",
    "nn.functional.scaled_dot_product_attention": "dropout_p > 0 is refused with a typed NotImplementedError",
    "normal.number_mean": "no rule yet: aten.normal.Tensor_float (a random op)",
}

_INPLACE_VIEW = (
    "ERROR: in-place view op (changes self's sizes/strides): dtorch tensors cannot be restrided in place "
    "(a typed RestrideError naming the out-of-place form)"
)
_RESIZE = "NO RULE: aten.resize_ (dtorch tensors cannot be resized: their shape is the global one)"
_INTERNAL_OUT = (
    "ERROR: torch's composite out= passes an internal empty (0,) buffer (info / indices / scratch) to the out= "
    "overload, which must be resized; dtorch tensors cannot be resized: a typed NotImplementedError"
)
_RANDOM_NO_RULE = "NO RULE: a random op (a rule must replay torch's stream, see device/rng.py)"

#: in-place variants (``test_variants.py``) that fail on the 3-device mesh with sharded inputs: OpInfo key -> reason
INPLACE_FAILURES: dict[str, str] = {
    "as_strided": _INPLACE_VIEW,
    "as_strided.partial_views": _INPLACE_VIEW,
    "nn.functional.dropout3d": (
        "ERROR: dropout3d(inplace=True) on an unbatched input restrides self in place (unsqueeze_): a typed "
        "RestrideError"
    ),
    "nn.functional.rrelu": "NO RULE: aten.rrelu_with_noise_ (a random op that also writes its noise argument)",
    "resize_": _RESIZE,
    "resize_as_": _RESIZE,
    "squeeze.multiple": _INPLACE_VIEW,
    "squeeze": _INPLACE_VIEW,
    "t": _INPLACE_VIEW,
    "transpose": _INPLACE_VIEW,
    "unsqueeze": _INPLACE_VIEW,
}

#: ``out=`` calls (``test_variants.py``) that fail on the 3-device mesh with sharded inputs: OpInfo key -> reason
OUT_FAILURES: dict[str, str] = {
    "as_strided_copy": "ERROR: decomposes to as_strided on a sharded operand: a typed AsStridedError",
    "kron": (
        "ERROR: torch's kron out= writes through a 4-d view of out, which a sharded out cannot keep (a redistributed "
        "copy): a typed NotImplementedError"
    ),
    "linalg.cholesky": _INTERNAL_OUT,
    "linalg.det": _INTERNAL_OUT,
    "linalg.inv": _INTERNAL_OUT,
    "linalg.ldl_factor": _INTERNAL_OUT,
    "linalg.lu_factor": _INTERNAL_OUT,
    "linalg.slogdet": _INTERNAL_OUT,
    "linalg.solve": _INTERNAL_OUT,
    "linalg.solve_ex": _INTERNAL_OUT,
    "linspace.tensor_overload": "NO RULE: aten.linspace.out with tensor start/end (no rule for aten.linspace.default)",
    "logspace.tensor_overload": "NO RULE: aten.logspace.out with tensor start/end (no rule for aten.logspace.default)",
    "lu": _RESIZE,
    "msort": _INTERNAL_OUT,
    "nanquantile": (
        "ERROR: quantile's out= reaches as_strided on the storage-less dtorch out tensor (a setStorage RuntimeError)"
    ),
    "nn.functional.logsigmoid": _INTERNAL_OUT,
    "normal": _RANDOM_NO_RULE,
    "quantile": (
        "ERROR: quantile's out= reaches as_strided on the storage-less dtorch out tensor (a setStorage RuntimeError)"
    ),
    "sparse.sampled_addmm": "NO RULE: sparse layouts are not supported by dtorch tensors",
}
