"""Golden printouts of the compile backend (refresh: EXPECTTEST_ACCEPT=1): for each model (a) the captured aten
graph, (b) the LogicalGraph with placements, (c) device 0's local program with its collectives."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from expecttest import TestCase

import torch_dtorch as dt
from torch_dtorch import Replicate, Shard
from torch_dtorch.backend.report import CompileReport

from .models import MLP, Attention, distribute_module, tp_mlp_plan


def _report(model: Any, *args: Any) -> CompileReport:
    reports: list[CompileReport] = []
    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(model, backend="dtorch_debug", options={"reports": reports, "file": _Null()})(*args)
    assert len(reports) == 1 and reports[0].error is None, reports
    return reports[0]


class _Null:
    def write(self, text: str) -> int:
        return len(text)


class GoldenCompile(TestCase):
    def test_mlp_tensor_parallel(self) -> None:
        torch.manual_seed(0)
        mesh = dt.init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
        model = distribute_module(MLP(), mesh, tp_mlp_plan())
        r = _report(model, dt.distribute_tensor(torch.randn(4, 8), mesh, [Replicate()]))
        self.assertExpectedInline(
            r.aten,
            """\
%arg0_1 = input() -> f32[16, 8]
%arg1_1 = input() -> f32[16]
%arg2_1 = input() -> f32[4, 8]
%arg3_1 = input() -> f32[8, 16]
%arg4_1 = input() -> f32[8]
%arg5_1 = input() -> f32[8]
%arg6_1 = input() -> f32[8]
%linear = aten.linear(%arg2_1, %arg0_1, %arg1_1) -> f32[4, 16]
%silu = aten.silu(%linear) -> f32[4, 16]
%linear_1 = aten.linear(%silu, %arg3_1, %arg4_1) -> f32[4, 8]
%add = aten.add.Tensor(%arg2_1, %linear_1) -> f32[4, 8]
%layer_norm = aten.layer_norm(%add, [8], %arg5_1, %arg6_1) -> f32[4, 8]
return [%layer_norm]""",
        )
        self.assertExpectedInline(
            r.logical,
            """\
%0 = input() -> f32[16, 8] S(0)  # arg0_1
%1 = input() -> f32[16] S(0)  # arg1_1
%2 = input() -> f32[4, 8] R  # arg2_1
%3 = input() -> f32[8, 16] S(1)  # arg3_1
%4 = input() -> f32[8] R  # arg4_1
%5 = input() -> f32[8] R  # arg5_1
%6 = input() -> f32[8] R  # arg6_1
%7 = aten.linear(%2: R, %0: S(0), %1: S(0)) -> f32[4, 16] S(1)
%8 = aten.silu(%7: S(1)) -> f32[4, 16] S(1)
%9 = redistribute(%4: R) -> f32[8] P(sum)  # zero_fill(axis=0, op=sum)
%10 = aten.linear(%8: S(1), %3: S(1), %9: P(sum)) -> f32[4, 8] P(sum)
%11 = redistribute(%2: R) -> f32[4, 8] P(sum)  # zero_fill(axis=0, op=sum)
%12 = aten.add.Tensor(%11: P(sum), %10: P(sum)) -> f32[4, 8] P(sum)
%13 = redistribute(%12: P(sum)) -> f32[4, 8] S(0)  # reduce_scatter(axis=0, op=sum, dim=0)
%14 = aten.layer_norm(%13: S(0), [8], %5: R, %6: R) -> f32[4, 8] S(0)""",
        )
        self.assertExpectedInline(
            r.local[0],
            """\
%0 = input() -> f32[8, 8]
%1 = input() -> f32[8]
%2 = input() -> f32[4, 8]
%3 = input() -> f32[8, 8]
%4 = input() -> f32[8]
%5 = input() -> f32[8]
%6 = input() -> f32[8]
%7 = aten.linear(%2, %0, %1) -> f32[4, 8]
%8 = aten.silu(%7) -> f32[4, 8]
%9 = redistribute(%4) -> f32[8]  # zero_fill(axis=0, op=sum)
%10 = aten.linear(%8, %3, %9) -> f32[4, 8]
%11 = redistribute(%2) -> f32[4, 8]  # zero_fill(axis=0, op=sum)
%12 = aten.add.Tensor(%11, %10) -> f32[4, 8]
%13 = redistribute(%12) -> f32[2, 8]  # reduce_scatter(axis=0, op=sum, dim=0)
%14 = aten.layer_norm(%13, [8], %5, %6) -> f32[2, 8]
return [%14]""",
        )

    def test_attention_sequence_sharded(self) -> None:
        torch.manual_seed(0)
        mesh = dt.init_device_mesh("cpu", (2,), mesh_dim_names=("sp",))
        model = distribute_module(Attention(), mesh)
        r = _report(model, dt.distribute_tensor(torch.randn(2, 4, 16), mesh, [Shard(1)]))
        self.assertExpectedInline(
            r.aten,
            """\
%arg0_1 = input() -> f32[2, 4, 16]
%arg1_1 = input() -> f32[16]
%arg2_1 = input() -> f32[16]
%arg3_1 = input() -> f32[16, 16]
%arg4_1 = input() -> f32[16, 16]
%arg5_1 = input() -> f32[16, 16]
%arg6_1 = input() -> f32[16, 16]
%layer_norm = aten.layer_norm(%arg0_1, [16], %arg1_1, %arg2_1) -> f32[2, 4, 16]
%linear = aten.linear(%layer_norm, %arg3_1) -> f32[2, 4, 16]
%view = aten.view(%linear, [2, 4, 2, 8]) -> f32[2, 4, 2, 8]
%transpose = aten.transpose.int(%view, 1, 2) -> f32[2, 2, 4, 8]
%linear_1 = aten.linear(%layer_norm, %arg4_1) -> f32[2, 4, 16]
%view_1 = aten.view(%linear_1, [2, 4, 2, 8]) -> f32[2, 4, 2, 8]
%transpose_1 = aten.transpose.int(%view_1, 1, 2) -> f32[2, 2, 4, 8]
%linear_2 = aten.linear(%layer_norm, %arg5_1) -> f32[2, 4, 16]
%view_2 = aten.view(%linear_2, [2, 4, 2, 8]) -> f32[2, 4, 2, 8]
%transpose_2 = aten.transpose.int(%view_2, 1, 2) -> f32[2, 2, 4, 8]
%scaled_dot_product_attention = aten.scaled_dot_product_attention(%transpose, %transpose_1, %transpose_2) -> f32[2, 2, 4, 8]
%transpose_3 = aten.transpose.int(%scaled_dot_product_attention, 1, 2) -> f32[2, 4, 2, 8]
%clone = aten.clone(%transpose_3, memory_format=torch.contiguous_format) -> f32[2, 4, 2, 8]
%_unsafe_view = aten._unsafe_view(%clone, [2, 4, 16]) -> f32[2, 4, 16]
%linear_3 = aten.linear(%_unsafe_view, %arg6_1) -> f32[2, 4, 16]
%add = aten.add.Tensor(%arg0_1, %linear_3) -> f32[2, 4, 16]
return [%add]""",
        )
        self.assertExpectedInline(
            r.logical,
            """\
%0 = input() -> f32[2, 4, 16] S(1)  # arg0_1
%1 = input() -> f32[16] R  # arg1_1
%2 = input() -> f32[16] R  # arg2_1
%3 = input() -> f32[16, 16] R  # arg3_1
%4 = input() -> f32[16, 16] R  # arg4_1
%5 = input() -> f32[16, 16] R  # arg5_1
%6 = input() -> f32[16, 16] R  # arg6_1
%7 = aten.layer_norm(%0: S(1), [16], %1: R, %2: R) -> f32[2, 4, 16] S(1)
%8 = aten.linear(%7: S(1), %3: R) -> f32[2, 4, 16] S(1)
%9 = aten.view(%8: S(1), [2, 4, 2, 8]) -> f32[2, 4, 2, 8] S(1)
%10 = aten.transpose.int(%9: S(1), 1, 2) -> f32[2, 2, 4, 8] S(2)
%11 = aten.linear(%7: S(1), %4: R) -> f32[2, 4, 16] S(1)
%12 = aten.view(%11: S(1), [2, 4, 2, 8]) -> f32[2, 4, 2, 8] S(1)
%13 = aten.transpose.int(%12: S(1), 1, 2) -> f32[2, 2, 4, 8] S(2)
%14 = aten.linear(%7: S(1), %5: R) -> f32[2, 4, 16] S(1)
%15 = aten.view(%14: S(1), [2, 4, 2, 8]) -> f32[2, 4, 2, 8] S(1)
%16 = aten.transpose.int(%15: S(1), 1, 2) -> f32[2, 2, 4, 8] S(2)
%17 = redistribute(%10: S(2)) -> f32[2, 2, 4, 8] S(0)  # all_to_all(axis=0, 2->0)
%18 = redistribute(%13: S(2)) -> f32[2, 2, 4, 8] S(0)  # all_to_all(axis=0, 2->0)
%19 = redistribute(%16: S(2)) -> f32[2, 2, 4, 8] S(0)  # all_to_all(axis=0, 2->0)
%20 = aten.scaled_dot_product_attention(%17: S(0), %18: S(0), %19: S(0)) -> f32[2, 2, 4, 8] S(0)
%21 = aten.transpose.int(%20: S(0), 1, 2) -> f32[2, 4, 2, 8] S(0)
%22 = aten.clone(%21: S(0), memory_format=torch.contiguous_format) -> f32[2, 4, 2, 8] S(0)
%23 = aten._unsafe_view(%22: S(0), [2, 4, 16]) -> f32[2, 4, 16] S(0)
%24 = aten.linear(%23: S(0), %6: R) -> f32[2, 4, 16] S(0)
%25 = redistribute(%0: S(1)) -> f32[2, 4, 16] S(0)  # all_to_all(axis=0, 1->0)
%26 = aten.add.Tensor(%25: S(0), %24: S(0)) -> f32[2, 4, 16] S(0)""",
        )
        self.assertExpectedInline(
            r.local[0],
            """\
%0 = input() -> f32[2, 2, 16]
%1 = input() -> f32[16]
%2 = input() -> f32[16]
%3 = input() -> f32[16, 16]
%4 = input() -> f32[16, 16]
%5 = input() -> f32[16, 16]
%6 = input() -> f32[16, 16]
%7 = aten.layer_norm(%0, [16], %1, %2) -> f32[2, 2, 16]
%8 = aten.linear(%7, %3) -> f32[2, 2, 16]
%9 = aten.view[rule kernel](%8, [2, 2, 2, 8]) -> f32[2, 2, 2, 8]
%10 = aten.transpose.int(%9, 1, 2) -> f32[2, 2, 2, 8]
%11 = aten.linear(%7, %4) -> f32[2, 2, 16]
%12 = aten.view[rule kernel](%11, [2, 2, 2, 8]) -> f32[2, 2, 2, 8]
%13 = aten.transpose.int(%12, 1, 2) -> f32[2, 2, 2, 8]
%14 = aten.linear(%7, %5) -> f32[2, 2, 16]
%15 = aten.view[rule kernel](%14, [2, 2, 2, 8]) -> f32[2, 2, 2, 8]
%16 = aten.transpose.int(%15, 1, 2) -> f32[2, 2, 2, 8]
%17 = redistribute(%10) -> f32[1, 2, 4, 8]  # all_to_all(axis=0, 2->0)
%18 = redistribute(%13) -> f32[1, 2, 4, 8]  # all_to_all(axis=0, 2->0)
%19 = redistribute(%16) -> f32[1, 2, 4, 8]  # all_to_all(axis=0, 2->0)
%20 = aten.scaled_dot_product_attention[rule kernel](%17, %18, %19) -> f32[1, 2, 4, 8]
%21 = aten.transpose.int(%20, 1, 2) -> f32[1, 4, 2, 8]
%22 = aten.clone[rule kernel](%21, memory_format=torch.contiguous_format) -> f32[1, 4, 2, 8]
%23 = aten._unsafe_view[rule kernel](%22, [1, 4, 16]) -> f32[1, 4, 16]
%24 = aten.linear(%23, %6) -> f32[1, 4, 16]
%25 = redistribute(%0) -> f32[1, 4, 16]  # all_to_all(axis=0, 1->0)
%26 = aten.add.Tensor(%25, %24) -> f32[1, 4, 16]
return [%26]""",
        )

    def test_flux_single_block_sequence_sharded(self) -> None:
        transformer_flux = pytest.importorskip("diffusers.models.transformers.transformer_flux")
        torch.manual_seed(0)
        mesh = dt.init_device_mesh("cpu", (2,), mesh_dim_names=("sp",))
        block = transformer_flux.FluxSingleTransformerBlock(16, 2, 8, mlp_ratio=2.0).eval()
        distribute_module(block, mesh)
        h = dt.distribute_tensor(torch.randn(1, 4, 16), mesh, [Shard(1)])
        enc = dt.distribute_tensor(torch.randn(1, 2, 16), mesh, [Replicate()])
        temb = dt.distribute_tensor(torch.randn(1, 16), mesh, [Replicate()])
        r = _report(block, h, enc, temb)
        self.assertExpectedInline(
            r.aten,
            """\
%arg0_1 = input() -> f32[1, 2, 16]
%arg1_1 = input() -> f32[1, 4, 16]
%arg2_1 = input() -> f32[1, 16]
%arg3_1 = input() -> f32[48, 16]
%arg4_1 = input() -> f32[48]
%arg5_1 = input() -> f32[32, 16]
%arg6_1 = input() -> f32[32]
%arg7_1 = input() -> f32[16, 16]
%arg8_1 = input() -> f32[16]
%arg9_1 = input() -> f32[16, 16]
%arg10_1 = input() -> f32[16]
%arg11_1 = input() -> f32[16, 16]
%arg12_1 = input() -> f32[16]
%arg13_1 = input() -> f32[8]
%arg14_1 = input() -> f32[8]
%arg15_1 = input() -> f32[16, 48]
%arg16_1 = input() -> f32[16]
%cat = aten.cat([%arg0_1, %arg1_1], 1) -> f32[1, 6, 16]
%silu = aten.silu(%arg2_1) -> f32[1, 16]
%linear = aten.linear(%silu, %arg3_1, %arg4_1) -> f32[1, 48]
%split = aten.split.Tensor(%linear, 16, 1) -> (f32[1, 16], f32[1, 16], f32[1, 16])
%getitem = getitem(%split, 0) -> f32[1, 16]
%getitem_1 = getitem(%split, 1) -> f32[1, 16]
%getitem_2 = getitem(%split, 2) -> f32[1, 16]
%layer_norm = aten.layer_norm(%cat, [16], None, None, 1e-06) -> f32[1, 6, 16]
%unsqueeze = aten.unsqueeze(%getitem_1, 1) -> f32[1, 1, 16]
%add = aten.add.Tensor(%unsqueeze, 1) -> f32[1, 1, 16]
%mul = aten.mul.Tensor(%layer_norm, %add) -> f32[1, 6, 16]
%unsqueeze_1 = aten.unsqueeze(%getitem, 1) -> f32[1, 1, 16]
%add_1 = aten.add.Tensor(%mul, %unsqueeze_1) -> f32[1, 6, 16]
%linear_1 = aten.linear(%add_1, %arg5_1, %arg6_1) -> f32[1, 6, 32]
%gelu = aten.gelu(%linear_1, approximate='tanh') -> f32[1, 6, 32]
%linear_2 = aten.linear(%add_1, %arg7_1, %arg8_1) -> f32[1, 6, 16]
%linear_3 = aten.linear(%add_1, %arg9_1, %arg10_1) -> f32[1, 6, 16]
%linear_4 = aten.linear(%add_1, %arg11_1, %arg12_1) -> f32[1, 6, 16]
%view = aten.view(%linear_2, [1, 6, 2, 8]) -> f32[1, 6, 2, 8]
%view_1 = aten.view(%linear_3, [1, 6, 2, 8]) -> f32[1, 6, 2, 8]
%view_2 = aten.view(%linear_4, [1, 6, 2, 8]) -> f32[1, 6, 2, 8]
%rms_norm = aten.rms_norm(%view, [8], %arg13_1, 1e-06) -> f32[1, 6, 2, 8]
%rms_norm_1 = aten.rms_norm(%view_1, [8], %arg14_1, 1e-06) -> f32[1, 6, 2, 8]
%permute = aten.permute(%rms_norm, [0, 2, 1, 3]) -> f32[1, 2, 6, 8]
%permute_1 = aten.permute(%rms_norm_1, [0, 2, 1, 3]) -> f32[1, 2, 6, 8]
%permute_2 = aten.permute(%view_2, [0, 2, 1, 3]) -> f32[1, 2, 6, 8]
%scaled_dot_product_attention = aten.scaled_dot_product_attention(%permute, %permute_1, %permute_2) -> f32[1, 2, 6, 8]
%permute_3 = aten.permute(%scaled_dot_product_attention, [0, 2, 1, 3]) -> f32[1, 6, 2, 8]
%clone = aten.clone(%permute_3, memory_format=torch.contiguous_format) -> f32[1, 6, 2, 8]
%_unsafe_view = aten._unsafe_view(%clone, [1, 6, 16]) -> f32[1, 6, 16]
%cat_1 = aten.cat([%_unsafe_view, %gelu], 2) -> f32[1, 6, 48]
%unsqueeze_2 = aten.unsqueeze(%getitem_2, 1) -> f32[1, 1, 16]
%linear_5 = aten.linear(%cat_1, %arg15_1, %arg16_1) -> f32[1, 6, 16]
%mul_1 = aten.mul.Tensor(%unsqueeze_2, %linear_5) -> f32[1, 6, 16]
%add_2 = aten.add.Tensor(%cat, %mul_1) -> f32[1, 6, 16]
%slice_1 = aten.slice.Tensor(%add_2, 1, 0, 2) -> f32[1, 2, 16]
%slice_2 = aten.slice.Tensor(%add_2, 1, 2, 9223372036854775807) -> f32[1, 4, 16]
return [%slice_1, %slice_2]""",
        )
        self.assertExpectedInline(
            r.logical,
            """\
%0 = input() -> f32[1, 2, 16] R  # arg0_1
%1 = input() -> f32[1, 4, 16] S(1)  # arg1_1
%2 = input() -> f32[1, 16] R  # arg2_1
%3 = input() -> f32[48, 16] R  # arg3_1
%4 = input() -> f32[48] R  # arg4_1
%5 = input() -> f32[32, 16] R  # arg5_1
%6 = input() -> f32[32] R  # arg6_1
%7 = input() -> f32[16, 16] R  # arg7_1
%8 = input() -> f32[16] R  # arg8_1
%9 = input() -> f32[16, 16] R  # arg9_1
%10 = input() -> f32[16] R  # arg10_1
%11 = input() -> f32[16, 16] R  # arg11_1
%12 = input() -> f32[16] R  # arg12_1
%13 = input() -> f32[8] R  # arg13_1
%14 = input() -> f32[8] R  # arg14_1
%15 = input() -> f32[16, 48] R  # arg15_1
%16 = input() -> f32[16] R  # arg16_1
%17 = redistribute(%0: R) -> f32[1, 2, 16] S(2)  # local_slice(axis=0, dim=2)
%18 = redistribute(%1: S(1)) -> f32[1, 4, 16] S(2)  # all_to_all(axis=0, 1->2)
%19 = aten.cat([%17: S(2), %18: S(2)], 1) -> f32[1, 6, 16] S(2)
%20 = aten.silu(%2: R) -> f32[1, 16] R
%21 = aten.linear(%20: R, %3: R, %4: R) -> f32[1, 48] R
%22, %23, %24 = aten.split.Tensor(%21: R, 16, 1) -> (f32[1, 16] R, f32[1, 16] R, f32[1, 16] R)
%25 = redistribute(%19: S(2)) -> f32[1, 6, 16] S(1)  # all_to_all(axis=0, 2->1)
%26 = aten.layer_norm(%25: S(1), [16], None, None, 1e-06) -> f32[1, 6, 16] S(1)
%27 = aten.unsqueeze(%23: R, 1) -> f32[1, 1, 16] R
%28 = aten.add.Tensor(%27: R, 1) -> f32[1, 1, 16] R
%29 = aten.mul.Tensor(%26: S(1), %28: R) -> f32[1, 6, 16] S(1)
%30 = aten.unsqueeze(%22: R, 1) -> f32[1, 1, 16] R
%31 = aten.add.Tensor(%29: S(1), %30: R) -> f32[1, 6, 16] S(1)
%32 = aten.linear(%31: S(1), %5: R, %6: R) -> f32[1, 6, 32] S(1)
%33 = aten.gelu(%32: S(1), approximate='tanh') -> f32[1, 6, 32] S(1)
%34 = aten.linear(%31: S(1), %7: R, %8: R) -> f32[1, 6, 16] S(1)
%35 = aten.linear(%31: S(1), %9: R, %10: R) -> f32[1, 6, 16] S(1)
%36 = aten.linear(%31: S(1), %11: R, %12: R) -> f32[1, 6, 16] S(1)
%37 = aten.view(%34: S(1), [1, 6, 2, 8]) -> f32[1, 6, 2, 8] S(1)
%38 = aten.view(%35: S(1), [1, 6, 2, 8]) -> f32[1, 6, 2, 8] S(1)
%39 = aten.view(%36: S(1), [1, 6, 2, 8]) -> f32[1, 6, 2, 8] S(1)
%40 = aten.rms_norm(%37: S(1), [8], %13: R, 1e-06) -> f32[1, 6, 2, 8] S(1)
%41 = aten.rms_norm(%38: S(1), [8], %14: R, 1e-06) -> f32[1, 6, 2, 8] S(1)
%42 = aten.permute(%40: S(1), [0, 2, 1, 3]) -> f32[1, 2, 6, 8] S(2)
%43 = aten.permute(%41: S(1), [0, 2, 1, 3]) -> f32[1, 2, 6, 8] S(2)
%44 = aten.permute(%39: S(1), [0, 2, 1, 3]) -> f32[1, 2, 6, 8] S(2)
%45 = redistribute(%42: S(2)) -> f32[1, 2, 6, 8] S(1)  # all_to_all(axis=0, 2->1)
%46 = redistribute(%43: S(2)) -> f32[1, 2, 6, 8] S(1)  # all_to_all(axis=0, 2->1)
%47 = redistribute(%44: S(2)) -> f32[1, 2, 6, 8] S(1)  # all_to_all(axis=0, 2->1)
%48 = aten.scaled_dot_product_attention(%45: S(1), %46: S(1), %47: S(1)) -> f32[1, 2, 6, 8] S(1)
%49 = aten.permute(%48: S(1), [0, 2, 1, 3]) -> f32[1, 6, 2, 8] S(2)
%50 = aten.clone(%49: S(2), memory_format=torch.contiguous_format) -> f32[1, 6, 2, 8] S(2)
%51 = aten._unsafe_view(%50: S(2), [1, 6, 16]) -> f32[1, 6, 16] S(2)
%52 = redistribute(%51: S(2)) -> f32[1, 6, 16] S(1)  # all_to_all(axis=0, 2->1)
%53 = aten.cat([%52: S(1), %33: S(1)], 2) -> f32[1, 6, 48] S(1)
%54 = aten.unsqueeze(%24: R, 1) -> f32[1, 1, 16] R
%55 = aten.linear(%53: S(1), %15: R, %16: R) -> f32[1, 6, 16] S(1)
%56 = aten.mul.Tensor(%54: R, %55: S(1)) -> f32[1, 6, 16] S(1)
%57 = redistribute(%19: S(2)) -> f32[1, 6, 16] S(1)  # all_to_all(axis=0, 2->1)
%58 = aten.add.Tensor(%57: S(1), %56: S(1)) -> f32[1, 6, 16] S(1)
%59 = redistribute(%58: S(1)) -> f32[1, 6, 16] S(2)  # all_to_all(axis=0, 1->2)
%60 = aten.slice.Tensor(%59: S(2), 1, 0, 2) -> f32[1, 2, 16] S(2)
%61 = redistribute(%58: S(1)) -> f32[1, 6, 16] S(2)  # all_to_all(axis=0, 1->2)
%62 = aten.slice.Tensor(%61: S(2), 1, 2, 9223372036854775807) -> f32[1, 4, 16] S(2)""",
        )
        self.assertExpectedInline(
            r.local[0],
            """\
%0 = input() -> f32[1, 2, 16]
%1 = input() -> f32[1, 2, 16]
%2 = input() -> f32[1, 16]
%3 = input() -> f32[48, 16]
%4 = input() -> f32[48]
%5 = input() -> f32[32, 16]
%6 = input() -> f32[32]
%7 = input() -> f32[16, 16]
%8 = input() -> f32[16]
%9 = input() -> f32[16, 16]
%10 = input() -> f32[16]
%11 = input() -> f32[16, 16]
%12 = input() -> f32[16]
%13 = input() -> f32[8]
%14 = input() -> f32[8]
%15 = input() -> f32[16, 48]
%16 = input() -> f32[16]
%17 = redistribute(%0) -> f32[1, 2, 8]  # local_slice(axis=0, dim=2)
%18 = redistribute(%1) -> f32[1, 4, 8]  # all_to_all(axis=0, 1->2)
%19 = aten.cat[rule kernel]([%17, %18], 1) -> f32[1, 6, 8]
%20 = aten.silu(%2) -> f32[1, 16]
%21 = aten.linear(%20, %3, %4) -> f32[1, 48]
%22, %23, %24 = aten.split.Tensor(%21, 16, 1) -> (f32[1, 16], f32[1, 16], f32[1, 16])
%25 = redistribute(%19) -> f32[1, 3, 16]  # all_to_all(axis=0, 2->1)
%26 = aten.layer_norm(%25, [16], None, None, 1e-06) -> f32[1, 3, 16]
%27 = aten.unsqueeze(%23, 1) -> f32[1, 1, 16]
%28 = aten.add.Tensor(%27, 1) -> f32[1, 1, 16]
%29 = aten.mul.Tensor(%26, %28) -> f32[1, 3, 16]
%30 = aten.unsqueeze(%22, 1) -> f32[1, 1, 16]
%31 = aten.add.Tensor(%29, %30) -> f32[1, 3, 16]
%32 = aten.linear(%31, %5, %6) -> f32[1, 3, 32]
%33 = aten.gelu(%32, approximate='tanh') -> f32[1, 3, 32]
%34 = aten.linear(%31, %7, %8) -> f32[1, 3, 16]
%35 = aten.linear(%31, %9, %10) -> f32[1, 3, 16]
%36 = aten.linear(%31, %11, %12) -> f32[1, 3, 16]
%37 = aten.view[rule kernel](%34, [1, 3, 2, 8]) -> f32[1, 3, 2, 8]
%38 = aten.view[rule kernel](%35, [1, 3, 2, 8]) -> f32[1, 3, 2, 8]
%39 = aten.view[rule kernel](%36, [1, 3, 2, 8]) -> f32[1, 3, 2, 8]
%40 = aten.rms_norm(%37, [8], %13, 1e-06) -> f32[1, 3, 2, 8]
%41 = aten.rms_norm(%38, [8], %14, 1e-06) -> f32[1, 3, 2, 8]
%42 = aten.permute(%40, [0, 2, 1, 3]) -> f32[1, 2, 3, 8]
%43 = aten.permute(%41, [0, 2, 1, 3]) -> f32[1, 2, 3, 8]
%44 = aten.permute(%39, [0, 2, 1, 3]) -> f32[1, 2, 3, 8]
%45 = redistribute(%42) -> f32[1, 1, 6, 8]  # all_to_all(axis=0, 2->1)
%46 = redistribute(%43) -> f32[1, 1, 6, 8]  # all_to_all(axis=0, 2->1)
%47 = redistribute(%44) -> f32[1, 1, 6, 8]  # all_to_all(axis=0, 2->1)
%48 = aten.scaled_dot_product_attention[rule kernel](%45, %46, %47) -> f32[1, 1, 6, 8]
%49 = aten.permute(%48, [0, 2, 1, 3]) -> f32[1, 6, 1, 8]
%50 = aten.clone[rule kernel](%49, memory_format=torch.contiguous_format) -> f32[1, 6, 1, 8]
%51 = aten._unsafe_view[rule kernel](%50, [1, 6, 8]) -> f32[1, 6, 8]
%52 = redistribute(%51) -> f32[1, 3, 16]  # all_to_all(axis=0, 2->1)
%53 = aten.cat[rule kernel]([%52, %33], 2) -> f32[1, 3, 48]
%54 = aten.unsqueeze(%24, 1) -> f32[1, 1, 16]
%55 = aten.linear(%53, %15, %16) -> f32[1, 3, 16]
%56 = aten.mul.Tensor(%54, %55) -> f32[1, 3, 16]
%57 = redistribute(%19) -> f32[1, 3, 16]  # all_to_all(axis=0, 2->1)
%58 = aten.add.Tensor(%57, %56) -> f32[1, 3, 16]
%59 = redistribute(%58) -> f32[1, 6, 8]  # all_to_all(axis=0, 1->2)
%60 = aten.slice.Tensor(%59, 1, 0, 2) -> f32[1, 2, 8]
%61 = redistribute(%58) -> f32[1, 6, 8]  # all_to_all(axis=0, 1->2)
%62 = aten.slice.Tensor(%61, 1, 2, 9223372036854775807) -> f32[1, 4, 8]
return [%60, %62]""",
        )
