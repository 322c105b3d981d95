"""Compiled training: ``torch.compile(model, backend="dtorch")`` when an input requires grad.

aot_autograd traces the joint forward/backward graph over dtorch (fake) tensors — composite ops that eager autograd
decomposes (their ``AutogradPrivateUse1`` kernels) decompose here too, so the forward holds exactly the ops eager
training records and the backward the ops eager autograd calls (``mm`` of transposed operands,
``threshold_backward``, ``native_layer_norm_backward``, ...) — and partitions it. Each half becomes a
:class:`~torch_dtorch.backend.compiled.CompiledGraph`: placements propagated once per input layout, one local
program per rank shipped once, one ``RunProgram`` message per call. aot's ``autograd.Function`` ties them together:
the forward program returns the outputs and the tensors saved for backward (dtorch tensors on the workers), and
``loss.backward()`` runs the backward program on them and the incoming gradient. The forward graph tells its backward
graph which input layouts it ran with (:class:`~torch_dtorch.backend.place_grad.GradPlacements`), so every gradient
leaves the backward program in its input's placements — a parameter's gradient in the parameter's, reduced inside
the program. Autograd then accumulates it into ``.grad`` as in eager mode.

The layout requests of parallel styles and layers (``dtorch::place``) differentiate to ``dtorch::place_as``: the
gradient goes back to the layout the forward input had (``backend/place.py``). The optimizer step stays eager (the
``_foreach_*`` list rules make it ~10 operators for any number of parameters) or is compiled on its own
(``torch.compile(opt.step, backend="dtorch")``, an inference graph; Adam's first step eager: docs/compile.md).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch
from torch import fx

from torch_dtorch import _compat
from torch_dtorch.backend.capture import capture
from torch_dtorch.backend.compiled import CompiledGraph
from torch_dtorch.backend.options import CompileOptions
from torch_dtorch.backend.place_grad import GradPlacements
from torch_dtorch.placement_rules import registered_ops

__all__ = ["TRAINING_DECOMPOSITIONS", "compile_training"]

log = logging.getLogger(__name__)
aten = torch.ops.aten

#: backward overloads that reach aot's tracer whole (eager dtorch runs their CompositeExplicitAutograd kernels, which
#: call ops with rules) and have no rule of their own: decomposed at capture into exactly what those kernels run
TRAINING_DECOMPOSITIONS: tuple[Any, ...] = (
    aten.slice_backward.default,
    aten.select_backward.default,
    aten.diagonal_backward.default,
    aten.unfold_backward.default,
)


def compile_training(
    gm: fx.GraphModule, example_inputs: Sequence[Any], *, options: CompileOptions, backend: str, debug: bool
) -> Any:
    """aot_autograd's training wrapper around a forward and a backward :class:`CompiledGraph` (see the module
    docstring)."""
    link = GradPlacements()

    def fw_compiler(aten_gm: fx.GraphModule, fake_inputs: list[Any]) -> CompiledGraph:
        log.debug("%s: training forward graph with %d inputs", backend, len(fake_inputs))
        static = _compat.static_input_indices(len(fake_inputs))  # the primals: parameters first
        return CompiledGraph(
            aten_gm,
            fake_inputs,
            options=options,
            backend=backend,
            debug=debug,
            records=link,
            static_inputs=static,
        )

    def bw_compiler(aten_gm: fx.GraphModule, fake_inputs: list[Any]) -> CompiledGraph:
        log.debug("%s: training backward graph with %d inputs", backend, len(fake_inputs))
        return CompiledGraph(
            aten_gm, fake_inputs, options=options, backend=backend, debug=debug, grad_targets=link
        )

    decompositions = [op for op in TRAINING_DECOMPOSITIONS if not has_rule(op)]
    # aot_autograd's default partitioner for every worker compiler: inductor's min-cut one (recompute fusible ops in
    # the backward) measured worse on the H200 (docs/training.md, "Compiled training: what the forward saves")
    return capture(
        gm,
        example_inputs,
        fw_compiler,
        decompositions=(*decompositions, *options.decompositions),
        bw_compiler=bw_compiler,
    )


def has_rule(op: Any) -> bool:
    return op in set(registered_ops())
