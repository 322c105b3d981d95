"""Layer 2 pieces on their own: Blob, KernelError, KernelStream, PoisonBoard."""

from __future__ import annotations

import pickle
import threading
import time

import pytest
import torch

from torch_dtorch.runtime import Blob, KernelError, KernelIOError, KernelStream
from torch_dtorch.runtime.kernel import PoisonBoard


def test_blob_holds_a_tensor_or_an_error() -> None:
    b = Blob(torch.zeros(2, 3))
    assert b.ok and "float32[2, 3]" in repr(b)
    e = Blob(error=KernelError("aten.mm", 3, ValueError("bad")))
    assert not e.ok and "aten.mm" in repr(e)
    with pytest.raises(ValueError):
        Blob()
    with pytest.raises(ValueError):
        Blob(torch.zeros(1), error=KernelError("x", 0, "y"))


def test_kernel_error_message_copy_and_pickle() -> None:
    err = KernelIOError("aten.view", 1, "shape [12], expected [2, 6]", call_site="model.py:3 in forward")
    msg = str(err)
    assert "aten.view failed on worker 1" in msg and "model.py:3 in forward" in msg
    again = err.again("fetching %4")
    assert type(again) is KernelIOError and str(again).endswith("while fetching %4")
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is KernelIOError and str(back) == msg and back.device == 1


def test_kernel_stream_runs_in_order_and_closes() -> None:
    s = KernelStream("cpu", name="test-stream")
    seen: list[int] = []
    names: set[str] = set()
    for i in range(100):
        s.submit(lambda i=i: (seen.append(i), names.add(threading.current_thread().name)))
    assert s.wait_idle(5.0)
    assert seen == list(range(100)) and names == {"test-stream"}
    # a failing closure does not kill the thread
    s.submit(lambda: 1 / 0)
    s.submit(lambda: seen.append(-1))
    assert s.wait_idle(5.0) and seen[-1] == -1
    # close(discard=True) drops what is still queued
    s.submit(lambda: time.sleep(0.2))
    s.submit(lambda: seen.append(-2))
    assert s.close(discard=True, timeout=5.0)
    assert not s.alive and seen[-1] == -1
    assert s.stream("compute") is None  # no CUDA streams on the CPU
    with s.use("comm"):
        pass


def test_poison_board_capacity() -> None:
    board = PoisonBoard(capacity=3)
    errs = [KernelError("op", i, "x") for i in range(5)]
    for i, e in enumerate(errs):
        board.post(i, e)
    assert board.get(0) is None and board.get(4) is errs[4]
    board.post(4, errs[0])  # first post wins
    assert board.get(4) is errs[4]


def test_run_local_equals_run_rank() -> None:
    from torch_dtorch.executor.constructor import GraphConstructor
    from torch_dtorch.mesh import DeviceMesh
    from torch_dtorch.placement import Replicate, Shard
    from torch_dtorch.placement_rules.simulate import distribute, run_rank
    from torch_dtorch.runtime.local import run_local

    aten = torch.ops.aten
    mesh = DeviceMesh.from_shape("cpu", (3,))
    g = GraphConstructor(default_mesh=mesh)
    a, b = torch.randn(7, 4), torch.randn(7, 4)
    xa, xb = g.input(a.shape, mesh, [Shard(0)]), g.input(b.shape, mesh, [Shard(0)])
    w = g.input((4,), mesh, [Replicate()])
    g.call(aten.cat.default, [xa, xb], 1)  # a list of operands
    g.call(aten.view.default, xa, [7, 2, 2])  # a localized size
    g.call(aten.layer_norm.default, xa, [4], w, None)  # an absent optional tensor
    g.call(aten.sum.dim_IntList, xb, [1], True)
    g.call(aten.arange.default, 5, device_mesh=mesh, placements=[[Shard(0)]])
    shards = {
        xa.id: distribute(a, mesh.shape, xa.placements),
        xb.id: distribute(b, mesh.shape, xb.placements),
        w.id: distribute(torch.randn(4), mesh.shape, w.placements),
    }
    for node in g.graph.operators:
        bound = node.payload
        pl = [o.root_placements for o in node.outputs]
        for device, coord in mesh.coordinates():
            local = [shards[x.id][coord] if x is not None else None for x in node.inputs]
            want = run_rank(bound.rule, bound.call, coord, mesh.shape, local, pl, device=device)
            got = run_local(bound.rule, bound.call, coord, mesh.shape, local, pl, device=device)
            assert len(got) == len(want) and all(torch.equal(x, y) for x, y in zip(got, want)), node.name
