"""The ``torch.dtorch`` device module's RNG functions (``torch_dtorch/device/rng.py``): ``fork_rng`` and seeding."""

from __future__ import annotations

import torch

from tests.eager.conftest import init_mesh


def _draw(mesh: object) -> torch.Tensor:
    with mesh:  # type: ignore[attr-defined]
        return torch.randn(6, device="dtorch").full_tensor()


def test_fork_rng_over_the_dtorch_device_restores_the_stream() -> None:
    mesh = init_mesh((2,))
    module = torch.get_device_module("dtorch")
    torch.manual_seed(11)
    with torch.random.fork_rng(device_type="dtorch"):
        inside = _draw(mesh)
    after = _draw(mesh)
    assert torch.equal(inside, after)  # fork_rng rewound what the dtorch draw advanced
    state = module.get_rng_state()
    first = _draw(mesh)
    module.set_rng_state(state)
    assert torch.equal(_draw(mesh), first)
    assert not torch.equal(_draw(mesh), first)  # and the stream moves on


def test_seeding_the_dtorch_device_equals_torch() -> None:
    mesh = init_mesh((2,))
    module = torch.get_device_module("dtorch")
    module.manual_seed(5)
    got = _draw(mesh)
    torch.manual_seed(5)
    assert torch.equal(got, torch.randn(6))
    assert module.initial_seed() == 5
