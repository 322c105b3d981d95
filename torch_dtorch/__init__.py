"""torch-dtorch: one Python process (the controller) drives N devices as one.

Example::

    mesh = dt.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    x = dt.distribute_tensor(torch.randn(8, 16), mesh, [Shard(0), Replicate()])
    y = torch.relu(x @ w)  # returns at once; the workers run it
    y.full_tensor()  # blocks, returns a torch.Tensor
"""

from __future__ import annotations

from torch.distributed.tensor import Partial, Placement, Replicate, Shard

from torch_dtorch import device as _device
from torch_dtorch import nn, tools  # noqa: E402 - module parallelism (layers, parallelize_module, pipeline)
from torch_dtorch._compat import hide_from_dynamo as _hide_from_dynamo
from torch_dtorch.api import (
    distribute_tensor,
    empty,
    from_local,
    full,
    init_device_mesh,
    ones,
    rand,
    randn,
    redistribute,
    redistribute_by_dict,
    shutdown,
    sync,
    to_torch,
    to_torch_async,
    zeros,
)
from torch_dtorch.device.autograd import match_grad_placements
from torch_dtorch.device.registration import register_rule
from torch_dtorch.executor.future import TensorFuture
from torch_dtorch.mesh import DeviceMesh
from torch_dtorch.nn import (
    checkpoint,  # sharded checkpoints: dt.checkpoint.save / load
    parallelize_module,
)
from torch_dtorch.nn.fsdp import fully_shard
from torch_dtorch.tools import TensorChecker, profile

__version__ = "0.1.0"

__all__ = [
    "DeviceMesh",
    "Partial",
    "Placement",
    "Replicate",
    "Shard",
    "TensorChecker",
    "TensorFuture",
    "checkpoint",
    "__version__",
    "distribute_tensor",
    "empty",
    "from_local",
    "full",
    "fully_shard",
    "init_device_mesh",
    "match_grad_placements",
    "nn",
    "ones",
    "parallelize_module",
    "profile",
    "rand",
    "randn",
    "redistribute",
    "redistribute_by_dict",
    "register_rule",
    "shutdown",
    "sync",
    "to_torch",
    "to_torch_async",
    "tools",
    "zeros",
]

_device.setup()

# dtorch's own code (dispatch kernels, executor, ...) runs untraced where dynamo's frame hook meets it (graph breaks)
_hide_from_dynamo()
