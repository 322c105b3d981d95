"""Roofline numbers equal hand-computed FLOPs and bytes for matmul, SDPA and layer_norm; estimates, bounds, the
table, the PNG and the CLI."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from torch_dtorch.executor import GraphConstructor
from torch_dtorch.mesh import DeviceMesh
from torch_dtorch.placement import Replicate, Shard
from torch_dtorch.tools import DevicePeaks, measure_peaks, roofline
from torch_dtorch.tools.roofline import GPU_TABLE

aten = torch.ops.aten
F32 = 4
PEAKS = DevicePeaks("test", {"fp32": 1e9, "16bit": 4e9}, mem_bw=1e9, link_bw=1e8)


def _graph() -> GraphConstructor:
    mesh = DeviceMesh.from_shape("cpu", (2,))
    g = GraphConstructor(default_mesh=mesh)
    a = g.input((8, 16), mesh, [Shard(0)])
    b = g.input((16, 32), mesh, [Replicate()])
    g.call(aten.mm.default, a, b)
    q, k, v = (g.input((2, 4, 8, 16), mesh, [Shard(1)]) for _ in range(3))
    g.call(aten.scaled_dot_product_attention.default, q, k, v)
    g.call(aten.scaled_dot_product_attention.default, q, k, v, is_causal=True)
    x = g.input((4, 8, 16), mesh, [Shard(0)])
    w, bias = g.input((16,), mesh, [Replicate()]), g.input((16,), mesh, [Replicate()])
    g.call(aten.layer_norm.default, x, [16], w, bias)
    g.redistribute(g.call(aten.mm.default, a, b), [Replicate()])
    return g


def test_hand_computed_flops_and_bytes() -> None:
    rep = roofline(_graph().graph, peaks=PEAKS)
    by = {(o.index, o.name): o for o in rep.ops}
    mm = by[(0, "aten.mm")]
    assert mm.flops == 2 * 8 * 32 * 16
    assert mm.bytes == (8 * 16 + 16 * 32 + 8 * 32) * F32
    sdpa = by[(1, "aten.scaled_dot_product_attention")]
    assert sdpa.flops == 2 * (2 * 4) * 8 * 8 * (16 + 16)  # QK^T + PV per batch*head
    assert sdpa.bytes == 4 * (2 * 4 * 8 * 16) * F32  # q, k, v read, out written
    causal = by[(2, "aten.scaled_dot_product_attention")]
    assert causal.flops == sdpa.flops // 2
    ln = by[(3, "aten.layer_norm")]
    assert ln.flops == 4 * 8 * 16  # one FLOP per element (ops/cost.py elementwise model)
    assert ln.bytes == (4 * 8 * 16 + 16 + 16) * F32 + 4 * 8 * 16 * F32
    # estimates: work split over the op's 2 devices, max of compute and memory time
    assert mm.num_devices == 2
    assert mm.time_s == pytest.approx(max(mm.flops / 2 / 1e9, mm.bytes / 2 / 1e9))
    assert mm.bound == "compute" and mm.intensity == pytest.approx(8192 / 3584)
    assert ln.bound == "memory" and ln.time_s == pytest.approx(ln.bytes / 2 / 1e9)
    red = rep.ops[-1]
    assert red.name == "redistribute" and red.comm_bytes > 0 and red.bound == "comm"
    assert red.time_s == pytest.approx(red.comm_bytes / 2 / 1e8)
    assert rep.top(1)[0] is max(rep.ops, key=lambda o: o.time_s)
    assert rep.by_name()[0][0] == rep.top(1)[0].name


def test_table_png_and_peaks(tmp_path: Path) -> None:
    rep = roofline(_graph().graph, peaks=PEAKS)
    table = rep.table(3)
    assert "aten.scaled_dot_product_attention" in table and "compute" in table and table.count("\n") == 5
    assert rep.save_png(tmp_path / "roof.png").stat().st_size > 1000
    assert GPU_TABLE["H200"].mem_bw > GPU_TABLE["H100"].mem_bw > GPU_TABLE["A100"].mem_bw
    assert GPU_TABLE["H100"].flops_for(torch.bfloat16) > GPU_TABLE["H100"].flops_for(torch.float32)
    cpu = measure_peaks("cpu", size=64, copy_mib=2)
    assert cpu.flops["fp32"] > 1e6 and cpu.mem_bw > 1e6


def test_cli_roofline(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from torch_dtorch.cli import main

    png = tmp_path / "r.png"
    assert (
        main(["roofline", "--device", "H100", "--seq", "8", "--dim", "16", "--top", "5", "--png", str(png)])
        == 0
    )
    out = capsys.readouterr().out
    assert "roofline on H100" in out and "redistribute" in out and "memory" in out and png.exists()
