"""Compiled graphs beyond one mesh and plain collectives: context-parallel attention as a communicating kernel step,
pipeline stage moves (one program over several stage meshes), and ``dtorch::place`` layout requests from module
hooks (resolved by propagation, or run eagerly under ``dtorch_debug``)."""

from __future__ import annotations

import io

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

import torch_dtorch as dt
from torch_dtorch import Replicate, Shard
from torch_dtorch.backend.place import STAGE_MOVE, mesh_key, place
from torch_dtorch.backend.report import CompileReport
from torch_dtorch.nn import parallelize_module


@pytest.mark.parametrize("axis", ["ring", "ulysses"])
def test_cp_attention_is_a_comm_kernel_step(axis: str) -> None:
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 7, 4) for _ in range(3))
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    mesh = dt.init_device_mesh("cpu", (2,), mesh_dim_names=(axis,))
    dq, dk, dv = (dt.distribute_tensor(t, mesh, [Shard(2)]) for t in (q, k, v))
    reports: list[CompileReport] = []

    def attn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    with torch.no_grad():
        out = torch.compile(attn, backend="dtorch", options={"reports": reports})(dq, dk, dv)
        torch.testing.assert_close(out.full_tensor(), want, rtol=1e-5, atol=1e-5)
    assert out.placements == (Shard(2),)
    (report,) = reports
    assert "aten.scaled_dot_product_attention[rule kernel, comm]" in report.local[0]


def test_stage_move_makes_one_program_over_both_stages() -> None:
    torch.manual_seed(0)
    x, w0, w1 = torch.randn(4, 6), torch.randn(6, 8), torch.randn(8, 4)
    want = torch.relu(x @ w0) @ w1
    mesh = dt.init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
    s0, s1 = mesh.unbind("pp")
    key1 = mesh_key(s1)

    def two_stages(x: torch.Tensor, w0: torch.Tensor, w1: torch.Tensor) -> torch.Tensor:
        h = place(x @ w0, key1, STAGE_MOVE, what="test stage move")
        return torch.relu(h) @ w1

    reports: list[CompileReport] = []
    dx = dt.distribute_tensor(x, s0, [Shard(0)])
    dw0 = dt.distribute_tensor(w0, s0, [Replicate()])
    dw1 = dt.distribute_tensor(w1, s1, [Shard(1)])
    with torch.no_grad():
        out = torch.compile(two_stages, backend="dtorch", options={"reports": reports})(dx, dw0, dw1)
        torch.testing.assert_close(out.full_tensor(), want)
    assert out.device_mesh.root == s1
    (report,) = reports
    assert sorted(report.local) == list(s0.devices) + list(s1.devices)
    first, last = report.local[s0.devices[0]], report.local[s1.devices[0]]
    assert "aten.matmul" in first and "aten.relu" not in first  # stage 0 stops after sending
    assert "aten.relu" in last and "= redistribute(None)" in last  # stage 1 receives, then computes


def test_graph_constant_used_on_a_later_stage() -> None:
    """A tensor constant of the graph (``torch.tensor(3.0)`` in the code) lives on the mesh of the ops that use it:
    here stage 1, not the first input's mesh (it was bound there and the stage-1 op failed with a mesh mismatch)."""
    torch.manual_seed(0)
    x, w0, w1 = torch.randn(4, 6), torch.randn(6, 8), torch.randn(8, 4)
    want = (torch.relu(x @ w0) * 3.0 + 0.5) @ w1
    mesh = dt.init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
    s0, s1 = mesh.unbind("pp")
    key1 = mesh_key(s1)

    def two_stages(x: torch.Tensor, w0: torch.Tensor, w1: torch.Tensor) -> torch.Tensor:
        h = place(x @ w0, key1, STAGE_MOVE, what="test stage move")
        return (torch.relu(h) * torch.tensor(3.0) + torch.tensor(0.5)) @ w1

    reports: list[CompileReport] = []
    dx = dt.distribute_tensor(x, s0, [Shard(0)])
    dw0 = dt.distribute_tensor(w0, s0, [Replicate()])
    dw1 = dt.distribute_tensor(w1, s1, [Shard(1)])
    with torch.no_grad():
        compiled = torch.compile(two_stages, backend="dtorch", options={"reports": reports})
        for _ in range(2):  # compile, then replay with the constants already uploaded
            torch.testing.assert_close(compiled(dx, dw0, dw1).full_tensor(), want)
    (report,) = reports
    assert report.error is None  # compiled, not the eager fallback
    first, last = report.local[s0.devices[0]], report.local[s1.devices[0]]
    assert "aten.mul" in last and "aten.mul" not in first


class _MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(8, 12)
        self.down = nn.Linear(12, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.up(x)))


@pytest.mark.parametrize("backend", ["dtorch", "dtorch_debug"])
def test_style_hooks_inside_one_graph(backend: str) -> None:
    """TP style hooks emit ``dtorch::place`` while dynamo traces: one graph; ``dtorch_debug`` runs it eagerly (the
    op's eager implementation redistributes the real tensors)."""
    torch.manual_seed(0)
    ref, x = _MLP(), torch.randn(3, 8)
    with torch.no_grad():
        want = ref(x)
    model = _MLP()
    model.load_state_dict(ref.state_dict())
    mesh = dt.init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    parallelize_module(model, mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
    reports: list[CompileReport] = []
    options: dict[str, object] = {"reports": reports}
    if backend == "dtorch_debug":
        options["file"] = io.StringIO()
    with torch.no_grad():
        fn = torch.compile(model, backend=backend, fullgraph=True, options=options)
        out = fn(dt.distribute_tensor(x, mesh, [Replicate()]))
        torch.testing.assert_close(out.full_tensor(), want)
    assert out.placements == (Replicate(),)  # RowwiseParallel's output layout, as in eager mode
    (report,) = reports
    assert report.error is None
    assert "dtorch.place" in report.aten


def test_redistribute_that_moves_nothing_is_no_program_step() -> None:
    """On a mesh axis of size 1 a placement change moves nothing (here the row-wise layer's Partial -> Replicate):
    the rank program has no collective step, which would copy the tensor and, on CUDA, synchronize the device
    twice (a FLUX step on a 1-device mesh ran 1.8 x inductor from ~270 of them); an output that is thereby an
    input stays its own tensor."""
    torch.manual_seed(0)
    mesh = dt.init_device_mesh("cpu", (1,), mesh_dim_names=("tp",))
    m = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 4))
    x = torch.randn(3, 6)
    want = m(x)
    parallelize_module(m, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    reports: list[CompileReport] = []
    with torch.no_grad():
        out = torch.compile(m, backend="dtorch", options={"reports": reports})(
            dt.distribute_tensor(x, mesh, [Replicate()])
        )
    torch.testing.assert_close(out.full_tensor(), want.detach())
    programs = "\n".join(text for report in reports for text in report.local.values())
    assert "aten.linear" in programs and "redistribute" not in programs, programs

    def same(t: torch.Tensor) -> torch.Tensor:
        return t.redistribute(mesh, [Replicate()])

    dx = dt.distribute_tensor(x, mesh, [Shard(0)])
    with torch.no_grad():
        y = torch.compile(same, backend="dtorch")(dx)
    y.add_(1)  # the output is not the input's storage
    torch.testing.assert_close(dx.full_tensor(), x)
    torch.testing.assert_close(y.full_tensor(), x + 1)
