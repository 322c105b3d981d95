"""torch-dtorch: one Python process (the controller) drives N devices as one.

This release holds the foundation: device meshes, placements and their local-shape arithmetic, the LogicalGraph,
placement rules with per-axis matching, and the redistribute planner. Workers, the ``dtorch`` device and the
``torch.compile`` backend build on it.
"""

from __future__ import annotations

from torch.distributed.tensor import Partial, Placement, Replicate, Shard

from torch_dtorch.mesh import DeviceMesh

__version__ = "0.1.0"

__all__ = ["DeviceMesh", "Partial", "Placement", "Replicate", "Shard", "__version__"]
