"""Stream ordering on CUDA workers (issue 17), on a real GPU: thread and process mode.

The first test is the reproduction found on 2026-12-03: four accumulators ``acc[j] = acc[j] + m[j]`` (``Shard(0)`` +
``Replicate``) updated in turn on a simulated 2-device CUDA mesh came out 2–20 % too large on worker processes. The
cause: a redistribute output (the ``R -> S(0)`` slice of ``m``, allocated on the comm stream) was read on the compute
stream without ``record_stream`` and freed right after the add was launched, so the next slice on the comm stream
reused its memory while the add still read it. The randomized test runs thousands of interleaved ops (chains,
frees, redistributes, fetches, matmuls) against torch. The same rules are checked on the CPU with fake streams in
tests/unit/test_stream_rules.py.
"""

from __future__ import annotations

import pytest
import torch

import torch_dtorch as dt
from tests.cluster.stream_stress import run_interleaved_program
from torch_dtorch import Replicate, Shard

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.fixture(params=["process", "thread"])
def cuda_mesh(request: pytest.FixtureRequest):  # type: ignore[no-untyped-def]
    mesh = dt.init_device_mesh("cuda", (2,), mode=request.param, simulate=True)
    try:
        yield mesh
    finally:
        dt.shutdown()


def test_interleaved_accumulators(cuda_mesh: dt.DeviceMesh) -> None:
    shared = dt.distribute_tensor(torch.randn(8, 8, device="cpu"), cuda_mesh, [Shard(0)])
    mines = [
        dt.distribute_tensor(torch.full((8, 8), float(k), device="cpu"), cuda_mesh, [Replicate()])
        for k in (1, 2, 3, 4)
    ]
    accs = [shared * 0 for _ in mines]
    for _ in range(300):
        for j, m in enumerate(mines):
            accs[j] = accs[j] + m
    for j, a in enumerate(accs):
        torch.testing.assert_close(a.full_tensor().cpu(), torch.full((8, 8), 300.0 * (j + 1)))


@pytest.mark.parametrize("seed", [0, 1])
def test_randomized_interleaved_program(cuda_mesh: dt.DeviceMesh, seed: int) -> None:
    result = run_interleaved_program(cuda_mesh, seed=seed, steps=3000, rows=256, cols=192)
    assert result.fetches > 100 and result.redistributes > 100


def test_cuda_upload_from_the_controller_stream() -> None:
    """A CUDA tensor written on the controller's stream is complete before a worker's compute stream reads it."""
    mesh = dt.init_device_mesh("cuda", (2,), mode="thread", simulate=True)
    try:
        side = torch.cuda.Stream()
        for k in range(20):
            with torch.cuda.stream(side):
                big = torch.full((2048, 2048), float(k), device="cuda")
                big = big * 2 + 1  # still running on ``side`` when the upload is made
                x = dt.distribute_tensor(big, mesh, [Shard(0)])
            lo, hi = x.min().full_tensor().item(), x.max().full_tensor().item()
            assert lo == hi == 2.0 * k + 1, (k, lo, hi)
    finally:
        dt.shutdown()


def test_thread_mode_collectives_are_stream_ordered_on_one_gpu() -> None:
    """Every rank of a simulated thread-mode mesh lives on cuda:0, so the in-memory collectives are ordered by events
    on the workers' streams and no redistribute synchronizes the host; the values stay right (the tests above)."""
    from torch_dtorch.device.state import get_session

    mesh = dt.init_device_mesh("cuda", (2,), mode="thread", simulate=True)
    try:
        runner = get_session().executor.runner
        assert all(w.op_runner.host_sync_collectives is False for w in runner.workers.values())
        a = torch.randn(64, 32)
        y = dt.distribute_tensor(a, mesh, [Shard(0)]).redistribute(mesh, [Replicate()]) * 2
        torch.testing.assert_close(y.full_tensor().cpu(), a * 2)
    finally:
        dt.shutdown()


def test_a_one_element_upload_does_not_drain_the_stream() -> None:
    """A per-step 0-d scalar (a scheduler's sigma) uploaded to a busy worker: a blocking copy from pageable memory
    would synchronize the compute stream first (the GPU drains, the worker waits); KernelStream.upload writes it with
    a fill kernel that queues behind the work. The values are exact for every dtype (NaN sign included)."""
    import time

    from torch_dtorch.runtime.stream import COMPUTE, KernelStream

    ks = KernelStream(torch.device("cuda", 0), name="test-upload")
    with ks.use(COMPUTE):
        torch.cuda._sleep(2_000_000_000)  # ~1 s of GPU time queued on the compute stream
    t0 = time.perf_counter()
    got = ks.upload(torch.tensor(0.25), COMPUTE)
    took = time.perf_counter() - t0
    assert took < 0.2, f"the upload waited {took:.2f} s for the stream"
    ks.synchronize()
    assert got.item() == 0.25 and got.device.type == "cuda"
    for v in (
        torch.tensor(3, dtype=torch.int64),
        torch.tensor(True),
        torch.tensor(-float("nan")),
        torch.tensor(1.5 - 2j),
        torch.tensor([7.0], dtype=torch.bfloat16),
        torch.tensor(2**53 + 1, dtype=torch.int64),
    ):
        with ks.use(COMPUTE):
            u = ks.upload(v, COMPUTE)
        ks.synchronize()
        assert u.dtype == v.dtype and u.shape == v.shape
        bits = (lambda t: t.reshape(-1).view(torch.uint8)) if v.is_floating_point() else (lambda t: t)
        assert torch.equal(bits(u.cpu()), bits(v)), (v, u)
