"""``torch.compile`` backends for dtorch.

Registered through the ``torch_dynamo_backends`` entry-point group (see ``pyproject.toml``), so
``torch.compile(model, backend="dtorch")`` finds them after ``pip install`` without importing ``torch_dtorch``.

Both backends are placeholders until the compile front end lands: they raise ``NotImplementedError``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NoReturn

if TYPE_CHECKING:
    import torch
    from torch import fx

__all__ = ["dtorch_backend", "dtorch_debug_backend"]

_NOT_IMPLEMENTED = (
    "the dtorch torch.compile backend is not implemented yet (tracked in the compile-backend issue); "
    "use eager dtorch tensors meanwhile"
)


def dtorch_backend(gm: fx.GraphModule, example_inputs: list[torch.Tensor], **kwargs: Any) -> NoReturn:
    """The ``dtorch`` backend: propagate placements over the FX graph and run one local program per worker."""
    raise NotImplementedError(_NOT_IMPLEMENTED)


def dtorch_debug_backend(gm: fx.GraphModule, example_inputs: list[torch.Tensor], **kwargs: Any) -> NoReturn:
    """The ``dtorch_debug`` backend: like ``dtorch``, with per-kernel validation and graph dumps."""
    raise NotImplementedError(f"{_NOT_IMPLEMENTED} (backend 'dtorch_debug')")
