"""The ``dtorch`` device (PrivateUse1): kernels that feed the graph constructor from ordinary torch code."""

from __future__ import annotations

from torch_dtorch.device.methods import install_tensor_methods
from torch_dtorch.device.registration import ensure_registered

__all__ = ["ensure_registered", "install_tensor_methods", "setup"]


def setup() -> None:
    """Register the device and the tensor methods (idempotent; done on ``import torch_dtorch``)."""
    ensure_registered()
    install_tensor_methods()
