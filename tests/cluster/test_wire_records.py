"""Process wire v3 (``cluster/codec/hits.py``, ``cluster/outbox.py``): every fast-path hit but moves and in-place
writes travels as a binary record — views, list arguments (``cat``, ``stack``), absent tensor slots, repeated
operands, the Python fast path's hits (0-d CPU scalars), factories, several outputs — and each record decodes to
the call torch makes: values equal plain torch on two meshes, every placement, uneven shards. Errors stay sticky
per operand through records; held work never hangs a sync, a fetch, a failure or a script without shutdown."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

import torch_dtorch as dt
from torch_dtorch import Replicate, Shard
from torch_dtorch.cluster.outbox import Outbox
from torch_dtorch.cluster.runner import ClusterRunner
from torch_dtorch.device.state import get_session
from torch_dtorch.executor.instructions import Barrier, FastRun, Fetch, Free

Case = Callable[[torch.Tensor, torch.Tensor], Any]

#: ops whose hits must all be records (no moves on these placements: Shard(0) on dim 0, or Replicate)
CASES: dict[str, Case] = {
    "unsqueeze.squeeze": lambda x, y: x.unsqueeze(0).squeeze(0) * 2,
    "permute": lambda x, y: x.permute(1, 0) + 1,
    "transpose": lambda x, y: x.transpose(0, 1).sum(0),
    "slice": lambda x, y: x[:, 1:4] * 3,
    "select": lambda x, y: x[:, 2] - 1,
    "chunk": lambda x, y: torch.chunk(x, 2, dim=1)[1] * 2,
    "unbind": lambda x, y: sum(t * (i + 1) for i, t in enumerate(x.unbind(1))),
    "expand": lambda x, y: x.unsqueeze(1).expand(-1, 3, -1) + 0.5,
    "flatten.unflatten": lambda x, y: x.unflatten(1, (1, 7)).flatten(1) * 2,
    "cat": lambda x, y: torch.cat([x, y, x * 2], dim=1),
    "stack": lambda x, y: torch.stack([x, y], dim=2).select(2, 1) * 2,
    "layer_norm (absent slots)": lambda x, y: torch.nn.functional.layer_norm(x, (7,)),
    "x * x after x * y": lambda x, y: (x * y, x * x, y * x),
    "0-d CPU scalar": lambda x, y: (x - torch.tensor(0.25)) / torch.tensor(2.0),
    "factory": lambda x, y: x - torch.arange(7, dtype=x.dtype, device=x.device),
    "to dtype": lambda x, y: (x.to(torch.float64) * 2).to(torch.float32),
    "several outputs": lambda x, y: torch.max(x + y, dim=1),
    "chain": lambda x, y: torch.tanh(x * y + x).exp() - y,
}


def _flat(v: Any) -> list[torch.Tensor]:
    if isinstance(v, torch.Tensor):
        return [v]
    return [t for x in v for t in _flat(x)]


class CountHits:
    """Counts the fast-path hits the runner's encoder sent as records and as JSON."""

    def __init__(self, runner: ClusterRunner) -> None:
        self.enc = runner._encoder
        self.records = 0
        self.json: list[str] = []

    def __enter__(self) -> CountHits:
        hit = self.enc._hit

        def counted(run: FastRun) -> Any:
            trees = hit(run)
            if trees is None:
                self.records += 1
            elif trees[0][0] != "Y":  # a template's definition is its first hit; the rest must be records
                self.json.append(str(run.plan.op))
            return trees

        self.enc._hit = counted  # type: ignore[method-assign]
        self.lane = lane = self.enc.lane
        if lane is not None:  # the C++ lane encodes runs of records without calling _hit: count what it took

            def counted_lane(batch: Any, start: int, fastrun: type, *rest: Any) -> int:
                end = lane(batch, start, fastrun, *rest)
                self.records += sum(1 for x in batch[start:end] if type(x) is fastrun)
                return end

            self.enc.lane = counted_lane
        return self

    def __exit__(self, *exc: Any) -> None:
        del self.enc._hit
        self.enc.lane = self.lane


@pytest.fixture(scope="module")
def meshes() -> Iterator[tuple[dt.DeviceMesh, dt.DeviceMesh]]:
    mp = pytest.MonkeyPatch()
    mp.setenv("DTORCH_WORKER_IMPORTS", "tests.cluster.worker_hooks")
    mp.setenv("DTORCH_TEST_FAIL_OP", "aten.sigmoid:1")
    try:
        flat = dt.init_device_mesh("cpu", (2,), mode="process")
        grid = dt.init_device_mesh("cpu", (1, 2), mode="process", mesh_dim_names=("dp", "tp"))
        yield flat, grid
    finally:
        dt.shutdown()
        mp.undo()


def _runner() -> ClusterRunner:
    r = get_session().executor.runner
    assert isinstance(r, ClusterRunner)
    return r


@pytest.mark.parametrize("name", list(CASES))
def test_records_equal_torch_on_every_placement(
    name: str, meshes: tuple[dt.DeviceMesh, dt.DeviceMesh]
) -> None:
    flat, grid = meshes
    case = CASES[name]
    torch.manual_seed(0)
    a, b = torch.randn(5, 7), torch.randn(5, 7)  # 5 rows on 2 devices: uneven shards
    want = _flat(case(a, b))
    layouts = [
        (flat, [Shard(0)]),
        (flat, [Replicate()]),
        (grid, [Replicate(), Shard(0)]),
        (grid["tp"], [Shard(0)]),
    ]
    for mesh, pl in layouts:
        x, y = dt.distribute_tensor(a, mesh, pl), dt.distribute_tensor(b, mesh, pl)
        for i in range(3):  # the first call plans, the second defines the hit template, the third is a record
            with CountHits(_runner()) as c:
                got = _flat(case(x, y))
                values = [g.full_tensor() for g in got]
            for g, w in zip(values, want, strict=True):
                torch.testing.assert_close(
                    g, w, msg=lambda m, mesh=mesh, pl=pl: f"{name} on {mesh} {pl}: {m}"
                )
            if i == 2 and pl == [Shard(0)] and mesh is flat:
                assert c.records > 0, f"{name}: no hit record was sent"
                assert c.json == [], f"{name}: hits sent as JSON: {c.json}"


def test_errors_stay_sticky_per_operand_through_records(meshes: tuple[dt.DeviceMesh, dt.DeviceMesh]) -> None:
    flat, _ = meshes
    a = torch.randn(6, 4)
    x = dt.distribute_tensor(a, flat, [Shard(0)])
    with CountHits(_runner()) as c:
        for _ in range(
            4
        ):  # sigmoid fails on worker 1 (tests.cluster.worker_hooks); its dependents are records
            good = (x * 2 + 1).tanh()
            bad = (torch.sigmoid(x) * 2 + 1).tanh()
            mixed = good + bad
            after = good * 3  # issued after the poisoned ones, in the same batch
        torch.testing.assert_close(after.full_tensor(), (a * 2 + 1).tanh() * 3)
    assert c.records > 10 and c.json == []
    for t in (bad, mixed):
        with pytest.raises(dt.errors.DTorchError, match=r"(?s)aten\.sigmoid.*worker 1.*planted failure"):
            t.full_tensor()
    torch.testing.assert_close(bad.to_local(0), ((torch.sigmoid(a[:3]) * 2) + 1).tanh())  # worker 0 is fine
    torch.testing.assert_close(good.full_tensor(), (a * 2 + 1).tanh())


def test_held_work_is_published_by_sync_fetch_and_wait_idle(
    meshes: tuple[dt.DeviceMesh, dt.DeviceMesh],
) -> None:
    flat, _ = meshes
    r = _runner()
    a = torch.randn(4, 4)
    x = dt.distribute_tensor(a, flat, [Shard(0)])
    ref = a.clone()
    for _ in range(600):  # ~10 chunks while the workers are busy: some are held
        x = x * 0.5 + 1
        ref = ref * 0.5 + 1
    dt.sync()
    assert len(r.outbox) == 0
    for _ in range(300):
        x = x * 0.5 + 1
        ref = ref * 0.5 + 1
    torch.testing.assert_close(x.full_tensor(), ref)
    for _ in range(300):
        x = x * 0.5 + 1
        ref = ref * 0.5 + 1
    assert r.wait_idle(60.0)
    assert len(r.outbox) == 0
    torch.testing.assert_close(x.full_tensor(), ref)


# --- the outbox's policy, without workers ------------------------------------------------------------------------
class FakeWorkers:
    """Published messages; ``acked``: how many of them the slowest worker acknowledged."""

    def __init__(self) -> None:
        self.sent: list[list[Any]] = []
        self.acked = 0

    def publish(self, batch: list[Any]) -> None:
        self.sent.append(batch)

    def in_flight(self) -> int:
        return len(self.sent) - self.acked


def _free(i: int) -> Free:
    return Free([i])


@pytest.mark.parametrize("window", [1, 2])
def test_outbox_publishes_while_workers_keep_up_and_holds_for_busy_ones(window: int) -> None:
    w = FakeWorkers()
    box = Outbox(w.publish, w.in_flight, max_held=8, window=window)
    for i in range(window):
        box.submit([_free(0), _free(1)])
        assert len(w.sent) == i + 1  # fewer than ``window`` in flight: at once
    box.submit([_free(2)])
    box.submit([_free(3), _free(4)])
    assert len(w.sent) == window and len(box) == 3  # busy: held
    box.on_ack()
    assert len(w.sent) == window  # no acknowledgement yet
    w.acked = 1
    box.on_ack()
    assert [len(b) for b in w.sent] == [2] * window + [3] and len(box) == 0  # gathered into one message
    w.acked = len(w.sent)
    box.submit([_free(i) for i in range(9)])  # idle... and over max_held anyway
    for _ in range(window - 1):
        box.submit([_free(i) for i in range(5)])  # fills the window again
    box.submit([_free(i) for i in range(5)])
    box.submit([_free(i) for i in range(5)])  # 10 held >= 8: published although busy
    assert w.in_flight() == window + 1 and len(w.sent[-1]) == 10 and len(box) == 0


@pytest.mark.parametrize("reply", [Barrier(("k", 0)), "fetch", "custom"])
def test_outbox_never_holds_what_a_caller_waits_for(reply: Any) -> None:
    w = FakeWorkers()
    box = Outbox(w.publish, w.in_flight, max_held=1000, window=1)
    box.submit([_free(0)])
    box.submit([_free(1)])
    assert len(box) == 1
    instr: Any = reply
    if reply == "fetch":
        instr = Fetch.__new__(Fetch)
    elif reply == "custom":
        instr = object()
    box.submit([_free(2), instr])
    assert len(box) == 0 and [len(b) for b in w.sent] == [1, 3]
    assert box.drop() == 0


SCRIPT = """
import torch, torch_dtorch as dt
from torch_dtorch import Shard
mesh = dt.init_device_mesh("cpu", (2,), mode="process")
x = dt.distribute_tensor(torch.randn(8, 8), mesh, [Shard(0)])
for _ in range(2000):
    x = (x * 0.5 + 1).tanh()
print("END", flush=True)
"""


def test_script_with_held_work_and_no_shutdown_exits() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(SCRIPT)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err[-2000:]
    assert out.strip().endswith("END")


def test_failure_while_work_is_held_raises_instead_of_hanging() -> None:
    w = FakeWorkers()
    box = Outbox(w.publish, w.in_flight, max_held=1000, window=1)
    box.submit([_free(0)])
    box.submit([_free(1)])
    assert box.drop() == 1 and len(box) == 0
    w.acked = 1
    t0 = time.monotonic()
    box.on_ack()
    assert time.monotonic() - t0 < 1.0 and len(w.sent) == 1
