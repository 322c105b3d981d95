"""The compile backend on CUDA (virtual ranks on one GPU): worker inductor, CUDA graphs, attention under sequence
sharding; workers run without a default-device mode."""

from __future__ import annotations

import pytest
import torch

import torch_dtorch as dt
from torch_dtorch import Replicate, Shard
from torch_dtorch.backend import dtorch_backend

from .models import MLP, Attention, distribute_module, tp_mlp_plan

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

# (the backend callable, not the entry-point name: GPU machines run the tests from a source tree)


def _mesh(n: int, mode: str | None = None) -> dt.DeviceMesh:
    return dt.init_device_mesh("cuda", (n,), mesh_dim_names=("tp",), simulate=True, mode=mode)


def test_tp_mlp_on_virtual_gpus() -> None:
    torch.manual_seed(0)
    model, x = MLP(dim=32, hidden=64).cuda(), torch.randn(8, 32, device="cuda")
    with torch.no_grad():
        ref = model(x)
        mesh = _mesh(2)
        distribute_module(model, mesh, tp_mlp_plan())
        compiled = torch.compile(model, backend=dtorch_backend, options={"worker_compiler": "inductor"})
        dx = dt.distribute_tensor(x, mesh, [Replicate()])
        for _ in range(3):
            torch.testing.assert_close(compiled(dx).full_tensor().cuda(), ref, atol=1e-4, rtol=1e-4)
        torch._dynamo.reset()
        graphs = torch.compile(
            model, backend=dtorch_backend, options={"worker_compiler": "inductor", "cudagraphs": True}
        )
        with pytest.raises(NotImplementedError, match="virtual ranks on one GPU"):
            graphs(dx)


def test_cudagraphs_on_one_gpu() -> None:
    torch.manual_seed(0)
    model, x, x2 = (
        MLP(dim=32, hidden=64).cuda(),
        torch.randn(8, 32, device="cuda"),
        torch.randn(8, 32, device="cuda"),
    )
    with torch.no_grad():
        ref, ref2 = model(x), model(x2)
        mesh = _mesh(1)
        distribute_module(model, mesh)
        options = {"worker_compiler": "inductor", "cudagraphs": True}
        compiled = torch.compile(model, backend=dtorch_backend, options=options)
        dx, dx2 = (dt.distribute_tensor(v, mesh, [Replicate()]) for v in (x, x2))
        for _ in range(4):  # warm-up, recording, then replays
            torch.testing.assert_close(compiled(dx).full_tensor().cuda(), ref, atol=1e-4, rtol=1e-4)
        # a result held across calls stays intact (each replay overwrites the graph's own output memory)
        y1 = compiled(dx)
        y2 = compiled(dx2)
        torch.testing.assert_close(y1.full_tensor().cuda(), ref, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(y2.full_tensor().cuda(), ref2, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("mode", ["thread", "process"])
def test_sequence_sharded_attention_on_virtual_gpus(mode: str) -> None:
    """Collectives and communicating kernels inside a compiled program: host-synchronized around thread mode's
    in-memory collectives, stream-ordered (no host synchronization) in process mode."""
    torch.manual_seed(0)
    model, x = Attention(dim=32, heads=4).cuda(), torch.randn(2, 16, 32, device="cuda")
    with torch.no_grad():
        ref = model(x)
        mesh = _mesh(2, mode)
        distribute_module(model, mesh)
        compiled = torch.compile(model, backend=dtorch_backend, options={"worker_compiler": "inductor"})
        dx = dt.distribute_tensor(x, mesh, [Shard(1)])
        for _ in range(3):
            torch.testing.assert_close(compiled(dx).full_tensor().cuda(), ref, atol=1e-4, rtol=1e-4)
        tp = MLP(dim=32, hidden=64).cuda()
        ref = tp(x)
        distribute_module(tp, mesh, tp_mlp_plan())
        compiled_tp = torch.compile(tp, backend=dtorch_backend, options={"worker_compiler": "inductor"})
        rx = dt.distribute_tensor(x, mesh, [Replicate()])
        for _ in range(3):  # the row-parallel output's all-reduce is a collective step of the program
            torch.testing.assert_close(compiled_tp(rx).full_tensor().cuda(), ref, atol=1e-4, rtol=1e-4)
    dt.shutdown()


def test_compiled_segments_run_without_default_device_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    """Worker threads on CUDA set no default device (its TorchFunctionMode slowed inductor-compiled segments'
    launches by ~20 %), not even while the first call compiles."""
    from torch.overrides import _get_current_function_mode_stack
    from torch.utils._device import DeviceContext

    from torch_dtorch.backend import program

    seen: list[int] = []
    compile_segment = program._compile_segment

    def spy(loaded, index, seg, args):  # type: ignore[no-untyped-def]
        fn = compile_segment(loaded, index, seg, args)

        def wrapped(*a):  # type: ignore[no-untyped-def]
            seen.append(sum(isinstance(m, DeviceContext) for m in _get_current_function_mode_stack()))
            return fn(*a)

        loaded.fns[index] = wrapped
        return wrapped

    monkeypatch.setattr(program, "_compile_segment", spy)
    torch.manual_seed(0)
    model, x = MLP(dim=32, hidden=64).cuda(), torch.randn(8, 32, device="cuda")
    with torch.no_grad():
        ref = model(x)
        mesh = _mesh(1)
        distribute_module(model, mesh)
        compiled = torch.compile(model, backend=dtorch_backend, options={"worker_compiler": "inductor"})
        dx = dt.distribute_tensor(x, mesh, [Replicate()])
        for _ in range(3):
            torch.testing.assert_close(compiled(dx).full_tensor().cuda(), ref, atol=1e-4, rtol=1e-4)
    assert seen == [0, 0, 0]
