"""``torch.multinomial`` on dtorch tensors equals single-device torch under the same seed — samples and the
generator's state afterwards — in thread and process mode: it is drawn on the controller (``device/rng.py``)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import pytest
import torch
from torch.testing._internal.common_utils import freeze_rng_state

import torch_dtorch as dt
from tests.eager.conftest import TEST_DEVICE, init_mesh
from torch_dtorch import Partial, Replicate, Shard

#: (num_samples, replacement): argmax of probs / exponential noise, top-k of it, one uniform per sample
DRAWS = [(1, False), (3, False), (4, True)]


def _check(
    mesh: dt.DeviceMesh, probs: torch.Tensor, placements: Sequence[Any], want_out: Sequence[Any]
) -> None:
    for num_samples, replacement in DRAWS:
        torch.manual_seed(3)
        want = torch.multinomial(probs, num_samples, replacement)
        want_next = torch.rand(3)
        torch.manual_seed(3)
        x = dt.distribute_tensor(probs, mesh, list(placements))
        got = torch.multinomial(x, num_samples, replacement)
        assert got.placements == tuple(want_out)
        assert torch.equal(got.full_tensor(), want), (placements, num_samples, replacement)
        assert torch.equal(torch.rand(3), want_next)  # the generator moved as torch's did


CASES_1D = [([Shard(0)], [Shard(0)]), ([Replicate()], [Replicate()]), ([Shard(1)], [Replicate()])]


@pytest.mark.parametrize(("placements", "want_out"), CASES_1D, ids=["S0", "R", "S1-vocab"])
def test_multinomial_equals_torch(placements: list[Any], want_out: list[Any]) -> None:
    mesh = init_mesh((2,))
    torch.manual_seed(0)
    _check(mesh, torch.rand(5, 11), placements, want_out)  # 5 rows on 2 ranks: uneven


def test_multinomial_on_a_2d_mesh() -> None:
    mesh = init_mesh((2, 2))
    torch.manual_seed(0)
    probs = torch.rand(6, 9)
    _check(mesh, probs, [Shard(0), Replicate()], [Shard(0), Replicate()])
    _check(mesh, probs, [Shard(0), Shard(0)], [Shard(0), Shard(0)])
    _check(mesh, probs, [Replicate(), Shard(1)], [Replicate(), Replicate()])


def test_multinomial_of_a_partial_and_a_1d_probs() -> None:
    mesh = init_mesh((2,))
    torch.manual_seed(0)
    probs = torch.rand(4, 7)
    half = dt.from_local([probs / 2, probs / 2], mesh, [Partial()])
    torch.manual_seed(9)
    want = torch.multinomial(probs, 2)
    torch.manual_seed(9)
    got = torch.multinomial(half, 2)
    assert got.placements == (Replicate(),)
    assert torch.equal(got.full_tensor(), want)
    _check(mesh, probs[0], [Replicate()], [Replicate()])


def test_multinomial_generator_out_and_freeze_rng_state() -> None:
    mesh = init_mesh((2,))
    torch.manual_seed(0)
    probs = torch.rand(5, 8)
    x = dt.distribute_tensor(probs, mesh, [Shard(0)])
    # a generator of the controller's device (the CPU, or cuda:0 under DTORCH_TEST_DEVICE=cuda), as torch requires
    want = torch.multinomial(probs, 3, generator=torch.Generator(probs.device).manual_seed(5))
    got = torch.multinomial(x, 3, generator=torch.Generator(probs.device).manual_seed(5))
    assert torch.equal(got.full_tensor(), want)
    torch.manual_seed(1)
    want = torch.multinomial(probs, 2)
    out = dt.distribute_tensor(torch.zeros(5, 2, dtype=torch.long), mesh, [Shard(0)])
    torch.manual_seed(1)
    torch.multinomial(x, 2, out=out)
    assert torch.equal(out.full_tensor(), want)
    # OpInfo's wrapper_set_seed: the state is restored right after the call, so the draw must happen at the call
    with freeze_rng_state():
        torch.manual_seed(2)
        got = torch.multinomial(x, 2)
    torch.manual_seed(2)
    assert torch.equal(got.full_tensor(), torch.multinomial(probs, 2))


def test_multinomial_invalid_probs_raise_torchs_error() -> None:
    mesh = init_mesh((2,))
    bad = dt.distribute_tensor(-torch.rand(4, 5), mesh, [Shard(0)])
    with pytest.raises(RuntimeError, match="probability tensor contains"):
        torch.multinomial(bad, 1)


@pytest.fixture(scope="module")
def process_mesh() -> Iterator[dt.DeviceMesh]:
    mp = pytest.MonkeyPatch()
    mp.setenv("DTORCH_HEARTBEAT_TIMEOUT_S", "10")  # a loaded 2-core CI machine (as in tests/backend)
    mp.setenv("DTORCH_CONTROLLER_TIMEOUT_S", "30")
    dt.shutdown()
    try:
        yield dt.init_device_mesh("cpu", (2,), mode="process")
    finally:
        dt.shutdown()
        mp.undo()


@pytest.mark.slow
@pytest.mark.skipif(TEST_DEVICE != "cpu", reason="a CPU process mesh next to CUDA reference tensors")
@pytest.mark.parametrize(("placements", "want_out"), CASES_1D, ids=["S0", "R", "S1-vocab"])
def test_multinomial_equals_torch_on_processes(
    process_mesh: dt.DeviceMesh, placements: list[Any], want_out: list[Any]
) -> None:
    torch.manual_seed(0)
    _check(process_mesh, torch.rand(5, 11), placements, want_out)
