"""The steady-state cost of an eager training step (issue 24): after a few warm-up steps, how many calls a step
plans in full on the controller (``GraphConstructor.num_planned``) and which ops the workers run on their general
Python path (``Worker.general``) instead of replaying a resolved call. A regression — an op of a training step
falling off the fast path — fails here with the op named. Thread mode (the counters live on worker threads).

Tiny models: a transformers ``LlamaForCausalLM`` from a random tiny config, float32 and bfloat16 (forward with its
KV cache, loss, backward, ``clip_grad_norm_``, ``AdamW(foreach=True)``) and the MLP of the training tests (SGD with momentum),
on a 1-device mesh and on a 2-device ``dp`` mesh with the batch sharded.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import torch_dtorch as dt
from tests.eager.conftest import TEST_MODE, init_mesh
from tests.training.models import MLP
from torch_dtorch import Replicate, Shard
from torch_dtorch.device.state import get_session
from torch_dtorch.nn import replicate_module

pytestmark = pytest.mark.skipif(TEST_MODE != "thread", reason="counts the worker threads' general path")

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _counts(mesh: dt.DeviceMesh, step: Callable[[], Any], *, warm: int = 3) -> tuple[int, Counter[str]]:
    """Calls planned in full and ops run on the workers' general path (summed over the mesh) in one step after
    ``warm`` steps."""
    for _ in range(warm):
        step()
    dt.sync()
    ex = get_session().executor
    workers = [w for w in ex.runner.workers.values() if w.device in mesh.devices]

    def general() -> Counter[str]:
        return sum((Counter(w.general) for w in workers), Counter())

    planned, g0 = ex.constructor.num_planned, general()
    step()
    dt.sync()
    return ex.constructor.num_planned - planned, general() - g0


def _llama_step(n: int, dtype: torch.dtype = torch.float32) -> tuple[dt.DeviceMesh, Callable[[], Any]]:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).to(dtype).train()  # (bf16: RMSNorm casts to float32 and back)
    mesh = init_mesh((n,), mesh_dim_names=("dp",))
    replicate_module(model, mesh)
    dt.match_grad_placements(model)
    ids = torch.randint(0, 64, (2 * n, 8), generator=torch.Generator().manual_seed(1))
    inputs = dt.distribute_tensor(ids, mesh, [Shard(0) if n > 1 else Replicate()])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)

    def step() -> Any:
        opt.zero_grad(set_to_none=True)
        loss = model(input_ids=inputs, labels=inputs).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
        opt.step()
        return loss.detach()

    return mesh, step


def _mlp_step(n: int) -> tuple[dt.DeviceMesh, Callable[[], Any]]:
    torch.manual_seed(0)
    model = MLP()
    mesh = init_mesh((n,), mesh_dim_names=("dp",))
    replicate_module(model, mesh)
    dt.match_grad_placements(model)
    g = torch.Generator().manual_seed(1)
    x = dt.distribute_tensor(torch.randn(4 * n, 6, generator=g), mesh, [Shard(0)])
    y = dt.distribute_tensor(torch.randint(0, 5, (4 * n,), generator=g), mesh, [Shard(0)])
    opt = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9, foreach=True)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.9)

    def step() -> Any:
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        sched.step()
        return loss.detach()

    return mesh, step


#: the list ops of an optimizer step in place, on the workers' general path (one whole-list call per op and device:
#: their kernels return the written list and run with each call's scalars; a fixed number per step, whatever the
#: model's size). Out-of-place ones (``_foreach_sqrt``, ``_foreach_norm``) are replayed.
ADAMW_GENERAL = {
    "aten._foreach_lerp_.Scalar": 1,  # exp_avg
    "aten._foreach_mul_.Scalar": 2,  # exp_avg_sq, weight decay
    "aten._foreach_addcmul_.Scalar": 1,
    "aten._foreach_div_.ScalarList": 1,
    "aten._foreach_add_.Scalar": 1,
    "aten._foreach_addcdiv_.ScalarList": 1,
}
CLIP_GENERAL = {"aten._foreach_mul_.Tensor": 1}
SGD_GENERAL = {"aten._foreach_mul_.Scalar": 1, "aten._foreach_add_.List": 2}
#: with the batch sharded, the mean loss exchanges the ranks' sums and weights: a communicating kernel
DP_GENERAL = {"aten.nll_loss_forward": 1}


def _times(counts: dict[str, int], n: int) -> Counter[str]:
    return Counter({k: v * n for k, v in counts.items()})


@pytest.mark.parametrize(
    ("n", "dtype"),
    [(1, torch.float32), (2, torch.float32), (1, torch.bfloat16)],
    ids=["1dev", "dp2", "1dev-bf16"],
)
def test_llama_training_step_counts(n: int, dtype: torch.dtype) -> None:
    mesh, step = _llama_step(n, dtype)
    planned, general = _counts(mesh, step)
    assert planned == 0, "a steady Llama training step planned calls in full"
    want = (
        _times(ADAMW_GENERAL, n) + _times(CLIP_GENERAL, n) + (_times(DP_GENERAL, n) if n > 1 else Counter())
    )
    assert general == want, f"worker general path: got {dict(general)}, want {dict(want)}"


@pytest.mark.parametrize("n", [1, 2], ids=["1dev", "dp2"])
def test_mlp_training_step_counts(n: int) -> None:
    mesh, step = _mlp_step(n)
    planned, general = _counts(mesh, step)
    assert planned == 0, "a steady MLP training step planned calls in full"
    want = _times(SGD_GENERAL, n) + (_times(DP_GENERAL, n) if n > 1 else Counter())
    assert general == want, f"worker general path: got {dict(general)}, want {dict(want)}"
