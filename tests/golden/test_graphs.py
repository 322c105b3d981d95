"""Golden LogicalGraph printouts built through the GraphConstructor API (refresh: EXPECTTEST_ACCEPT=1)."""

from __future__ import annotations

import torch
from expecttest import TestCase

from torch_dtorch.apps.demo import build_block, reference
from torch_dtorch.executor import GraphConstructor
from torch_dtorch.executor.reference import ReferenceExecutor
from torch_dtorch.mesh import DeviceMesh
from torch_dtorch.placement import Partial, Replicate, Shard

aten = torch.ops.aten
R = Replicate()


def mesh2x2() -> DeviceMesh:
    return DeviceMesh.from_shape("cpu", (2, 2), mesh_dim_names=("dp", "tp"))


class GoldenGraphs(TestCase):
    def test_mlp_block(self) -> None:
        mesh = mesh2x2()
        g = GraphConstructor(default_mesh=mesh)
        x = g.input((8, 16), mesh, [Shard(0), R], tag="x")
        w1 = g.input((16, 32), mesh, [R, Shard(1)], tag="w1")
        b1 = g.input((32,), mesh, [R, Shard(0)], tag="b1")
        w2 = g.input((32, 16), mesh, [R, Shard(0)], tag="w2")
        h = g.call(aten.relu.default, g.call(aten.add.Tensor, g.call(aten.mm.default, x, w1), b1))
        y = g.call(aten.mm.default, h, w2)
        g.redistribute(y, [Shard(0), R])
        self.assertExpectedInline(
            str(g.graph),
            """\
%0 = input() -> f32[8, 16] S(0)R  # x
%1 = input() -> f32[16, 32] RS(1)  # w1
%2 = input() -> f32[32] RS(0)  # b1
%3 = input() -> f32[32, 16] RS(0)  # w2
%4 = aten.mm(%0: S(0)R, %1: RS(1)) -> f32[8, 32] S(0)S(1)
%5 = aten.add.Tensor(%4: S(0)S(1), %2: RS(0)) -> f32[8, 32] S(0)S(1)
%6 = aten.relu(%5: S(0)S(1)) -> f32[8, 32] S(0)S(1)
%7 = aten.mm(%6: S(0)S(1), %3: RS(0)) -> f32[8, 16] S(0)P(sum)
%8 = redistribute(%7: S(0)P(sum)) -> f32[8, 16] S(0)R  # all_reduce(axis=1, op=sum)""",
        )

    def test_attention_block(self) -> None:
        mesh = mesh2x2()
        g = GraphConstructor(default_mesh=mesh)
        dims = {"batch": 4, "seq": 6, "dim": 16, "heads": 4}
        ins, y = build_block(g, mesh, **dims)
        g.redistribute(y, [R, R])
        self.assertExpectedInline(
            str(g.graph),
            """\
%0 = input() -> f32[4, 6, 16] S(0)R  # x
%1 = input() -> f32[16, 16] RS(0)  # wq
%2 = input() -> f32[16, 16] RS(0)  # wk
%3 = input() -> f32[16, 16] RS(0)  # wv
%4 = input() -> f32[16, 16] RS(1)  # wo
%5 = input() -> f32[64, 16] RS(0)  # w1
%6 = input() -> f32[16, 64] RS(1)  # w2
%7 = aten.linear(%0: S(0)R, %1: RS(0)) -> f32[4, 6, 16] S(0)S(2)
%8 = aten.view(%7: S(0)S(2), [4, 6, 4, 4]) -> f32[4, 6, 4, 4] S(0)S(2)
%9 = aten.transpose.int(%8: S(0)S(2), 1, 2) -> f32[4, 4, 6, 4] S(0)S(1)
%10 = aten.linear(%0: S(0)R, %2: RS(0)) -> f32[4, 6, 16] S(0)S(2)
%11 = aten.view(%10: S(0)S(2), [4, 6, 4, 4]) -> f32[4, 6, 4, 4] S(0)S(2)
%12 = aten.transpose.int(%11: S(0)S(2), 1, 2) -> f32[4, 4, 6, 4] S(0)S(1)
%13 = aten.linear(%0: S(0)R, %3: RS(0)) -> f32[4, 6, 16] S(0)S(2)
%14 = aten.view(%13: S(0)S(2), [4, 6, 4, 4]) -> f32[4, 6, 4, 4] S(0)S(2)
%15 = aten.transpose.int(%14: S(0)S(2), 1, 2) -> f32[4, 4, 6, 4] S(0)S(1)
%16 = aten.scaled_dot_product_attention(%9: S(0)S(1), %12: S(0)S(1), %15: S(0)S(1), is_causal=True) -> f32[4, 4, 6, 4] S(0)S(1)
%17 = aten.transpose.int(%16: S(0)S(1), 1, 2) -> f32[4, 6, 4, 4] S(0)S(2)
%18 = aten.reshape(%17: S(0)S(2), [4, 6, 16]) -> f32[4, 6, 16] S(0)S(2)
%19 = aten.linear(%18: S(0)S(2), %4: RS(1)) -> f32[4, 6, 16] S(0)P(sum)
%20 = redistribute(%0: S(0)R) -> f32[4, 6, 16] S(0)P(sum)  # zero_fill(axis=1, op=sum)
%21 = aten.add.Tensor(%20: S(0)P(sum), %19: S(0)P(sum)) -> f32[4, 6, 16] S(0)P(sum)
%22 = redistribute(%21: S(0)P(sum)) -> f32[4, 6, 16] S(0)R  # all_reduce(axis=1, op=sum)
%23 = aten.linear(%22: S(0)R, %5: RS(0)) -> f32[4, 6, 64] S(0)S(2)
%24 = aten.gelu(%23: S(0)S(2)) -> f32[4, 6, 64] S(0)S(2)
%25 = aten.linear(%24: S(0)S(2), %6: RS(1)) -> f32[4, 6, 16] S(0)P(sum)
%26 = aten.add.Tensor(%21: S(0)P(sum), %25: S(0)P(sum)) -> f32[4, 6, 16] S(0)P(sum)
%27 = redistribute(%26: S(0)P(sum)) -> f32[4, 6, 16] RR  # all_reduce(axis=1, op=sum); all_gather(axis=0, dim=0)""",
        )
        # and the graph computes the block: reference executor on 4 simulated ranks vs torch
        torch.manual_seed(0)
        values = {n: torch.randn(o.shape) * 0.2 for n, o in ins.items()}
        ex = ReferenceExecutor(g.graph)
        for n, o in ins.items():
            ex.feed(o, values[n])
        ex.run()
        out = g.graph.operators[-1].outputs[0]
        torch.testing.assert_close(ex.value(out), reference(values, **dims), atol=1e-5, rtol=1e-5)

    def test_redistribute_plan(self) -> None:
        mesh = mesh2x2()
        g = GraphConstructor(default_mesh=mesh)
        x = g.input((7, 6), mesh, [Partial(), Shard(1)], tag="x")
        a = g.redistribute(x, [Shard(0), Shard(0)])
        b = g.redistribute(a, [Shard(1), R])
        g.redistribute(b, [R, Partial()])
        stages = DeviceMesh.from_shape("cpu", (2, 2), mesh_dim_names=("pp", "tp")).unbind("pp")
        s0 = g.input((4, 6), stages[0], [Shard(0)], tag="stage0")
        g.redistribute(s0, [Shard(1)], device_mesh=stages[1])
        self.assertExpectedInline(
            str(g.graph),
            """\
# m0: DeviceMesh('cpu', [[0, 1], [2, 3]], mesh_dim_names=('dp', 'tp'))
# m1: DeviceMesh('cpu', [0, 1], mesh_dim_names=('tp',))
# m2: DeviceMesh('cpu', [2, 3], mesh_dim_names=('tp',))
%0 = input() -> f32[7, 6] P(sum)S(1)  # x
%4 = input() -> f32[4, 6] S(0)@m1  # stage0
%1 = redistribute(%0: P(sum)S(1)) -> f32[7, 6] S(0)S(0)  # reduce_scatter(axis=0, op=sum, dim=0); all_to_all(axis=1, 1->0)
%2 = redistribute(%1: S(0)S(0)) -> f32[7, 6] S(1)R  # all_gather(axis=1, dim=0); all_to_all(axis=0, 0->1)
%3 = redistribute(%2: S(1)R) -> f32[7, 6] RP(sum)  # all_gather(axis=0, dim=1); zero_fill(axis=1, op=sum)
%5 = redistribute(%4: S(0)@m1) -> f32[4, 6] S(1)@m2  # all_gather(axis=0, dim=0); p2p(0->2, 1->3); local_slice(axis=0, dim=1)""",
        )
