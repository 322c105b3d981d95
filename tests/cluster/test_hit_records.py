"""Binary hit records end to end (codec v2, ``cluster/codec/hits.py``): randomized programs of interleaved chains,
frees, in-place ops, ``x + x``, redistributes and fetches give the same values in process mode (hits as records),
process mode with every instruction as JSON, thread mode and plain torch — fixed seeds."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

import torch_dtorch as dt
from tests.cluster.random_program import Counting, make_program, run_dtorch, run_torch
from torch_dtorch import Shard
from torch_dtorch.cluster.runner import ClusterRunner
from torch_dtorch.device import fastpath_grow
from torch_dtorch.device.state import get_session

SEEDS = [0, 1, 2]
STEPS = 120


@pytest.fixture(scope="module")
def thread_results() -> dict[tuple[int, int], list[torch.Tensor]]:
    """Thread mode's values of every program (computed before the module's process cluster starts)."""
    out = {}
    for n in (1, 2):
        mesh = dt.init_device_mesh("cpu", (n,), mode="thread")
        for seed in SEEDS:
            out[seed, n] = run_dtorch(make_program(seed, STEPS), mesh)
    dt.shutdown()
    return out


@pytest.fixture
def process_mesh() -> Iterator[tuple[dt.DeviceMesh, ClusterRunner]]:
    mesh = dt.init_device_mesh("cpu", (2,), mode="process")
    runner = get_session().executor.runner
    assert isinstance(runner, ClusterRunner)
    yield mesh, runner
    runner._encoder.hits = True


@pytest.mark.parametrize("seed", SEEDS)
def test_random_program_matches_thread_mode_and_torch(
    seed: int,
    thread_results: dict[tuple[int, int], list[torch.Tensor]],
    process_mesh: tuple[dt.DeviceMesh, ClusterRunner],
) -> None:
    mesh, runner = process_mesh
    prog = make_program(seed, STEPS)
    want = run_torch(prog)
    with Counting(runner) as c:
        got = run_dtorch(prog, mesh)
    assert c.words > 0, "no hit record was sent: the test does not exercise the binary path"
    assert len(got) == len(want) == len(thread_results[seed, 2])
    for k, (g, t, w) in enumerate(zip(got, thread_results[seed, 2], want, strict=True)):
        assert torch.equal(g, t), f"seed {seed}, fetch {k}: process mode differs from thread mode"
        torch.testing.assert_close(
            g, w, rtol=1e-6, atol=1e-6, msg=f"seed {seed}, fetch {k}: differs from torch"
        )


@pytest.mark.parametrize("seed", SEEDS)
def test_records_and_json_agree_bit_for_bit(
    seed: int, process_mesh: tuple[dt.DeviceMesh, ClusterRunner]
) -> None:
    mesh, runner = process_mesh
    prog = make_program(seed + 100, STEPS)
    runner._encoder.hits = False
    with Counting(runner) as c:
        json_values = run_dtorch(prog, mesh)
    assert c.words == 0
    runner._encoder.hits = True
    with Counting(runner) as c:
        hit_values = run_dtorch(prog, mesh)
    assert c.words > 0
    for k, (a, b) in enumerate(zip(json_values, hit_values, strict=True)):
        assert torch.equal(a, b), f"seed {seed + 100}, fetch {k}: records and JSON differ"


def test_one_device_long_chain_is_exact(process_mesh: tuple[dt.DeviceMesh, ClusterRunner]) -> None:
    """The benchmark's shape: a long chain on one device, frees in between, most ops records."""
    mesh = dt.init_device_mesh("cpu", (1,), mode="process")
    runner = get_session().executor.runner
    x0, b0 = torch.randn(16, 16), torch.randn(16, 16)
    x, b = dt.distribute_tensor(x0, mesh, [dt.Replicate()]), dt.distribute_tensor(b0, mesh, [dt.Replicate()])
    with Counting(runner) as c:
        for _ in range(600):
            x = x * 0.5 + b
            x0 = x0 * 0.5 + b0
        got = x.full_tensor()
    assert torch.equal(got, x0)
    assert c.words >= 5 * 1100, c.words  # nearly every op a record (3 + 2 words), plus the frees


@pytest.mark.slow
def test_repeated_inputs_and_0d_scalars_replay_on_worker_processes(monkeypatch: pytest.MonkeyPatch) -> None:
    """``x * x`` and ``x * torch.tensor(v)`` with a new ``v`` per call replay on worker processes: a worker raises
    once ``aten.mul.Tensor`` ran on its general path more than twice (each first call plans and runs there once)."""
    dt.shutdown()
    monkeypatch.setenv("DTORCH_WORKER_IMPORTS", "tests.cluster.worker_hooks")
    monkeypatch.setenv("DTORCH_TEST_GENERAL_LIMIT", "aten.mul.Tensor:2")
    try:
        mesh = dt.init_device_mesh("cpu", (2,), mode="process")
        a = torch.randn(5, 4)
        x = dt.distribute_tensor(a, mesh, [Shard(0)])
        planned = get_session().executor.constructor.num_planned
        derived = fastpath_grow.stats["derived"]  # (a decision kept by an earlier test's mul may be reused)
        y, want = x, a
        for v in (0.5, 2.0, 0.25, 4.0, 1.5, -1.0):
            y = (y * y) * torch.tensor(v)
            want = (want * want) * torch.tensor(v)
        assert torch.equal(dt.to_torch(y), want)
        made = (
            get_session().executor.constructor.num_planned
            - planned
            + fastpath_grow.stats["derived"]
            - derived
        )
        assert made == 2  # templates made: the first x*x and x*t
    finally:
        dt.shutdown()


@pytest.mark.slow
def test_hit_records_are_queued_by_the_native_lane(monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker process queues a run of hit records (and the free records between them) on its chain in C++
    (``NativeChain.queue_records``): a worker raises once more than a few ops went through ``NativeChain.add`` in
    Python (the records of a template's first calls are materialized and resolved there)."""
    dt.shutdown()
    monkeypatch.setenv("DTORCH_WORKER_IMPORTS", "tests.cluster.worker_hooks")
    monkeypatch.setenv("DTORCH_TEST_PY_ADD_LIMIT", "8")
    try:
        mesh = dt.init_device_mesh("cpu", (2,), mode="process")
        x0, b0 = torch.randn(8, 4), torch.randn(8, 4)
        x = dt.distribute_tensor(x0, mesh, [Shard(0)])
        b = dt.distribute_tensor(b0, mesh, [Shard(0)])
        for _ in range(300):
            x = x * 0.5 + b
            x0 = x0 * 0.5 + b0
        assert torch.equal(x.full_tensor(), x0)
    finally:
        dt.shutdown()
