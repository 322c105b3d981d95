"""Dropout on worker processes (``mode="process"``) equals CPU torch under one seed in eager mode — in every run of
the suite, not only under ``DTORCH_TEST_MODE=process``: the dropout variants of ``test_dropout_variants.py`` and a
training loop, on 2- and 4-process meshes, Shard (uneven) / Replicate inputs and parameters.

Compiled programs draw ``native_dropout``'s mask on the worker processes, whose generators ``torch.manual_seed``
sets (``device/worker_rng.py``): the last test pins down what that gives (docs/training.md "Dropout")."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import torch_dtorch as dt
from tests.training.test_dropout_training import DropMLP, _distributed, _steps
from tests.training.test_dropout_variants import check_variant
from torch_dtorch import Replicate, Shard

pytestmark = pytest.mark.slow  # starts worker processes (seconds on 2 cores)


@pytest.fixture(scope="module")
def meshes(process_meshes: dict[int, dt.DeviceMesh]) -> dict[int, dt.DeviceMesh]:
    return process_meshes


@pytest.mark.parametrize("num_devices", [2, 4])
@pytest.mark.parametrize(
    "name",
    ["dropout", "nn.Dropout", "dropout_inplace", "dropout_eval", "nn.Dropout2d", "nn.AlphaDropout",
     "feature_alpha_dropout", "native_dropout", "native_dropout_mask", "dropout_p1"],
)  # fmt: skip
@pytest.mark.parametrize("placement", [Shard(0), Replicate()], ids=["S0-uneven", "R"])
def test_variant_on_processes(
    meshes: dict[int, dt.DeviceMesh], name: str, placement: object, num_devices: int
) -> None:
    from torch_dtorch.device.state import get_session

    assert get_session().mode == "process"
    check_variant(meshes[num_devices], name, placement, grad=True)
    check_variant(meshes[num_devices], name, placement, grad=False)


@pytest.mark.parametrize(
    ("num_devices", "sharded", "x_placement"),
    [(2, "a", Shard(0)), (2, "none", Replicate()), (4, "a", Shard(0)), (4, "a", Shard(1))],
    ids=["2-shard-batch", "2-replicate", "4-shard-batch-uneven", "4-shard-features"],
)
def test_training_with_dropout_on_processes(
    meshes: dict[int, dt.DeviceMesh], num_devices: int, sharded: str, x_placement: object
) -> None:
    """Three steps of forward + backward with ``nn.Dropout`` (reseeded per step): outputs, gradients and the
    generator state equal CPU torch (the batch of 6 is uneven over 4 processes)."""
    mesh = meshes[num_devices]
    torch.manual_seed(0)
    ref = DropMLP(0.2)
    model = _distributed(ref, mesh, sharded)
    x = torch.randn(6, 6)
    want = _steps(ref, x)
    want_state = torch.get_rng_state()
    got = _steps(model, dt.distribute_tensor(x, mesh, [x_placement]))  # type: ignore[list-item]
    assert torch.equal(torch.get_rng_state(), want_state)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=1e-6, rtol=0)
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(
            p.grad.full_tensor(), q.grad, atol=1e-6, rtol=1e-6, msg=lambda m, n=name: f"{n}: {m}"
        )


def test_compiled_dropout_on_processes_follows_the_seed(meshes: dict[int, dt.DeviceMesh]) -> None:
    """A compiled program draws its mask on the worker processes. Their generators are set to the controller's by
    ``torch.manual_seed`` (``device/worker_rng.py``): every rank draws the same global mask (before, each process
    had its own random seed and a replicated output differed between ranks) and the masks are CPU torch's for that
    seed, step after step. The known gap: the controller's generator does not advance by the workers' draws."""
    mesh = meshes[2]
    x = torch.randn(64, 8)
    # (earlier tests of this process may have used up dynamo's recompile limit for Dropout.forward: the call would
    # then run eagerly, drawing on the controller)
    torch._dynamo.reset()
    drop = torch.compile(nn.Dropout(0.5), backend="dtorch")
    torch.manual_seed(3)
    want = [nn.functional.dropout(x, 0.5, True) for _ in range(3)]
    torch.manual_seed(3)
    state = torch.get_rng_state()
    xd = dt.distribute_tensor(x, mesh, [Replicate()])
    for w in want:
        out = drop(xd)
        assert out.placements == (Replicate(),)
        full = out.full_tensor()
        assert all(
            torch.equal(out.to_local(rank), full) for rank in (0, 1)
        )  # the same mask on both processes
        assert torch.equal(full, w)
    assert torch.equal(torch.get_rng_state(), state), (
        "the controller's generator advances now: update the docs"
    )
    sharded = drop(
        dt.distribute_tensor(x, mesh, [Shard(0)])
    )  # the 4th draw of the stream, each rank its rows
    torch.manual_seed(3)
    for _ in range(3):
        nn.functional.dropout(x, 0.5, True)
    assert torch.equal(sharded.full_tensor(), nn.functional.dropout(x, 0.5, True))
