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
