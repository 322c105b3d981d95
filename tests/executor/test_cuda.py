"""CUDA thread mode: virtual ranks on one GPU (simulate=True), each with its own compute and comm streams."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from tests.executor.programs import Feeding, mlp, mlp_torch
from torch_dtorch.apps.demo import build_block, reference
from torch_dtorch.executor.constructor import GraphConstructor
from torch_dtorch.executor.eager import EagerGraphExecutor
from torch_dtorch.executor.thread_runner import ThreadRunner
from torch_dtorch.mesh import DeviceMesh
from torch_dtorch.placement import Partial, Replicate, Shard

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
aten = torch.ops.aten


@pytest.fixture
def cuda_executor() -> Iterator[tuple[EagerGraphExecutor, DeviceMesh]]:
    mesh = DeviceMesh.from_shape("cuda", (2, 2), mesh_dim_names=("dp", "tp"))
    ex = EagerGraphExecutor(ThreadRunner(mesh.devices, device_type="cuda", simulate=True, validate=True))
    yield ex, mesh
    ex.shutdown()


def test_streams_per_virtual_rank(cuda_executor: tuple[EagerGraphExecutor, DeviceMesh]) -> None:
    ex, _ = cuda_executor
    streams = ex.runner.streams.values()
    ids = {s.stream(k).cuda_stream for s in streams for k in ("compute", "comm")}
    assert len(ids) == 2 * len(streams)
    assert all(s.torch_device == torch.device("cuda", 0) for s in streams)


def test_block_on_virtual_gpus(cuda_executor: tuple[EagerGraphExecutor, DeviceMesh]) -> None:
    ex, mesh = cuda_executor
    dims = {"batch": 4, "seq": 64, "dim": 128, "heads": 4}
    shapes, _ = build_block(GraphConstructor(default_mesh=mesh), mesh, **dims)
    torch.manual_seed(0)
    values = {n: torch.randn(o.shape) * (1.0 if n == "x" else 0.05) for n, o in shapes.items()}
    for _ in range(3):
        ins, y = build_block(Feeding(ex, values), mesh, **dims)  # type: ignore[arg-type]
        out = ex.redistribute(y, [Replicate(), Replicate()])
        got = ex.fetch(out).get(timeout=60)
        assert got.device.type == "cpu"
        torch.testing.assert_close(got, reference(values, **dims), atol=2e-3, rtol=2e-3)


def test_mlp_and_transitions_on_virtual_gpus(cuda_executor: tuple[EagerGraphExecutor, DeviceMesh]) -> None:
    ex, mesh = cuda_executor
    torch.manual_seed(0)
    shapes, _ = mlp(GraphConstructor(default_mesh=mesh), mesh, hidden=1000)
    values = {n: torch.randn(o.shape) * 0.3 for n, o in shapes.items()}
    _, outs = mlp(Feeding(ex, values), mesh, hidden=1000)
    for got, want in zip([ex.fetch(o) for o in outs], mlp_torch(values)):
        torch.testing.assert_close(got.get(timeout=60), want, atol=1e-3, rtol=1e-3)
    value = torch.randn(301, 257)
    layouts = [(Shard(0), Shard(1)), (Replicate(), Shard(0)), (Partial(), Shard(1)), (Shard(1), Replicate())]
    for src in layouts:
        x = ex.input(value.shape, mesh, src)
        ex.upload(x, value)
        for dst in layouts:
            if isinstance(dst[0], Partial):
                continue
            y = ex.call(aten.mul.Tensor, ex.redistribute(x, dst), ex.redistribute(x, dst))
            torch.testing.assert_close(ex.fetch(y).get(timeout=60), value * value)


def test_one_virtual_gpu_is_bit_identical() -> None:
    mesh = DeviceMesh.from_shape("cuda", (1,))
    ex = EagerGraphExecutor(ThreadRunner(mesh.devices, device_type="cuda"))
    try:
        a, b = torch.randn(64, 128), torch.randn(128, 32)
        xa, xb = ex.input(a.shape, mesh, [Replicate()]), ex.input(b.shape, mesh, [Replicate()])
        ex.upload(xa, a)
        ex.upload(xb, b)
        y = ex.call(aten.gelu.default, ex.call(aten.mm.default, xa, xb))
        want = torch.nn.functional.gelu(a.cuda() @ b.cuda()).cpu()
        assert torch.equal(ex.fetch(y).get(timeout=60), want)
    finally:
        ex.shutdown()


def test_factories_on_virtual_gpus(cuda_executor: tuple[EagerGraphExecutor, DeviceMesh]) -> None:
    ex, mesh = cuda_executor
    r = ex.call(aten.arange.default, 7, device_mesh=mesh, placements=[[Shard(0), Replicate()]])
    ex.sync()
    blob = ex.runner.workers[1].blobs[r.id]
    assert blob.tensor is not None and blob.tensor.device == torch.device("cuda", 0)
    assert torch.equal(ex.fetch(r).get(timeout=60), torch.arange(7))


def test_manual_seed_before_cuda_is_initialized() -> None:
    """``torch.manual_seed`` reaches dtorch's generator hooks; in a fresh process with a CUDA mesh in process mode
    the controller has not initialized CUDA yet (its generators did not exist: IndexError)."""
    import subprocess
    import sys

    code = (
        "import torch, torch_dtorch as dt\n"
        "mesh = dt.init_device_mesh('cuda', (2,), simulate=True, mode='process')\n"
        "torch.manual_seed(0)\n"
        "a = dt.randn(4, 4, device_mesh=mesh, placements=[dt.Shard(0)])\n"
        "torch.manual_seed(0)\n"
        "b = torch.randn(4, 4, device='cuda')\n"
        "assert torch.equal(a.full_tensor().cuda(), b), (a.full_tensor(), b)\n"
        "dt.shutdown()\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
