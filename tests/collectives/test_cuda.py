"""CUDA: virtual ranks sharing one GPU through the in-memory group (each rank on its own stream), and NCCL process
groups built per thread-rank on distinct GPUs. Skipped without CUDA."""

from __future__ import annotations

import itertools

import pytest
import torch

from tests.collectives.test_torchdist import _data, _ops
from tests.collectives.util import run_ranks
from torch_dtorch.collectives import InMemoryComm, InMemoryWorld, execute_plan
from torch_dtorch.mesh import DeviceMesh
from torch_dtorch.placement import parse_placements
from torch_dtorch.placement_rules.ranks import distribute
from torch_dtorch.placement_rules.redistribute.planner import plan_redistribute
from torch_dtorch.placement_rules.redistribute.simulate import apply_plan

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

SLEEP_CYCLES = 20_000_000  # ~10 ms of GPU time: makes missing stream synchronization visible


def test_virtual_ranks_on_own_streams_are_ordered() -> None:
    """Inputs written late on each rank's stream, results read on it: the arrival / done events order them."""
    devices = (0, 1, 2, 3)
    world = InMemoryWorld(devices, timeout_s=60)
    group = world.group(devices)

    def body(d: int) -> list[torch.Tensor]:
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            out = []
            for i in range(5):
                x = torch.empty(1024, device="cuda")
                torch.cuda._sleep(SLEEP_CYCLES)
                x.fill_(float(d + i))
                y = group.handle(d).all_reduce(x, "sum")
                z = group.handle(d).all_gather(y[:2], 0)
                out.append(z.cpu())  # synchronizes with this stream only
            return out

    out = run_ranks(devices, body).check()
    for d in devices:
        for i, z in enumerate(out[d]):
            assert torch.equal(z, torch.full((8,), float(6 + 4 * i))), (d, i, z)


def test_execute_plan_on_cuda_virtual_ranks_matches_plan_sim() -> None:
    root = DeviceMesh.from_shape("cuda", (2, 2))
    cases = [("S(0)S(1)", "RR"), ("P(sum)S(0)", "S(1)P(max)"), ("S(0)S(0)", "S(1)R"), ("RP(avg)", "S(0)S(1)")]
    shape = (5, 3)
    x = torch.randint(-9, 9, shape).double()  # integer-valued: any reduction order is exact
    for src, dst in cases:
        plan = plan_redistribute(shape, root, parse_placements(src), dst_placements=parse_placements(dst))
        shards = distribute(x, root.shape, plan.src_placements)
        want = apply_plan(plan, shards)
        world = InMemoryWorld(root.devices, timeout_s=60)
        coords = dict(root.coordinates())

        def body(d: int, plan=plan, shards=shards, world=world, coords=coords) -> torch.Tensor | None:
            with torch.cuda.stream(torch.cuda.Stream()):
                t = shards[coords[d]].cuda()
                out = execute_plan(plan, t, device=d, comm=InMemoryComm(world, d))
                return None if out is None else out.cpu()

        out = run_ranks(root.devices, body).check()
        for d in root.devices:
            assert torch.equal(out[d], want[coords[d]]), (src, dst, d)


_PREFIX = itertools.count()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_nccl_group_equals_in_memory_group() -> None:
    import torch.distributed as dist

    from torch_dtorch.collectives import TorchDistGroup

    if not dist.is_nccl_available():
        pytest.skip("no NCCL")
    store = dist.HashStore()
    prefix = f"nccl{next(_PREFIX)}"
    devices = (0, 1)
    world = InMemoryWorld(devices, timeout_s=60)

    def body(d: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        torch.cuda.set_device(d)
        g = TorchDistGroup.create(dist.PrefixStore(prefix, store), devices, d, backend="nccl", timeout_s=60)
        gpu = [t.cpu() for t in _ops(g, *(t.cuda() for t in _data(d)))]
        g.backend.shutdown()
        return gpu, _ops(world.group(devices).handle(d), *_data(d))

    out = run_ranks(devices, body, join_timeout_s=120).check()
    for d in devices:
        nccl, mem = out[d]
        assert len(nccl) == len(mem)
        for i, (a, b) in enumerate(zip(nccl, mem)):
            assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), (d, i, a, b)


def test_host_staged_gloo_on_one_gpu_equals_in_memory_group() -> None:
    """Simulated CUDA ranks in process mode share one GPU, which NCCL refuses: Gloo staged through the host."""
    import torch.distributed as dist

    from torch_dtorch.collectives import TorchDistComm, TorchDistGroup

    store = dist.HashStore()
    prefix = f"staged{next(_PREFIX)}"
    devices = (0, 1)
    world = InMemoryWorld(devices, timeout_s=60)
    gpu = torch.device("cuda", 0)

    def body(d: int) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor | None]:
        g = TorchDistGroup.create(
            dist.PrefixStore(prefix, store), devices, d, backend="gloo", torch_device=gpu, timeout_s=60
        )
        got = _ops(g, *(t.to(gpu) for t in _data(d)))
        assert all(t.device == gpu for t in got), [t.device for t in got]
        comm = TorchDistComm(store, d, devices, backend="gloo", torch_device=gpu, prefix=prefix + "p2p")
        received = None
        if d == 0:
            comm.send(torch.arange(6.0, device=gpu).view(2, 3), 1).wait()
        else:
            received = comm.recv(0)
        return [t.cpu() for t in got], _ops(world.group(devices).handle(d), *_data(d)), received

    out = run_ranks(devices, body, join_timeout_s=120).check()
    for d in devices:
        staged, mem, _ = out[d]
        assert len(staged) == len(mem)
        for i, (a, b) in enumerate(zip(staged, mem)):
            assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), (d, i, a, b)
    received = out[1][2]
    assert received is not None and received.device == gpu
    assert torch.equal(received.cpu(), torch.arange(6.0).view(2, 3))
