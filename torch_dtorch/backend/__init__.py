"""``torch.compile`` backends for dtorch: ``dtorch`` and ``dtorch_debug``.

Registered through the ``torch_dynamo_backends`` entry-point group (see ``pyproject.toml``), so
``torch.compile(model, backend="dtorch")`` finds them after ``pip install`` without importing ``torch_dtorch``; importing
this module registers them too (a source checkout on ``PYTHONPATH`` has no entry points).
A backend is ``(gm, example_inputs, **kwargs) -> callable``; the heavy imports happen inside. See docs/compile.md.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from torch_dtorch._compat import capturable_optimizers_on, register_dynamo_backend
from torch_dtorch.executor.worker import declare_worker_module

if TYPE_CHECKING:
    import torch
    from torch import fx

__all__ = ["dtorch_backend", "dtorch_debug_backend"]

# compiled programs run through their own instructions: worker processes import their handlers when they join
declare_worker_module("torch_dtorch.backend.program")
declare_worker_module("torch_dtorch.backend.graph_program")


def dtorch_backend(
    gm: fx.GraphModule,
    example_inputs: list[torch.Tensor],
    *,
    options: Mapping[str, Any] | None = None,
    mode: str | None = None,
) -> Any:
    """The ``dtorch`` backend: capture the aten graph, propagate placements once per input layout, and run one
    local program per worker (one message per call). ``options``: see :class:`~torch_dtorch.backend.options.CompileOptions`."""
    from torch_dtorch.backend.compiler import compile_graph

    return compile_graph(gm, example_inputs, options=options, mode=mode, backend="dtorch", debug=False)


def dtorch_debug_backend(
    gm: fx.GraphModule,
    example_inputs: list[torch.Tensor],
    *,
    options: Mapping[str, Any] | None = None,
    mode: str | None = None,
) -> Any:
    """The ``dtorch_debug`` backend: like ``dtorch`` up to the local programs, which are written out (``options["file"]``,
    default stdout) and collected (``options["reports"]``) instead of shipped; the graph then runs eagerly."""
    from torch_dtorch.backend.compiler import compile_graph

    return compile_graph(gm, example_inputs, options=options, mode=mode, backend="dtorch_debug", debug=True)


register_dynamo_backend("dtorch", dtorch_backend)
register_dynamo_backend("dtorch_debug", dtorch_debug_backend)
# a compiled optimizer step makes Adam's ``step`` counters on the dtorch device, as dynamo does for CUDA
capturable_optimizers_on("dtorch")
