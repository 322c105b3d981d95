"""Capture: dynamo's FX graph -> a functional aten graph through ``aot_autograd``, keeping the intercept list whole.

``aot_autograd`` decomposes a CompositeImplicitAutograd op only where eager autograd would have: the ``dtorch``
device registers a backend kernel for every op of the intercept list (``linear``, ``layer_norm``,
``scaled_dot_product_attention``, every view, ...), so on dtorch (fake) tensors those arrive whole, exactly as in
eager mode. On plain CPU/CUDA inputs they decompose exactly as eager torch runs them (bit-identical by construction).
torch 2.13's tracers make that check themselves (``autograd_would_have_decomposed``); on older ones (2.11)
:func:`~torch_dtorch._compat.keep_composites_whole` makes ``decompose`` decline for dtorch inputs instead.

Only a small explicit decomposition table is applied (:data:`DECOMPOSITIONS`, plus ``options["decompositions"]``),
never the Core ATen set: that would remove attention (no context-parallel rule could fire), rewrite ``silu`` and
``linear`` (breaking bit-identity) and rule out fused attention kernels on the workers.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import fx

from torch_dtorch import _compat
from torch_dtorch.device.tensors import DEVICE_NAME
from torch_dtorch.graph.operand import dtype_str
from torch_dtorch.graph.operator import op_name

__all__ = ["DECOMPOSITIONS", "capture", "decomposition_table", "format_aten_graph", "needs_grad"]

aten = torch.ops.aten
log = logging.getLogger(__name__)

#: aten overloads decomposed during capture. Each entry is an op that aot_autograd can emit but that has no placement
#: rule, and whose decomposition reproduces eager torch bit for bit (so it never changes a result).
DECOMPOSITIONS: tuple[Any, ...] = ()


def _fma(a: Any, b: Any, c: Any) -> Any:
    """``prims.fma(a, b, c)`` as its own eager implementation, ``(a * b) + c`` (two roundings, as eager runs it)."""
    return aten.add.Tensor(aten.mul.Tensor(a, b), c)


def extra_decompositions() -> dict[Any, Callable[..., Any]]:
    """Decompositions torch's table does not hold, for ops dynamo itself emits. ``prims.fma``: dynamo rewrites
    ``t.addcmul_(x, y, value=v)``, ``t.addcdiv_(x, y, value=v)`` and ``t.add_(x, alpha=tensor)`` into
    ``copy_(t, fma(x * y, v, t))`` (``torch._dynamo.config.enable_dynamo_decompositions``), which the single-tensor
    (``foreach=False``) Adam/AdamW step does; dtorch has no rule for the prim. The prim exists once
    ``torch._inductor.inductor_prims`` is imported (dynamo imports it before it emits one)."""
    table: dict[Any, Callable[..., Any]] = {}
    if hasattr(torch.ops.prims, "fma"):
        table[torch.ops.prims.fma.default] = _fma
    return table


def decomposition_table(extra: Sequence[Any] = ()) -> dict[Any, Callable[..., Any]]:
    return {**extra_decompositions(), **_compat.core_decompositions([*DECOMPOSITIONS, *extra])}


def needs_grad(example_inputs: Sequence[Any]) -> bool:
    """Whether aot_autograd would trace a joint forward/backward graph for these inputs."""
    return torch.is_grad_enabled() and any(
        isinstance(x, torch.Tensor) and x.requires_grad for x in example_inputs
    )


def capture(
    gm: fx.GraphModule,
    example_inputs: Sequence[Any],
    fw_compiler: Callable[[fx.GraphModule, list[Any]], Any],
    *,
    decompositions: Sequence[Any] = (),
    bw_compiler: Callable[[fx.GraphModule, list[Any]], Any] | None = None,
) -> Any:
    """Run ``aot_autograd`` over dynamo's graph; ``fw_compiler(aten_gm, fake_inputs)`` builds the callable that runs
    the (forward) aten graph. With ``bw_compiler`` (training, :mod:`~torch_dtorch.backend.training`) aot traces the
    joint graph and partitions it: ``bw_compiler`` builds the backward graph's callable. Returns aot's runtime
    wrapper (which handles input mutations, output aliases and, in training, the ``autograd.Function``)."""

    def no_backward(gm: fx.GraphModule, example_inputs: list[Any]) -> Any:
        raise NotImplementedError(
            "torch.compile(backend='dtorch'): backward graphs are not supported yet; run the compiled model under "
            "torch.no_grad() / torch.inference_mode(), or use the model eagerly on dtorch tensors for training"
        )

    # torch >= 2.13's tracers keep an op with a dtorch kernel whole by themselves; older ones decompose every
    # composite op unless told otherwise (see _compat.keep_composites_whole)
    with _compat.keep_composites_whole(DEVICE_NAME) as fallback:
        if fallback:
            log.debug(
                "capture: keeping composite ops whole through the decompose fallback (torch %s)",
                torch.__version__,
            )
        return _compat.aot_module_simplified(
            gm,
            list(example_inputs),
            fw_compiler=fw_compiler,
            bw_compiler=bw_compiler if bw_compiler is not None else no_backward,
            decompositions=decomposition_table(decompositions),
        )


# --- printing ------------------------------------------------------------------------------------------------------


def _type_of(node: fx.Node) -> str:
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        return f"{dtype_str(val.dtype)}[{', '.join(str(s) for s in val.shape)}]"
    if isinstance(val, (list, tuple)):
        return (
            "("
            + ", ".join(
                f"{dtype_str(v.dtype)}[{', '.join(str(s) for s in v.shape)}]"
                if isinstance(v, torch.Tensor)
                else "?"
                for v in val
            )
            + ")"
        )
    return type(val).__name__ if val is not None else "?"


def format_value(a: Any) -> str:
    """One argument of an FX node, in the compact printed form (``%name`` for nodes)."""
    if isinstance(a, fx.Node):
        return f"%{a.name}"
    if isinstance(a, (list, tuple)):
        return "[" + ", ".join(format_value(x) for x in a) + "]"
    if isinstance(a, torch.dtype):
        return dtype_str(a)
    if isinstance(a, torch.device):
        return f"'{a}'"
    if isinstance(a, str):
        return repr(a)
    if isinstance(a, float):
        return repr(a)
    return str(a)


def target_name(target: Any) -> str:
    if isinstance(target, torch._ops.OpOverload):
        return op_name(target)
    name = getattr(target, "__name__", None)
    return name if name is not None else str(target)


def format_aten_graph(gm: fx.GraphModule) -> str:
    """The captured aten graph, one line per node: ``%mm = aten.mm(%x, %w) -> f32[4, 8]``."""
    lines = []
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            lines.append(f"%{node.name} = input() -> {_type_of(node)}")
        elif node.op == "get_attr":
            lines.append(f"%{node.name} = constant({node.target}) -> {_type_of(node)}")
        elif node.op == "call_function":
            parts = [format_value(a) for a in node.args]
            parts += [f"{k}={format_value(v)}" for k, v in node.kwargs.items()]
            lines.append(f"%{node.name} = {target_name(node.target)}({', '.join(parts)}) -> {_type_of(node)}")
        elif node.op == "output":
            lines.append(f"return {format_value(node.args[0])}")
        else:
            lines.append(f"%{node.name} = {node.op}({node.target})")
    return "\n".join(lines)
