"""Compiled training donates a backward's saved activations to the workers' program.

The controller clears a compiled graph's boxed inputs before it flushes the ``RunProgram``, so the ``Free`` of the
inputs that died (the forward's saved activations, once aot_autograd handed them to the backward) follows the
program in the same batch. The worker drops those blobs before the program runs, and every compute segment takes its
inputs as one list that it empties: inductor's code then frees each saved activation after its last use, as in plain
``torch.compile``, instead of holding all of them until the backward ends (the compiled step's peak memory).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import torch_dtorch as dt
from tests.training.conftest import init_mesh
from torch_dtorch import _compat
from torch_dtorch.backend import program as program_mod
from torch_dtorch.device.state import get_session
from torch_dtorch.nn import replicate_module


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = torch.nn.Linear(16, 48)
        self.down = torch.nn.Linear(48, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.up(x)
        return x + self.down(torch.nn.functional.silu(h) * torch.sigmoid(h))


def test_boxed_inductor_compile_empties_its_input_list() -> None:
    def f(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return (torch.relu(a) @ b).sin(), a.sum()

    gm = torch.fx.symbolic_trace(f)
    xs = [torch.randn(4, 4), torch.randn(4, 4)]
    fn = _compat.inductor_compile(gm, list(xs), boxed=True)
    args = list(xs)
    out = fn(args)
    assert args == []
    for got, want in zip(out, f(*xs), strict=True):
        torch.testing.assert_close(got, want)


def _spy_segments(mesh: dt.DeviceMesh, seen: list[tuple[int, int, int]]) -> None:
    """Wrap every loaded segment function of the mesh's workers: at each call note the program's inputs held by the
    worker's blob table (and how many of them are parameters), then run it."""
    workers = {d: w for d, w in get_session().executor.runner.workers.items() if d in mesh.devices}
    for worker in workers.values():
        for loaded in program_mod._PROGRAMS.get(worker, {}).values():
            for index, fn in enumerate(loaded.fns):
                if fn is None:
                    continue

                def spy(args: list[Any], fn: Any = fn, worker: Any = worker) -> Any:
                    held = {id(b.tensor) for b in worker.blobs.values() if b.tensor is not None}
                    live = sum(1 for x in args if isinstance(x, torch.Tensor) and id(x) in held)
                    seen.append((len(args), live, worker.device))
                    return fn(args)

                loaded.fns[index] = spy


@pytest.mark.parametrize("worker_compiler", ["eager", "inductor"])
@pytest.mark.parametrize("devices", [1, 2])
def test_backward_program_holds_no_saved_activation(worker_compiler: str, devices: int) -> None:
    torch._dynamo.reset()
    torch.manual_seed(0)
    ref, model = Block(), Block()
    model.load_state_dict(ref.state_dict())
    mesh = init_mesh((devices,))
    replicate_module(model, mesh)
    compiled = torch.compile(model, backend="dtorch", options={"worker_compiler": worker_compiler})
    xs = [torch.randn(4, 8, 16) for _ in range(3)]

    def step(x: torch.Tensor) -> None:
        compiled(dt.distribute_tensor(x, mesh)).square().mean().backward()

    step(xs[0])  # compiles the forward and backward programs
    dt.sync()
    seen: list[tuple[int, int, int]] = []
    _spy_segments(mesh, seen)
    step(xs[1])
    step(xs[2])
    dt.sync()
    for x in xs:
        ref(x).square().mean().backward()
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad.full_tensor(), q.grad, rtol=1e-5, atol=1e-6)
    # 2 steps x (forward, backward) x devices, one segment each
    # per device: forward, backward, forward, backward (one segment each)
    for d in range(devices):
        calls = [(n, live) for n, live, device in seen if device == d]
        assert len(calls) == 4, seen
        forward, backward = calls[0::2], calls[1::2]
        # the forward's inputs (the batch, the parameters) stay alive on the controller: nothing is donated
        assert all(live == n for n, live in forward), forward
        # every input of the backward is a saved activation or the loss's gradient, which the controller dropped
        # before the program ran: the segment alone holds them (without donation: all of them were held)
        assert all(n > 0 and live == 0 for n, live in backward), backward
