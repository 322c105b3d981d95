"""The memory pre-check on CUDA meshes (issue 18 a): thread mode reads ``torch.cuda.mem_get_info`` in the
controller; process mode uses what each worker process reports (when ready and with every value it sends)."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard

import torch_dtorch as dt
from torch_dtorch.errors import DeviceMemoryError

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.parametrize("mode", ["thread", "process"])
def test_cuda_allocation_larger_than_the_gpu_is_refused(mode: str) -> None:
    try:
        mesh = dt.init_device_mesh("cuda", (2,), simulate=True, mode=mode)
        x = dt.distribute_tensor(torch.arange(8.0), mesh, [Shard(0)])
        torch.testing.assert_close((x + 1).full_tensor().cpu(), torch.arange(8.0) + 1)  # a report arrived
        free, total = torch.cuda.mem_get_info(0)
        guard = dt.device.state.get_session().executor.constructor.memory
        assert guard is not None and [p.name for p in guard.pools][0].startswith("cuda:0")
        rows = total // (4 * 1024) + 1  # one replica alone is larger than the whole GPU
        with pytest.raises(torch.cuda.OutOfMemoryError) as e:
            dt.ones(rows, 1024, device_mesh=mesh, placements=[Replicate()])
        assert isinstance(e.value, DeviceMemoryError) and "cuda:0" in str(e.value)
        assert f"float32[{rows}, 1024] R" in str(e.value) and e.value.free_bytes > 0
        # a quarter of the free memory, sharded over the two virtual ranks: fits, and runs
        ok_rows = max(1, free // (4 * 1024) // 4)
        y = dt.zeros(ok_rows, 1024, device_mesh=mesh, placements=[Shard(0)])
        assert float(y.sum().full_tensor()) == 0.0
        del y
        torch.testing.assert_close((x * 2).full_tensor().cpu(), torch.arange(8.0) * 2)
    finally:
        dt.shutdown()
