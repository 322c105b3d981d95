"""The backend function behind ``dtorch`` / ``dtorch_debug``: options, checks, capture."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from torch import fx

from torch_dtorch import _compat
from torch_dtorch.backend.capture import capture, needs_grad
from torch_dtorch.backend.compiled import CompiledGraph
from torch_dtorch.backend.options import CompileOptions, CompileOptionsError
from torch_dtorch.backend.training import compile_training

__all__ = ["compile_graph"]

log = logging.getLogger(__name__)


def compile_graph(
    gm: fx.GraphModule,
    example_inputs: Sequence[Any],
    *,
    options: Mapping[str, Any] | None,
    mode: str | None,
    backend: str,
    debug: bool,
) -> Any:
    """Compile one dynamo graph. Returns aot_autograd's wrapper around a :class:`CompiledGraph`."""
    if mode not in (None, "default"):
        raise CompileOptionsError(
            f"torch.compile(backend={backend!r}, mode={mode!r}): modes are not supported; pass "
            "options={'worker_compiler': 'inductor', 'cudagraphs': True} instead"
        )
    opts = CompileOptions.parse(options, backend=backend)
    _compat.hide_from_dynamo()  # modules imported since ``import torch_dtorch`` (this backend's among them)
    if needs_grad(example_inputs):  # training: a forward and a backward program (backend/training.py)
        return compile_training(gm, example_inputs, options=opts, backend=backend, debug=debug)
    compiled: list[CompiledGraph] = []

    def fw_compiler(aten_gm: fx.GraphModule, fake_inputs: list[Any]) -> CompiledGraph:
        static = _compat.static_input_indices(len(fake_inputs))
        cg = CompiledGraph(
            aten_gm, fake_inputs, options=opts, backend=backend, debug=debug, static_inputs=static
        )
        if debug and cg.plain:
            log.info("%s: plain torch inputs; graphs are shown at the first call", backend)
        compiled.append(cg)
        return cg

    return capture(gm, example_inputs, fw_compiler, decompositions=opts.decompositions)
