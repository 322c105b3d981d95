"""Parity with inductor: on a 1-device mesh, what the worker's inductor compiles for ``backend="dtorch"`` is no more
than what plain ``torch.compile`` compiles for the same module — counted, not timed (``backend/parity.py``,
``bench/compile_parity.py``): generated kernel launches, copy-only kernels, post-grad copies, buffers, extern calls,
and the parameters inductor treats as static (not alignment-checked per call, not copied into a CUDA graph)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import torch_dtorch as dt
from torch_dtorch.backend.parity import InductorCapture, code_counts, side_by_side, totals

from .models import MLP, Attention, distribute_module

#: counts dtorch may not exceed, and counts it must match
NO_MORE = (
    "kernel launches",
    "distinct kernels",
    "copy-only kernel launches",
    "post-grad copies (clone/copy_/_to_copy)",
    "post-grad ops",
    "buffers (empty_strided)",
    "wrapper copies (.copy_/.clone)",
    "inputs alignment-checked per call",
)
SAME = ("graphs", "extern calls", "aten fallback calls", "inputs", "static inputs")


class Block(nn.Module):
    """A small pre-norm transformer block: attention (SDPA) then an MLP, both residual."""

    def __init__(self, dim: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.attn = Attention(dim, heads)
        self.mlp = MLP(dim, 2 * dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.attn(x))


def _counts(run: Callable[[], Any]) -> dict[str, int]:
    torch._dynamo.reset()
    with InductorCapture() as cap, torch.no_grad():
        run()
    assert cap.graphs, "inductor compiled nothing"
    return totals(cap.graphs)


def _assert_parity(plain: dict[str, int], ours: dict[str, int]) -> None:
    table = side_by_side(plain, ours)
    for key in NO_MORE:
        assert ours.get(key, 0) <= plain.get(key, 0), f"dtorch compiles more {key!r}:\n{table}"
    for key in SAME:
        assert ours.get(key, 0) == plain.get(key, 0), f"{key!r} differ:\n{table}"


def _block() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return Block().eval(), torch.randn(2, 16, 32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_block_on_one_device_compiles_like_inductor(dtype: torch.dtype) -> None:
    model, x = _block()
    model, x = model.to(dtype), x.to(dtype)
    ref = model(x)
    plain = _counts(lambda: torch.compile(model)(x))
    mesh = dt.init_device_mesh("cpu", (1,))
    distribute_module(model, mesh)
    compiled = torch.compile(model, backend="dtorch", options={"worker_compiler": "inductor"})
    box: dict[str, torch.Tensor] = {}
    ours = _counts(lambda: box.setdefault("y", compiled(dt.distribute_tensor(x, mesh)).full_tensor()))
    _assert_parity(plain, ours)
    assert plain["static inputs"] == len(list(model.parameters()))  # the check means something
    torch.testing.assert_close(box["y"], ref, rtol=2e-2, atol=2e-2)


def test_plain_inputs_compile_like_inductor() -> None:
    """Plain CPU tensors under ``backend="dtorch"``: the captured graph compiled by inductor in the calling thread."""
    model, x = _block()
    plain = _counts(lambda: torch.compile(model)(x))
    ours = _counts(lambda: torch.compile(model, backend="dtorch", options={"worker_compiler": "inductor"})(x))
    _assert_parity(plain, ours)


def test_counts_see_a_copy() -> None:
    """The counters are not blind: a ``contiguous()`` of a transpose is a copy-only kernel and a post-grad clone."""

    def f(x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x.t().contiguous()).sum(0) + x.t().contiguous().mm(x)[0]

    counts = _counts(lambda: torch.compile(f)(torch.randn(8, 8)))
    assert counts["kernel launches"] >= 1 and counts["extern calls"] == 1, counts
    c = code_counts("def call(args):\n    buf0 = empty_strided_cpu((2, 2), (2, 1), torch.float32)\n"
                    "    cpp_fused_clone_0(arg0_1, buf0)\n    extern_kernels.mm(buf0, buf0, out=buf1)\n"
                    "cpp_fused_clone_0 = async_compile.cpp_pybinding(['float*'], r'''x''')")  # fmt: skip
    assert (c.kernels, c.copy_kernels, c.buffers, dict(c.extern)) == (1, 1, 1, {"mm": 1})
