"""A ``torch.library.custom_op`` made distributed with the public ``torch_dtorch.register_rule`` decorator (the
example of docs/adding_an_op.md): the rule's signatures keep the op sharded, the workers run its body on their
shards — on each device's kernel stream (its worker thread) — and the operator carries the rule's own cost."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

import torch_dtorch as dt
from tests.eager.conftest import TEST_DEVICE, init_mesh, thread_only
from torch_dtorch import Replicate, Shard
from torch_dtorch.errors import NoRuleError
from torch_dtorch.graph import OperatorCost
from torch_dtorch.placement_rules import OpCall, PlacementSignature, sig, unregister_rule
from torch_dtorch.tools import DevicePeaks, GraphRecorder, roofline

pytestmark = [
    pytest.mark.skipif(TEST_DEVICE != "cpu", reason="the op's body uses numpy (CPU tensors)"),
    # the op's body records which worker thread ran it; worker processes would also need
    # DTORCH_WORKER_IMPORTS=tests.eager.test_custom_op (tests/cluster/test_process_mode.py covers custom rules there)
    thread_only,
]

#: (thread name, input shape) of every run of the op's body
CALLS: list[tuple[str, tuple[int, ...]]] = []
_CALLS_LOCK = threading.Lock()


@torch.library.custom_op("dtorch_test::row_softsign", mutates_args=())
def row_softsign(x: torch.Tensor, scale: float) -> torch.Tensor:
    """``scale * x / (1 + |x|)`` row by row, through numpy: opaque to torch, so dtorch cannot decompose it."""
    with _CALLS_LOCK:
        CALLS.append((threading.current_thread().name, tuple(x.shape)))
    a = x.detach().cpu().numpy()
    return torch.from_numpy(scale * a / (1.0 + np.abs(a))).to(x.dtype)


@row_softsign.register_fake
def _(x: torch.Tensor, scale: float) -> torch.Tensor:
    return torch.empty_like(x)


OP = torch.ops.dtorch_test.row_softsign.default


def _rule(call: OpCall) -> list[PlacementSignature]:
    """Elementwise: every dim may stay sharded (a Partial input is reduced first: the op is not linear)."""
    x = call.inputs[0]
    assert x is not None
    return [sig([Shard(d)], Shard(d)) for d in range(x.ndim)]


def _cost(call: OpCall) -> OperatorCost:
    """3 FLOPs per element (abs, add, divide; the scale folds in), the input read and the output written once."""
    x = call.inputs[0]
    assert x is not None
    n = x.numel() * x.dtype.itemsize
    return OperatorCost(flops=3 * x.numel(), bytes_read=n, bytes_written=n)


def test_custom_op_with_a_rule_runs_sharded() -> None:
    mesh = init_mesh((3,))
    z = torch.randn(7, 5)
    # without a rule, torch runs the body on the dtorch tensor: its .cpu() gathers, the result is a plain tensor
    plain = row_softsign(dt.distribute_tensor(z, mesh, [Shard(0)]), 2.0)
    assert plain.device.type == "cpu"
    dt.register_rule(OP, family="custom")(_rule)
    try:
        for placements in ([Shard(0)], [Shard(1)], [Replicate()]):
            x = dt.distribute_tensor(z, mesh, placements)
            y = row_softsign(x, 2.0)
            assert y.placements == x.placements  # no redistribute: each worker ran the body on its shard
            torch.testing.assert_close(y.full_tensor(), row_softsign(z, 2.0))
    finally:
        unregister_rule(OP)
    # the removed rule is gone for good: no plan of it replays from the eager fast path
    with pytest.raises(NoRuleError):
        row_softsign(dt.distribute_tensor(z, mesh, [Shard(0)]), 2.0)


@thread_only
def test_custom_op_runs_on_the_worker_streams_with_its_own_cost() -> None:
    """The body runs once per device, on that device's kernel stream thread, on the device's shard; the recorded
    operator (and the roofline report built from it) carries the FLOPs and bytes of the rule's ``cost=``."""
    from torch_dtorch.device.state import get_session

    mesh = init_mesh((3,))
    z = torch.randn(7, 5)
    want = row_softsign(z, 2.0)
    dt.register_rule(OP, family="custom", cost=_cost)(_rule)
    try:
        x = dt.distribute_tensor(z, mesh, [Shard(0)])
        CALLS.clear()
        with GraphRecorder() as rec:
            y = row_softsign(x, 2.0)
            got = y.full_tensor()
        calls = list(CALLS)
    finally:
        unregister_rule(OP)
    torch.testing.assert_close(got, want)
    assert y.placements == (Shard(0),)

    # on the workers: one run per device, each on its own kernel stream's thread, never on the controller
    streams = get_session().executor.runner.streams
    names = {streams[d]._thread.name: d for d in mesh.devices}
    assert len(names) == 3 and all(name == f"dtorch-worker-{d}" for name, d in names.items())
    assert sorted(name for name, _ in calls) == sorted(names), calls
    assert threading.current_thread().name not in dict(calls)
    # on the shards: torch.chunk blocks of 7 rows over 3 devices (3, 3, 1)
    shapes = {names[name]: shape for name, shape in calls}
    assert [shapes[d] for d in mesh.devices] == [(3, 5), (3, 5), (1, 5)]

    # its own cost, global over the mesh, on the recorded operator and in the roofline report
    nodes = [node for node in rec.graph.operators if node.op is OP]
    assert len(nodes) == 1
    expected = OperatorCost(flops=3 * 35, bytes_read=35 * 4, bytes_written=35 * 4)
    assert nodes[0].cost == expected
    peaks = DevicePeaks("test", {"fp32": 1e9, "16bit": 4e9}, mem_bw=1e9, link_bw=1e8)
    (est,) = [o for o in roofline(rec.graph, peaks=peaks).ops if "row_softsign" in o.name]
    assert (est.flops, est.bytes, est.num_devices) == (105, 280, 3)
    assert est.time_s == pytest.approx(max(105 / 3 / 1e9, 280 / 3 / 1e9))
