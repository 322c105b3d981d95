"""Every dropout variant on dtorch tensors equals CPU torch under one seed: output, input gradient and the generator's
state afterwards, bit for bit (elementwise ops only), with and without grad, over Shard / Replicate / Partial
inputs, uneven shards, 2- and 4-device meshes — in the suite's mode (threads; worker processes with
``DTORCH_TEST_MODE=process``; ``test_dropout_process.py`` runs the same checks on processes in every run).

What they catch: eager ``dropout`` / ``native_dropout`` draw their noise on the controller (``device/dropout.py``).
Drawn by the workers, process mode gave valid masks but not torch's (the worker processes' generators are not the
controller's), and thread mode drew from whatever state the generator had when the workers ran. The composite
variants (``dropout_``, ``feature_dropout`` / ``Dropout1d-3d``, ``alpha_dropout``, ``feature_alpha_dropout``) reach
``bernoulli_``, also drawn on the controller."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import torch_dtorch as dt
from tests.training.conftest import init_mesh
from torch_dtorch import Partial, Replicate, Shard

P = 0.3

#: name -> (function of one tensor, the input shape); shapes have an uneven first dim (5 over 2 or 4 devices)
VARIANTS: dict[str, tuple[Callable[[torch.Tensor], torch.Tensor], tuple[int, ...]]] = {
    "dropout": (lambda t: F.dropout(t, P, True), (5, 6, 3)),
    "nn.Dropout": (lambda t: nn.Dropout(P)(t), (5, 6, 3)),
    "dropout_inplace": (lambda t: F.dropout(t * 1, P, True, inplace=True), (5, 6, 3)),
    "dropout_eval": (lambda t: F.dropout(t, P, False), (5, 6, 3)),
    "nn.Dropout.eval": (lambda t: nn.Dropout(P).eval()(t), (5, 6, 3)),
    "dropout_p0": (lambda t: F.dropout(t, 0.0, True), (5, 6, 3)),
    "dropout_p1": (lambda t: F.dropout(t, 1.0, True), (5, 6, 3)),
    "dropout1d": (lambda t: F.dropout1d(t, P, True), (5, 6, 3)),
    "nn.Dropout2d": (lambda t: nn.Dropout2d(P)(t), (5, 6, 3, 2)),
    "feature_dropout": (lambda t: torch.feature_dropout(t, P, True), (5, 6, 3, 2)),
    "dropout3d": (lambda t: F.dropout3d(t, P, True), (5, 4, 2, 3, 2)),
    "alpha_dropout": (lambda t: F.alpha_dropout(t, P, True), (5, 6, 3)),
    "nn.AlphaDropout": (lambda t: nn.AlphaDropout(P)(t), (5, 6, 3)),
    "alpha_dropout_eval": (lambda t: F.alpha_dropout(t, P, False), (5, 6, 3)),
    "feature_alpha_dropout": (lambda t: F.feature_alpha_dropout(t, P, True), (5, 6, 3, 2)),
    "native_dropout": (lambda t: torch.native_dropout(t, P, True)[0], (5, 6, 3)),
    "native_dropout_mask": (lambda t: torch.native_dropout(t, P, True)[1].float() * t, (5, 6, 3)),
    "native_dropout_p0": (lambda t: torch.native_dropout(t, 0.0, True)[0], (5, 6, 3)),
    "native_dropout_eval": (lambda t: torch.native_dropout(t, P, False)[0], (5, 6, 3)),
    # a transposed (dense, non-contiguous) input: the noise has empty_like's layout, so torch's draw order
    "dropout_transposed": (lambda t: F.dropout(t.transpose(0, 2), P, True), (5, 6, 3)),
    "native_dropout_transposed": (lambda t: torch.native_dropout(t.transpose(0, 1), P, True)[0], (5, 6, 3)),
}

#: variants whose backward torch refuses on a leaf that requires grad (they write their input): given ``t * 1``
IN_PLACE = {"dropout_inplace"}


def check_variant(
    mesh: dt.DeviceMesh,
    name: str,
    placement: object,
    *,
    grad: bool,
    inference: bool = False,
    seed: int = 7,
) -> None:
    """``VARIANTS[name]`` on a dtorch tensor placed ``placement`` on the 1-d ``mesh`` equals CPU torch: output,
    input gradient (``grad``) and ``torch.get_rng_state()`` afterwards."""
    fn, shape = VARIANTS[name]
    x = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
    torch.manual_seed(seed)
    xr = x.clone().requires_grad_(grad)
    with torch.inference_mode(inference):
        want = fn(xr)
    weight = torch.randn(want.shape, generator=torch.Generator().manual_seed(seed + 1))
    if grad:
        (want * weight).sum().backward()
    want_state = torch.get_rng_state()

    torch.manual_seed(seed)
    xd = dt.distribute_tensor(x, mesh, [placement]).requires_grad_(grad)  # type: ignore[list-item]
    with torch.inference_mode(inference):
        got = fn(xd)
    got_state = torch.get_rng_state()
    torch.manual_seed(seed + 100)  # the draw was made at the call, not when the workers run it
    if grad:
        (got * dt.distribute_tensor(weight, mesh, [Replicate()])).sum().backward()
    assert got.device.type == "dtorch"
    assert torch.equal(got.detach().full_tensor(), want.detach()), f"{name}: output"
    if grad:
        assert torch.equal(xd.grad.full_tensor(), xr.grad), f"{name}: input gradient"
    assert torch.equal(got_state, want_state), f"{name}: generator state afterwards"


PLACEMENTS = [Shard(0), Shard(1), Replicate()]
PLACEMENT_IDS = ["S0-uneven", "S1", "R"]


@pytest.mark.parametrize(
    ("num_devices", "placement"),
    [(2, Shard(0)), (2, Shard(1)), (2, Replicate()), (4, Shard(0))],
    ids=["2-S0-uneven", "2-S1", "2-R", "4-S0-uneven"],
)
@pytest.mark.parametrize("name", list(VARIANTS))
def test_variant_with_grad_equals_cpu_torch(name: str, placement: object, num_devices: int) -> None:
    check_variant(init_mesh((num_devices,)), name, placement, grad=True)


@pytest.mark.parametrize("placement", PLACEMENTS, ids=PLACEMENT_IDS)
@pytest.mark.parametrize("name", list(VARIANTS))
def test_variant_without_grad_equals_cpu_torch(name: str, placement: object) -> None:
    check_variant(init_mesh((2,)), name, placement, grad=False)


@pytest.mark.parametrize(
    "name", ["dropout", "native_dropout", "dropout_eval", "nn.Dropout2d", "alpha_dropout"]
)
def test_variant_under_inference_mode(name: str) -> None:
    """``inference_mode`` skips the autograd kernels: the backend kernels draw on the controller as well."""
    check_variant(init_mesh((2,)), name, Shard(0), grad=False, inference=True)


@pytest.mark.parametrize("name", ["dropout", "native_dropout", "nn.Dropout2d", "alpha_dropout"])
def test_variant_of_partial_input(name: str) -> None:
    """One mask for every part of a ``Partial`` input: dropout stays linear, the parts sum to torch's output."""
    check_variant(init_mesh((2,)), name, Partial(), grad=True)


def test_dropout_draw_happens_at_the_call() -> None:
    """A reseed right after the call (before the workers ran it) does not change the mask, in either mode."""
    mesh = init_mesh((2,))
    x = torch.randn(40, 8)
    torch.manual_seed(11)
    want = F.dropout(x, 0.5, True)
    torch.manual_seed(11)
    got = F.dropout(dt.distribute_tensor(x, mesh, [Shard(0)]), 0.5, True)
    torch.manual_seed(12)
    _ = torch.rand(1000)
    assert torch.equal(got.full_tensor(), want)


def test_dropout_eval_is_the_input() -> None:
    """``F.dropout(training=False)`` returns its input as CPU torch does (no copy, no draw) and keeps its
    placements; the gradient flows through unchanged."""
    mesh = init_mesh((2,))
    xd = dt.distribute_tensor(torch.randn(5, 3), mesh, [Shard(0)]).requires_grad_()
    state = torch.get_rng_state()
    y = F.dropout(xd, 0.5, training=False)
    assert y.placements == (Shard(0),)
    assert torch.equal(torch.get_rng_state(), state)
    y.sum().backward()
    assert torch.equal(xd.grad.full_tensor(), torch.ones(5, 3))


def test_dropout_bad_probability_raises_like_torch() -> None:
    mesh = init_mesh((2,))
    xd = dt.distribute_tensor(torch.randn(4, 3), mesh, [Shard(0)])
    for fn in (lambda t: F.dropout(t, 1.5, True), lambda t: torch.native_dropout(t, -0.1, True)):
        with pytest.raises((ValueError, RuntimeError), match="between 0 and 1|dropout probability"):
            out = fn(xd)
            out = out[0] if isinstance(out, tuple) else out
            out.full_tensor()
