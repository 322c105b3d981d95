"""A known wrong result on CUDA worker processes (found 2026-12-03, not fixed yet).

Independent chains of ops issued interleaved from one controller thread are wrong on a simulated 2-device CUDA
mesh in process mode (4 accumulators of ``acc = acc + m``, ``acc`` on ``Shard(0)``, ``m`` Replicate: 20 of 20
results off by 2–20 %). The same program is right in thread mode on CUDA and in process mode on the CPU. It is
wrong at ``b24009b`` too, with the Python fast path, and with CUDA IPC off. One chain at a time is right. See
docs/cluster.md "Known issues". The test is ``xfail(strict=True)``, so a fix shows up as a failure here.
"""

from __future__ import annotations

import pytest
import torch

import torch_dtorch as dt
from torch_dtorch import Replicate, Shard


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.xfail(
    strict=True, reason="known bug: interleaved chains on CUDA worker processes (docs/cluster.md)"
)
def test_interleaved_chains_on_cuda_worker_processes() -> None:
    mesh = dt.init_device_mesh("cuda", (2,), mode="process", simulate=True)
    try:
        shared = dt.distribute_tensor(torch.randn(8, 8, device="cpu"), mesh, [Shard(0)])
        mines = [
            dt.distribute_tensor(torch.full((8, 8), float(k), device="cpu"), mesh, [Replicate()])
            for k in (1, 2, 3, 4)
        ]
        accs = [shared * 0 for _ in mines]
        for _ in range(300):
            for j, m in enumerate(mines):
                accs[j] = accs[j] + m
        for j, a in enumerate(accs):
            torch.testing.assert_close(a.full_tensor().cpu(), torch.full((8, 8), 300.0 * (j + 1)))
    finally:
        dt.shutdown()
