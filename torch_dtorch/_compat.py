"""Every private torch API torch-dtorch uses, in one place (supported: torch 2.11 – 2.13).

If a torch release moves one of these, this module is the only one to change.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

__all__ = [
    "TORCH_VERSION",
    "create_empty_tensor",
    "has_kernel_for_dispatch_key",
    "setup_privateuse1_python_backend",
]

TORCH_VERSION: tuple[int, int] = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])  # type: ignore[assignment]


def has_kernel_for_dispatch_key(op: Any, key: str) -> bool:
    """Whether ``op`` (an OpOverload) has a kernel registered for dispatch key ``key``."""
    return bool(torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), key))


def create_empty_tensor(size: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """A storage-less tensor on the PrivateUse1 device (costs ~100 bytes whatever its shape)."""
    return torch._C._acc.create_empty_tensor(tuple(size), dtype)


def setup_privateuse1_python_backend(name: str) -> None:
    """Rename PrivateUse1 and register the dummy hooks/guard a Python backend needs."""
    from torch.utils.backend_registration import _setup_privateuseone_for_python_backend

    _setup_privateuseone_for_python_backend(name)


# --- torch.compile front end (torch_dtorch.backend) -----------------------------------------------------------------


def aot_module_simplified(gm: Any, example_inputs: Sequence[Any], **kwargs: Any) -> Any:
    """``torch._functorch.aot_autograd.aot_module_simplified`` (the functionalizing aten tracer dynamo backends use)."""
    from torch._functorch.aot_autograd import aot_module_simplified as aot

    return aot(gm, example_inputs, **kwargs)


def is_fake_tensor(t: object) -> bool:
    """Whether ``t`` is a FakeTensor (what dynamo hands a backend as example inputs)."""
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor)


def core_decompositions(ops: Sequence[Any]) -> dict[Any, Any]:
    """``torch._decomp.get_decompositions`` restricted to ``ops`` (never the whole Core ATen table)."""
    from torch._decomp import get_decompositions

    return dict(get_decompositions(list(ops)))


def inductor_compile(gm: Any, example_inputs: Sequence[Any], *, mode: str | None = None) -> Any:
    """Compile an aten-level FX graph with inductor; returns a callable taking the inputs positionally."""
    from torch._inductor.compile_fx import compile_fx

    config_patches: dict[str, Any] = {}
    if mode == "reduce-overhead":
        config_patches["triton.cudagraphs"] = True
    compiled = compile_fx(gm, list(example_inputs), config_patches=config_patches or None)
    return compiled
