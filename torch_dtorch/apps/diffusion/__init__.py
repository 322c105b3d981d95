"""Diffusion inference application: unmodified diffusers FLUX and SD3 pipelines on a dtorch mesh.

``parallelize_pipeline(pipe, mesh, ExecuteConfig(...))`` (see ``docs/diffusion.md``) and the ``dtorch diffuse``
command line (:mod:`torch_dtorch.apps.diffusion.cli`). Heavy imports (diffusers, transformers) happen inside the
functions that need them.
"""

from __future__ import annotations

from torch_dtorch.apps.diffusion.config import ExecuteConfig
from torch_dtorch.apps.diffusion.parallelize import (
    MeshPlan,
    parallelize_pipeline,
    plan_mesh,
    transformer_tp_plan,
)
from torch_dtorch.apps.diffusion.tiny import TinySizes, tiny_pipeline

__all__ = [
    "ExecuteConfig",
    "MeshPlan",
    "TinySizes",
    "parallelize_pipeline",
    "plan_mesh",
    "tiny_pipeline",
    "transformer_tp_plan",
]
