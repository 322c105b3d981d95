"""One rank's local kernel on a worker: :func:`~torch_dtorch.placement_rules.simulate.run_rank` (shared with the
simulator, so workers and the reference run exactly the same rule hooks), plus cached local-shape arithmetic."""

from __future__ import annotations

from torch_dtorch.placement import Placements
from torch_dtorch.placement_rules.context_parallel import kernel_needs_comm
from torch_dtorch.placement_rules.simulate import cached_local_shape_and_offset
from torch_dtorch.placement_rules.simulate import run_rank as run_local

__all__ = ["kernel_needs_comm", "local_shape", "run_local"]


def local_shape(
    shape: tuple[int, ...], mesh_shape: tuple[int, ...], placements: Placements, coord: tuple[int, ...]
) -> tuple[int, ...]:
    return cached_local_shape_and_offset(shape, mesh_shape, placements, coord)[0]
