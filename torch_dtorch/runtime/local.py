"""One rank's local kernel on a worker: :func:`~torch_dtorch.placement_rules.ranks.run_rank` (shared with the
simulator, so workers and the reference run exactly the same rule hooks), plus cached local-shape arithmetic."""

from __future__ import annotations

from torch_dtorch.placement import Placements
from torch_dtorch.placement_rules.families.context_parallel import kernel_needs_comm
from torch_dtorch.placement_rules.ranks import cached_local_shape_and_offset, run_rank

__all__ = ["kernel_needs_comm", "local_shape", "run_rank"]


def local_shape(
    shape: tuple[int, ...], mesh_shape: tuple[int, ...], placements: Placements, coord: tuple[int, ...]
) -> tuple[int, ...]:
    return cached_local_shape_and_offset(shape, mesh_shape, placements, coord)[0]
