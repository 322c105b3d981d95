"""A transformer block (RMSNorm, attention with GQA and causal mask, SwiGLU MLP) under combinations of DP / TP /
CP (ring, Ulysses, both) / PP on CPU meshes of up to 16 virtual devices, compared with single-device torch.

Eager and compiled (``torch.compile(backend="dtorch", fullgraph=True)``: one graph, so TP style hooks and pipeline
stage moves run inside it as ``dtorch::place`` requests, context-parallel attention as a communicating kernel step
and the stages as one multi-mesh program). A few representative combinations run by default; the full matrix is
marked slow."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

import torch_dtorch as dt
from tests.nn.conftest import init_mesh
from torch_dtorch import Replicate, Shard
from torch_dtorch.backend.report import CompileReport
from torch_dtorch.nn import parallelize_module, replicate_module
from torch_dtorch.nn.pipeline import pipeline_parallel

DIM, HEADS, KV_HEADS, HIDDEN = 16, 4, 2, 24
HEAD_DIM = DIM // HEADS


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm1 = nn.RMSNorm(DIM)
        self.q_proj = nn.Linear(DIM, HEADS * HEAD_DIM, bias=False)
        self.k_proj = nn.Linear(DIM, KV_HEADS * HEAD_DIM, bias=False)
        self.v_proj = nn.Linear(DIM, KV_HEADS * HEAD_DIM, bias=True)
        self.o_proj = nn.Linear(HEADS * HEAD_DIM, DIM, bias=True)
        self.norm2 = nn.RMSNorm(DIM)
        self.gate_proj = nn.Linear(DIM, HIDDEN, bias=False)
        self.up_proj = nn.Linear(DIM, HIDDEN, bias=False)
        self.down_proj = nn.Linear(HIDDEN, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, seq, _ = x.shape
        h = self.norm1(x)
        q = self.q_proj(h).view(b, seq, -1, HEAD_DIM).transpose(1, 2)
        k = self.k_proj(h).view(b, seq, -1, HEAD_DIM).transpose(1, 2)
        v = self.v_proj(h).view(b, seq, -1, HEAD_DIM).transpose(1, 2)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + self.o_proj(a.transpose(1, 2).reshape(b, seq, -1))
        h = self.norm2(x)
        return x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))


class Tiny(nn.Module):
    def __init__(self, num_layers: int = 2) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Block() for _ in range(num_layers))
        self.norm = nn.RMSNorm(DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.norm(x)


TP_PLAN = {
    "layers.*.q_proj": ColwiseParallel(),
    "layers.*.k_proj": ColwiseParallel(),
    "layers.*.v_proj": ColwiseParallel(),
    "layers.*.o_proj": RowwiseParallel(),
    "layers.*.gate_proj": ColwiseParallel(),
    "layers.*.up_proj": ColwiseParallel(),
    "layers.*.down_proj": RowwiseParallel(),
}

#: (mesh axis names, sizes, sequence length)
FAST = [
    (("dp", "tp"), (2, 2), 6),
    (("cp",), (3,), 7),
    (("ulysses", "ring"), (2, 2), 9),
    (("pp", "tp"), (2, 2), 5),
    (("dp", "tp", "cp"), (2, 2, 2), 7),
]
FULL = [
    (("tp",), (4,), 5),
    (("ring",), (4,), 10),
    (("ulysses",), (2,), 7),
    (("ring", "ulysses"), (2, 2), 8),
    (("pp",), (2,), 6),
    (("pp", "cp"), (2, 2), 7),
    (("pp", "dp", "ulysses"), (2, 2, 2), 6),
    (("dp", "tp", "ulysses", "ring"), (2, 2, 2, 2), 9),
    (("pp", "dp", "tp", "cp"), (2, 2, 2, 2), 7),
    (("tp", "ulysses", "ring"), (2, 2, 4), 12),
]


def _ids(case: tuple[tuple[str, ...], tuple[int, ...], int]) -> str:
    names, sizes, seq = case
    return "-".join(f"{n}{s}" for n, s in zip(names, sizes, strict=True)) + f"-L{seq}"


def run_case(names: tuple[str, ...], sizes: tuple[int, ...], seq: int, *, compiled: bool = False) -> None:
    torch.manual_seed(0)
    ref_model = Tiny().eval()
    batch = 2 * (dict(zip(names, sizes, strict=True)).get("dp", 1))
    x = torch.randn(batch, seq, DIM)
    with torch.no_grad():
        want = ref_model(x)
    model = Tiny().eval()
    model.load_state_dict(ref_model.state_dict())
    mesh = init_mesh(sizes, mesh_dim_names=names)
    has_tp = "tp" in names
    if "pp" in names:
        stages = pipeline_parallel(
            model, mesh, plan=TP_PLAN if has_tp else None, tp_dim="tp" if has_tp else None
        )
        in_mesh = stages.meshes[0]
    else:
        if has_tp:
            parallelize_module(model, mesh["tp"], TP_PLAN)
        else:
            replicate_module(model, mesh)
        in_mesh = mesh
    axis_names = in_mesh.mesh_dim_names or ()
    placements = [
        Shard(0) if n == "dp" else Shard(1) if n in ("cp", "ring", "ulysses") else Replicate()
        for n in axis_names
    ]
    xd = dt.distribute_tensor(x, in_mesh, placements)
    reports: list[CompileReport] = []
    fn = (
        torch.compile(model, backend="dtorch", fullgraph=True, options={"reports": reports})
        if compiled
        else model
    )
    with torch.no_grad():
        out = fn(xd)
    torch.testing.assert_close(out.full_tensor(), want, rtol=1e-4, atol=1e-4)
    if compiled:  # one graph, compiled for real (no eager fallback)
        assert len(reports) == 1 and reports[0].error is None, [r.error for r in reports]


@pytest.mark.parametrize("case", FAST, ids=_ids)
def test_block_combo(case: tuple[tuple[str, ...], tuple[int, ...], int]) -> None:
    run_case(*case)


@pytest.mark.slow
@pytest.mark.parametrize("case", FULL, ids=_ids)
def test_block_combo_full(case: tuple[tuple[str, ...], tuple[int, ...], int]) -> None:
    assert math.prod(case[1]) <= 16
    run_case(*case)


#: compiled by default: PP+TP (multi-mesh program), DP+TP+ring, Ulysses+ring (dynamo tracing costs ~3 s a case)
COMPILED_FAST = [FAST[3], FAST[4], FAST[2]]


@pytest.mark.parametrize("case", COMPILED_FAST, ids=_ids)
def test_block_combo_compiled(case: tuple[tuple[str, ...], tuple[int, ...], int]) -> None:
    torch._dynamo.reset()
    run_case(*case, compiled=True)


@pytest.mark.slow
@pytest.mark.parametrize("case", [c for c in FAST + FULL if c not in COMPILED_FAST], ids=_ids)
def test_block_combo_compiled_full(case: tuple[tuple[str, ...], tuple[int, ...], int]) -> None:
    assert math.prod(case[1]) <= 16
    torch._dynamo.reset()
    run_case(*case, compiled=True)
