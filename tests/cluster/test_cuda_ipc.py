"""CUDA IPC between the controller and its local worker processes (``cluster/ipc.py``).

On the CPU: the route decision (CPU tensors never take CUDA IPC, ``DTORCH_CUDA_IPC=0`` disables it, remote workers
never get it), the checks of received handle fields, the wire round trip of a handle (no pickle) and the holding
rule of :class:`IpcOutbox`. On a GPU (``-m gpu``): uploads and fetches of CUDA tensors in process mode on a
simulated 2-device CUDA mesh go through CUDA IPC, the fallback when it is off, and a worker that dies before
copying an upload leaves no GPU memory held.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

import torch_dtorch as dt
from torch_dtorch import Replicate, Shard
from torch_dtorch.cluster import ipc as cluster_ipc
from torch_dtorch.cluster.heartbeat import WorkerLostError
from torch_dtorch.cluster.ipc import (
    CudaIpcError,
    IpcAck,
    IpcOutbox,
    ack_body,
    parse_ack,
    parse_fields,
)
from torch_dtorch.cluster.joins import Member
from torch_dtorch.cluster.protocol import ClusterConfig
from torch_dtorch.cluster.runner import ClusterRunner
from torch_dtorch.cluster.startup import member_welcome
from torch_dtorch.cluster.store import Route, choose_route, tensor_route
from torch_dtorch.cluster.transport import MessageKind
from torch_dtorch.cluster.transport.wire import decode, encode
from torch_dtorch.device.state import get_session

MiB = 1 << 20


def route(device_type: str, *, same_host: bool = True, cuda_ipc: bool = True, shm: bool = True) -> Route:
    return choose_route(
        device_type=device_type,
        nbytes=4 * MiB,
        same_host=same_host,
        threshold=MiB,
        shm=shm,
        cuda_ipc=cuda_ipc,
    )


# --- the decision ------------------------------------------------------------------------------------------------
def test_only_large_cuda_tensors_to_local_peers_take_cuda_ipc() -> None:
    assert route("cuda") is Route.CUDA_IPC
    assert route("cpu") is Route.SHM  # CPU tensors never take CUDA IPC
    assert route("cpu", shm=False) is Route.FRAMES
    assert route("cuda", cuda_ipc=False) is Route.SHM  # DTORCH_CUDA_IPC=0, or off after a failure
    assert route("cuda", cuda_ipc=False, shm=False) is Route.FRAMES
    assert route("cuda", same_host=False) is Route.FRAMES  # remote workers: always frames
    small = choose_route(
        device_type="cuda", nbytes=MiB - 1, same_host=True, threshold=MiB, shm=True, cuda_ipc=True
    )
    assert small is Route.FRAMES
    off = choose_route(
        device_type="cuda", nbytes=4 * MiB, same_host=True, threshold=0, shm=True, cuda_ipc=True
    )
    assert off is Route.FRAMES  # threshold <= 0: never shared memory
    big_cpu = torch.zeros(MiB)  # 4 MiB
    assert tensor_route(big_cpu, same_host=True, threshold=MiB, shm=True, cuda_ipc=True) is Route.SHM
    assert (
        tensor_route(ValueError("x"), same_host=True, threshold=MiB, shm=True, cuda_ipc=True) is Route.FRAMES
    )


def test_env_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DTORCH_CUDA_IPC", raising=False)
    assert ClusterConfig.from_env().cuda_ipc is True
    for off in ("0", "false", "off", "no"):
        monkeypatch.setenv("DTORCH_CUDA_IPC", off)
        assert ClusterConfig.from_env().cuda_ipc is False
    monkeypatch.setenv("DTORCH_CUDA_IPC", "maybe")
    with pytest.raises(ValueError, match="DTORCH_CUDA_IPC"):
        ClusterConfig.from_env()


def test_welcome_offers_cuda_ipc_to_local_workers_only() -> None:
    local, remote = Member(0), Member(1)
    local.proc = object()  # type: ignore[assignment]  # started by this controller
    base = {"session": 1}
    assert member_welcome(base, local, shm=None, threshold=MiB, cuda_ipc=True) == {
        "session": 1,
        "cuda_ipc": True,
        "cuda_ipc_threshold": MiB,
    }
    assert member_welcome(base, remote, shm=None, threshold=MiB, cuda_ipc=True) == base
    assert "cuda_ipc" not in member_welcome(base, local, shm=None, threshold=MiB, cuda_ipc=False)


# --- the handle's fields -----------------------------------------------------------------------------------------
def fields(**over: object) -> dict[str, object]:
    f: dict[str, object] = {
        "v": 1,
        "device": 0,
        "handle": b"\x01" * 64,
        "size": 4096,
        "offset": 512,
        "ref": b"/torch_123_456",
        "ref_offset": 7,
        "event": b"\x02\x00" * 32,  # binary handles hold NUL bytes
        "event_sync": True,
        "dtype": "float32",
        "shape": [32, 32],
    }
    f.update(over)
    return f


def test_handle_fields_travel_signed_without_pickle() -> None:
    secret = os.urandom(32)
    body = {"key": [3, 1], "cuda_ipc": fields()}
    msg = decode(encode(body, kind=MessageKind.VALUE, seq=1, sender="w1", secret=secret), secret=secret)
    h = parse_fields(msg.body["cuda_ipc"])
    assert h.dtype is torch.float32 and h.shape == (32, 32) and h.handle == b"\x01" * 64 and h.ref_offset == 7


@pytest.mark.parametrize(
    "bad",
    [
        {"v": 2},
        {"ref": b"/etc_passwd"},  # only torch's reference-counter files
        {"ref": b"/torch_1/../x"},
        {"shape": [64, 64]},  # does not fit the shared storage
        {"dtype": "object"},
        {"device": True},  # a bool is not a device index
        {"offset": -1},
        {"handle": b""},
        {"event_sync": 1},
    ],
)
def test_bad_handle_fields_are_refused(bad: dict[str, object]) -> None:
    with pytest.raises(CudaIpcError):
        parse_fields(fields(**bad))


def test_acknowledgement_round_trip() -> None:
    assert parse_ack(ack_body((4, 1))) == IpcAck((4, 1), ok=True, opened=True, error="")
    failed = parse_ack(ack_body((4, 1), error=CudaIpcError("no", opened=False)))
    assert failed == IpcAck((4, 1), ok=False, opened=False, error="no")
    with pytest.raises(dt.errors.DTorchError):
        parse_ack({"ipc_done": [4, 1], "ok": "yes"})


def test_outbox_holds_until_acknowledged_and_drops_on_failure(monkeypatch: pytest.MonkeyPatch) -> None:
    released: list[int] = []
    monkeypatch.setattr(cluster_ipc, "ipc_fields", lambda t: {"ref": b"/torch_1_2", "ref_offset": t.numel()})
    monkeypatch.setattr(cluster_ipc, "_release_counter", lambda f: released.append(f["ref_offset"]))
    box = IpcOutbox()
    src = torch.arange(3.0)
    body = box.share((1, 0), src)
    assert body == {"key": [1, 0], "cuda_ipc": {"ref": b"/torch_1_2", "ref_offset": 3}}
    src.add_(1)  # the producer's own copy is shared: later writes to the source do not reach the consumer
    with pytest.raises(dt.errors.DTorchError):
        box.share((1, 0), src)  # one transfer per key until acknowledged
    box.share((2, 0), torch.zeros(5))
    held = box.release(IpcAck((1, 0), ok=True, opened=True, error=""))
    assert held is not None and torch.equal(held, torch.arange(3.0)) and len(box) == 1 and released == []
    assert box.release(IpcAck((1, 0), ok=True, opened=True, error="")) is None  # a duplicate is harmless
    box.share((3, 0), torch.zeros(7))
    # a consumer that could not open the handle never took torch's reference counter: the producer releases it
    assert box.release(IpcAck((3, 0), ok=False, opened=False, error="no")) is not None and released == [7]
    assert box.drop(consumers_gone=True) == 1 and released == [7, 5] and len(box) == 0


# --- on a GPU ----------------------------------------------------------------------------------------------------
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def cuda_mesh(**config: object) -> tuple[dt.DeviceMesh, ClusterRunner]:
    cfg = ClusterConfig(shm_threshold=64 << 10, **config)  # type: ignore[arg-type]
    mesh = dt.init_device_mesh("cuda", (2,), mode="process", simulate=True, cluster=cfg)
    runner = get_session().executor.runner
    assert isinstance(runner, ClusterRunner)
    return mesh, runner


def wait_released(runner: ClusterRunner, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while len(runner._ipc) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(runner._ipc) == 0, runner._ipc


@pytest.mark.gpu
@pytest.mark.slow
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_upload_and_fetch_go_through_cuda_ipc(dtype: torch.dtype) -> None:
    mesh, runner = cuda_mesh()
    try:
        x = torch.randn(512, 1024, device="cuda").to(dtype)  # shards of 1 MiB (bf16: 512 KiB)
        d = dt.distribute_tensor(x, mesh, [Shard(0)])
        assert runner.cuda_ipc_counts["sent"] == 2
        wait_released(runner)  # both workers copied their shard and acknowledged it
        y = d.full_tensor()
        assert y.is_cuda and y.dtype == dtype and torch.equal(y, x)
        assert runner.cuda_ipc_counts["received"] == 2
        z = (d * 2).redistribute(mesh, [Replicate()]).full_tensor()  # one replica travels back
        assert torch.equal(z, x * 2)
        assert runner.cuda_ipc_counts["received"] == 3
        assert torch.equal(d.to_local(1).to("cuda"), x[256:])
        assert runner.cuda_ipc_counts["fallback"] == 0
        small = torch.ones(4, device="cuda")  # below the threshold: frames
        assert torch.equal(dt.distribute_tensor(small, mesh, [Replicate()]).full_tensor(), small)
        cpu = torch.randn(512, 1024)  # a CPU tensor: shared memory
        assert torch.equal(dt.distribute_tensor(cpu, mesh, [Shard(1)]).full_tensor().cpu(), cpu)
        assert runner.cuda_ipc_counts["sent"] == 2
    finally:
        dt.shutdown()


@pytest.mark.gpu
@pytest.mark.slow
@needs_cuda
def test_cuda_ipc_off_goes_through_host_memory() -> None:
    mesh, runner = cuda_mesh(cuda_ipc=False)  # as DTORCH_CUDA_IPC=0
    try:
        x = torch.randn(512, 1024, device="cuda")
        y = dt.distribute_tensor(x, mesh, [Shard(0)]).full_tensor()
        assert y.is_cuda and torch.equal(y, x) and sum(runner.cuda_ipc_counts.values()) == 0
    finally:
        dt.shutdown()


@pytest.mark.gpu
@pytest.mark.slow
@needs_cuda
def test_worker_lost_before_copying_leaves_no_gpu_memory_held() -> None:
    mesh, runner = cuda_mesh()
    pids = [m.proc.pid for m in runner.members.values() if m.proc is not None]
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    try:
        os.kill(pids[1], signal.SIGSTOP)  # w1 copies nothing from now on
        x = torch.randn(1024, 1024, device="cuda")  # 4 MiB
        d = dt.distribute_tensor(x, mesh, [Replicate()])
        assert runner.cuda_ipc_counts["sent"] == 2
        time.sleep(0.3)
        assert len(runner._ipc) == 1  # w0 acknowledged its copy; w1's is held for it
        os.kill(pids[1], signal.SIGKILL)
        deadline = time.monotonic() + 5
        while runner.failure is None and time.monotonic() < deadline:
            time.sleep(0.01)
        with pytest.raises(WorkerLostError):
            d.full_tensor()
    finally:
        try:
            os.kill(pids[1], signal.SIGKILL)
        except ProcessLookupError:
            pass
        dt.shutdown()
    assert len(runner._ipc) == 0  # dropped by the failure handling
    del d, x
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() <= before  # nothing left behind in torch's CUDA IPC limbo


@pytest.mark.gpu
@pytest.mark.slow
@needs_cuda
def test_a_handle_that_cannot_be_opened_is_resent_through_host_memory(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from torch_dtorch.cluster import runner as cluster_runner

    def fail(raw: object, **kw: object) -> torch.Tensor:
        raise CudaIpcError("planted: cannot open", opened=False)

    mesh, runner = cuda_mesh()
    try:
        x = torch.randn(512, 1024, device="cuda")
        d = dt.distribute_tensor(x, mesh, [Shard(0)])
        wait_released(runner)
        monkeypatch.setattr(cluster_runner, "open_copy", fail)  # the controller cannot open fetched values
        assert torch.equal(d.full_tensor(), x)  # both workers resent their shard through host memory
        assert runner.cuda_ipc_counts["fallback"] == 2 and runner.cuda_ipc_counts["received"] == 0
        assert not any(m.cuda_ipc for m in runner.members.values())  # off for those workers from now on
        y = dt.distribute_tensor(x, mesh, [Shard(1)])
        assert runner.cuda_ipc_counts["sent"] == 2 and torch.equal(y.full_tensor(), x)
    finally:
        dt.shutdown()
