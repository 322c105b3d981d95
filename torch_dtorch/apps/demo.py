"""``dtorch demo``: a transformer block (attention + MLP) as a LogicalGraph on a simulated 2×2 (dp × tp) mesh.

It prints the graph with placements and one redistribute plan step by step, runs the graph on the reference
executor (plain torch shards, one process), then runs the same block as ordinary torch code on dtorch tensors with 4
worker threads, and compares both with single-device torch. Later issues make the demo the FLUX pipeline.
"""

from __future__ import annotations

import argparse
import logging

import torch

from torch_dtorch.executor.constructor import GraphConstructor
from torch_dtorch.executor.reference import ReferenceExecutor
from torch_dtorch.graph import Operand
from torch_dtorch.mesh import DeviceMesh
from torch_dtorch.placement import Partial, Replicate, Shard
from torch_dtorch.placement_rules.redistribute.planner import plan_redistribute

log = logging.getLogger(__name__)
aten = torch.ops.aten


def build_block(
    g: GraphConstructor, mesh: DeviceMesh, *, batch: int, seq: int, dim: int, heads: int
) -> tuple[dict[str, Operand], Operand]:
    """Megatron-style TP over "tp", batch over "dp": column-parallel QKV/up, row-parallel out/down."""
    R, S = Replicate(), Shard
    hd = dim // heads
    ins = {
        "x": g.input((batch, seq, dim), mesh, [S(0), R], tag="x"),
        "wq": g.input((dim, dim), mesh, [R, S(0)], tag="wq"),
        "wk": g.input((dim, dim), mesh, [R, S(0)], tag="wk"),
        "wv": g.input((dim, dim), mesh, [R, S(0)], tag="wv"),
        "wo": g.input((dim, dim), mesh, [R, S(1)], tag="wo"),
        "w1": g.input((4 * dim, dim), mesh, [R, S(0)], tag="w1"),
        "w2": g.input((dim, 4 * dim), mesh, [R, S(1)], tag="w2"),
    }
    x = ins["x"]

    def heads_view(t: Operand) -> Operand:
        t = g.call(aten.view.default, t, [batch, seq, heads, hd])
        return g.call(aten.transpose.int, t, 1, 2)

    q = heads_view(g.call(aten.linear.default, x, ins["wq"]))
    k = heads_view(g.call(aten.linear.default, x, ins["wk"]))
    v = heads_view(g.call(aten.linear.default, x, ins["wv"]))
    a = g.call(aten.scaled_dot_product_attention.default, q, k, v, is_causal=True)
    a = g.call(aten.transpose.int, a, 1, 2)
    a = g.call(aten.reshape.default, a, [batch, seq, dim])
    h = g.call(aten.add.Tensor, x, g.call(aten.linear.default, a, ins["wo"]))
    u = g.call(aten.gelu.default, g.call(aten.linear.default, h, ins["w1"]))
    y = g.call(aten.add.Tensor, h, g.call(aten.linear.default, u, ins["w2"]))
    return ins, y


def reference(values: dict[str, torch.Tensor], *, batch: int, seq: int, dim: int, heads: int) -> torch.Tensor:
    x, hd = values["x"], dim // heads
    F = torch.nn.functional

    def heads_view(t: torch.Tensor) -> torch.Tensor:
        return t.view(batch, seq, heads, hd).transpose(1, 2)

    q, k, v = (heads_view(F.linear(x, values[w])) for w in ("wq", "wk", "wv"))
    a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(batch, seq, dim)
    h = x + F.linear(a, values["wo"])
    return h + F.linear(F.gelu(F.linear(h, values["w1"])), values["w2"])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="dtorch demo", description=__doc__)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=6)
    p.add_argument("--dim", type=int, default=16)
    p.add_argument("--heads", type=int, default=4)
    args = p.parse_args(argv)
    dims = {"batch": args.batch, "seq": args.seq, "dim": args.dim, "heads": args.heads}

    mesh = DeviceMesh.from_shape("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    g = GraphConstructor(default_mesh=mesh)
    ins, y = build_block(g, mesh, **dims)
    out = g.redistribute(y, [Replicate(), Replicate()])
    print(f"mesh: {mesh!r}\n")
    print("LogicalGraph of one transformer block (dp x tp):")
    print(g.graph)
    print("\nredistribute plan P(sum)S(1) -> S(0)R on the 2x2 mesh:")
    print(
        plan_redistribute(
            (8, 16), mesh, [Partial(), Shard(1)], dst_mesh=mesh, dst_placements=[Shard(0), Replicate()]
        )
    )
    cost = g.graph.total_cost()
    print(
        f"\nestimated work: {cost.flops} FLOPs, {cost.bytes} bytes moved by kernels, {cost.comm_bytes} comm bytes"
    )

    torch.manual_seed(0)
    values = {name: torch.randn(o.shape) * (0.2 if name != "x" else 1.0) for name, o in ins.items()}
    ex = ReferenceExecutor(g.graph)
    for name, operand in ins.items():
        ex.feed(operand, values[name])
    ex.run()
    got = ex.value(out)
    want = reference(values, **dims)
    err = (got - want).abs().max().item()
    print(f"\nreference executor on 4 simulated ranks vs single-device torch: max abs error {err:.2e}")
    ok = torch.allclose(got, want, atol=1e-5, rtol=1e-5)

    # the same block as ordinary torch code on dtorch tensors, run by 4 worker threads
    import torch_dtorch as dt

    wmesh = dt.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dist = {name: dt.distribute_tensor(values[name], wmesh, ins[name].placements) for name in ins}
    y_workers = reference(dist, **dims)
    placements = y_workers.placements  # type: ignore[attr-defined]  # patched onto torch.Tensor by torch_dtorch
    print(f"eager on 4 worker threads: output placements {dt.placement.placements_str(placements)}")
    werr = (dt.to_torch(y_workers) - want).abs().max().item()
    print(f"workers vs single-device torch: max abs error {werr:.2e}")
    dt.shutdown()
    ok = ok and werr < 1e-5
    print("OK" if ok else "MISMATCH")
    return 0 if ok else 1
