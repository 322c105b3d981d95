"""The workers' native loop drops a chain's intermediates where the controller freed them (a free step), not at the
chain's end: a chain of 64 ops held all 64 outputs until it finished (gigabytes of activations at full size; an
eager training step's peak was 5.8 GiB above torch's on an H100)."""

from __future__ import annotations

import pytest
import torch

import torch_dtorch as dt
from tests.eager.conftest import init_mesh, thread_only
from torch_dtorch import Replicate, Shard
from torch_dtorch.runtime import native_replay

pytestmark = thread_only


def _loop(x: torch.Tensor, n: int) -> torch.Tensor:
    y = x
    for _ in range(n):
        y = y * 1.0001 + 0.5  # each step's intermediates die at once (the names are rebound)
    return y


@pytest.mark.parametrize("mesh_shape", [(1,), (2,)])
def test_a_chain_holds_only_its_live_tensors(mesh_shape: tuple[int, ...]) -> None:
    ext = native_replay.extension()
    if ext is None:
        pytest.skip("the native worker loop is not built here (DTORCH_NATIVE=0 or no compiler)")
    mesh = init_mesh(mesh_shape)
    a = torch.randn(64, 32)
    x = dt.distribute_tensor(a, mesh, [Shard(0)])
    _loop(x, 20).full_tensor()  # warm: templates recorded and resolved on the workers
    dt.sync()
    ext.take_peak()
    y = _loop(x, 200)  # 400 ops and their frees, in batches of 64 instructions: chains of ~30 ops
    got = y.full_tensor()
    torch.testing.assert_close(got, _loop(a, 200))
    peak, _ = ext.take_peak()
    assert 0 < peak <= 8, f"a chain held {peak} tensors at once"


def test_freed_outputs_are_not_published_and_live_ones_are() -> None:
    if native_replay.extension() is None:
        pytest.skip("the native worker loop is not built here")
    mesh = init_mesh((1,))
    a = torch.randn(8, 8)
    x = dt.distribute_tensor(a, mesh, [Replicate()])
    for _ in range(2):  # the second round replays
        t = x + 1.0
        keep = t * 2.0
        del t
        also = keep.sin()
        torch.testing.assert_close(also.full_tensor(), ((a + 1.0) * 2.0).sin())
        torch.testing.assert_close(keep.full_tensor(), (a + 1.0) * 2.0)


def test_an_input_freed_inside_a_chain_is_dropped_there() -> None:
    """A chain's *input* (a tensor made before it) whose last reference dies inside the chain is freed at that point
    too: the chain held it alone after the blob went."""
    ext = native_replay.extension()
    if ext is None:
        pytest.skip("the native worker loop is not built here")
    mesh = init_mesh((1,))
    a = torch.randn(16, 16)
    for rnd in range(2):
        xs = [dt.distribute_tensor(a + i, mesh, [Replicate()]) for i in range(30)]
        dt.sync()  # the 30 inputs are blobs, outside any chain
        ext.take_peak()
        total = None
        for i in range(30):
            x = xs[i]
            xs[i] = None  # type: ignore[call-overload]  # the input dies after its use
            total = x * 1.0 if total is None else total + x
            del x
        want = sum(a + i for i in range(30))
        torch.testing.assert_close(total.full_tensor(), want)  # type: ignore[union-attr]
        if rnd:
            _, at_end = ext.take_peak()
            assert at_end <= 4, f"a chain still held {at_end} tensors at its end"


_EVENTS: list[str] = []


@torch.library.custom_op("dtorch_test_chain::mark", mutates_args=())
def _mark(x: torch.Tensor) -> torch.Tensor:
    _EVENTS.append(
        "mark"
    )  # (a Python kernel: the native loop takes the GIL for it, as for any Python kernel)
    return x.clone()


@pytest.mark.parametrize("numel", [64, (64 << 20) // 4 + 1024], ids=["small", "past-the-defer-limit"])
def test_a_python_wrapped_input_freed_mid_chain_dies_after_the_chain_with_the_gil(numel: int) -> None:
    """Dropping the last reference of a tensor Python wraps (a chain's external input: a blob) decrefs its PyObject,
    which takes the GIL; a worker thread waiting for the GIL the controller holds stalls up to the switch interval
    (5 ms) per drop (16 % of a worker's time in a tiny Llama decode). The native loop keeps such tensors until the
    chain ends (up to 64 MiB: past that they go at once, under the GIL)."""
    ext = native_replay.extension()
    if ext is None:
        pytest.skip("the native worker loop is not built here")
    import weakref

    probe = torch.zeros(numel)
    neg = ext.resolve("aten::neg", "", (probe,), {}, [0], [-1])
    mark = ext.resolve("dtorch_test_chain::mark", "", (probe,), {}, [0], [-1])
    assert neg >= 0 and mark >= 0
    try:
        a = torch.ones(numel)
        _EVENTS.clear()
        weakref.finalize(a, _EVENTS.append, "input dropped")
        tensors = [a]
        del a  # the list holds the input alone; run_chain takes it over
        free = native_replay.FREE_STEP
        steps = [neg, 1, 7, 1, 8, free, 1, 7, mark, 1, 8, 1, 9]
        out_ids, out_tensors, failures = ext.run_chain(steps, [7], tensors)
        assert failures == []
        assert sorted(out_ids) == [8, 9]
        torch.testing.assert_close(out_tensors[out_ids.index(9)], -torch.ones(numel))
        small = numel * 4 <= 64 << 20
        want = ["mark", "input dropped"] if small else ["input dropped", "mark"]
        assert want == _EVENTS
    finally:
        ext.release([neg, mark])
