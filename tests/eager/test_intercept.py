"""Each user-level call reaches the dtorch device as its rule's overload, whole: views and composite ops are not
decomposed into as_strided / addmm.out / the ~26 math-path calls of attention before our kernel sees them."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import torch_dtorch as dt
from tests.eager.conftest import init_mesh
from torch_dtorch import Replicate, Shard
from torch_dtorch.device.state import get_session

aten = torch.ops.aten

CASES: list[tuple[str, Callable[[Any, Any], Any], Any]] = [
    ("linear", lambda x, w: F.linear(x, w), aten.linear.default),
    ("matmul", lambda x, w: x @ w.t(), aten.matmul.default),
    ("einsum", lambda x, w: torch.einsum("bk,nk->bn", x, w), aten.einsum.default),
    ("t", lambda x, w: x.t(), aten.t.default),
    ("transpose", lambda x, w: x.transpose(0, 1), aten.transpose.int),
    ("permute", lambda x, w: x.permute(1, 0), aten.permute.default),
    ("view", lambda x, w: x.view(2, 4, 4), aten.view.default),
    ("reshape", lambda x, w: x.reshape(8, 4), aten.reshape.default),
    ("slice", lambda x, w: x[:, 1:5], aten.slice.Tensor),
    ("select", lambda x, w: x[:, 2], aten.select.int),
    ("chunk", lambda x, w: x.chunk(2, dim=1), aten.chunk.default),
    ("split", lambda x, w: x.split(3, dim=1), aten.split.Tensor),
    ("narrow", lambda x, w: x.narrow(1, 0, 4), aten.narrow.default),
    ("unsqueeze", lambda x, w: x.unsqueeze(0), aten.unsqueeze.default),
    ("expand", lambda x, w: x[:1].expand(4, 8), aten.expand.default),
    ("flatten", lambda x, w: x.flatten(), aten.flatten.using_ints),
    ("softmax", lambda x, w: torch.softmax(x, -1), aten.softmax.int),
    ("layer_norm", lambda x, w: F.layer_norm(x, (8,)), aten.layer_norm.default),
    ("rms_norm", lambda x, w: F.rms_norm(x, (8,)), aten.rms_norm.default),
    (
        "sdpa",
        lambda x, w: F.scaled_dot_product_attention(x, x, x),
        aten.scaled_dot_product_attention.default,
    ),
]


@pytest.mark.parametrize("grad", [False, True], ids=["inference_mode", "requires_grad_under_no_grad"])
@pytest.mark.parametrize(("name", "fn", "overload"), CASES, ids=[c[0] for c in CASES])
def test_call_delivers_its_overload(
    name: str, fn: Callable[[Any, Any], Any], overload: Any, grad: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    mesh = init_mesh((2,))
    x = dt.distribute_tensor(torch.randn(4, 8), mesh, [Shard(0)])
    q = dt.distribute_tensor(torch.randn(1, 2, 4, 4), mesh, [Shard(1)])
    w = dt.distribute_tensor(torch.randn(6, 8, requires_grad=grad), mesh, [Replicate()])
    seen: list[Any] = []
    # every recorded operator (full path and fast path alike) reaches the executor's listeners
    listeners = get_session().executor.constructor.listeners
    monkeypatch.setattr(
        get_session().executor.constructor, "listeners", [*listeners, lambda n: seen.append(n.op)]
    )
    ctx = torch.no_grad() if grad else torch.inference_mode()
    with ctx:
        fn(q if name == "sdpa" else x, w)
    # the call's own overload arrives last and whole (set-up views before it are the lambda's own calls)
    assert seen and seen[-1] == overload, f"{name}: the device saw {[str(o) for o in seen]}"
    assert aten.as_strided.default not in seen
