"""Module parallelism on dtorch meshes: tensor-parallel layers, ``parallelize_module`` (upstream ParallelStyles
accepted), context-parallel attention selection and pipeline stages. See ``docs/module_parallel.md``."""

from __future__ import annotations

from torch_dtorch.nn.layers import (
    ColumnParallelLinear,
    ColumnParallelLinearReplicateOutput,
    Embedding,
    EmbeddingReplicateOutput,
    Linear,
    RowParallelLinear,
    RowParallelLinearReplicateInputOutput,
)
from torch_dtorch.nn.parallelize import init_empty_weights, parallelize_module, replicate_module
from torch_dtorch.nn.pipeline import (
    PipelineStages,
    assign_layers_to_stages,
    pipeline_forward,
    pipeline_parallel,
)
from torch_dtorch.nn.styles import (
    ColumnParallel,
    LayerStyle,
    PrepareInput,
    PrepareOutput,
    RowParallel,
    SequenceParallel,
    from_upstream,
)

__all__ = [
    "ColumnParallel",
    "ColumnParallelLinear",
    "ColumnParallelLinearReplicateOutput",
    "Embedding",
    "EmbeddingReplicateOutput",
    "LayerStyle",
    "PipelineStages",
    "Linear",
    "PrepareInput",
    "PrepareOutput",
    "RowParallel",
    "RowParallelLinear",
    "RowParallelLinearReplicateInputOutput",
    "SequenceParallel",
    "assign_layers_to_stages",
    "from_upstream",
    "init_empty_weights",
    "parallelize_module",
    "pipeline_forward",
    "pipeline_parallel",
    "replicate_module",
]
