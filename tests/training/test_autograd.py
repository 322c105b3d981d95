"""Eager autograd through dtorch tensors: the gradients of every input equal single-device torch's, for the ops an
MLP / transformer block is built of, over Shard/Replicate inputs, uneven shards, 1-D and 2-D meshes."""

from __future__ import annotations

import gc
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
import torch
import torch.nn.functional as F

import torch_dtorch as dt
from tests.eager.conftest import thread_only
from tests.training.conftest import init_mesh
from torch_dtorch import Partial, Replicate, Shard
from torch_dtorch.device.dispatch import operand_of
from torch_dtorch.device.state import get_session
from torch_dtorch.errors import BackwardNotSupportedError
from torch_dtorch.nn import replicate_module

R = Replicate()


@dataclass
class Case:
    name: str
    fn: Callable[..., torch.Tensor]
    #: each input: a float tensor (gets a gradient) or an integer tensor (indices, targets)
    inputs: Callable[[], list[torch.Tensor]]
    #: placements per input, per mesh shape
    layouts: dict[tuple[int, ...], list[list]] = field(default_factory=dict)


def _randn(*shape: int) -> Callable[[], torch.Tensor]:
    return lambda: torch.randn(*shape)


def _ints(high: int, *shape: int) -> Callable[[], torch.Tensor]:
    return lambda: torch.randint(0, high, shape)


def _bool_mask(*shape: int) -> Callable[[], torch.Tensor]:
    """A random bool attention mask whose every row keeps its first key (no row fully masked)."""

    def make() -> torch.Tensor:
        m = torch.rand(*shape) > 0.4
        m[..., 0] = True
        return m

    return make


def _make(*makers: Callable[[], torch.Tensor]) -> Callable[[], list[torch.Tensor]]:
    return lambda: [m() for m in makers]


S0, S1, S2 = Shard(0), Shard(1), Shard(2)
CASES = [
    Case(
        "linear",
        lambda x, w, b: F.linear(x, w, b),
        _make(_randn(5, 6), _randn(4, 6), _randn(4)),
        {(2,): [[S0], [R], [R]], (3,): [[R], [S0], [S0]], (2, 2): [[S0, R], [R, S0], [R, S0]]},
    ),
    Case(
        "linear_rowwise",
        lambda x, w, b: F.linear(x, w, b),
        _make(_randn(5, 7), _randn(4, 7), _randn(4)),
        {(2,): [[S1], [S1], [R]], (3,): [[S1], [S1], [R]], (2, 2): [[S0, S1], [R, S1], [R, R]]},
    ),
    Case(
        "matmul_3d",
        lambda x, w: torch.relu(x @ w),
        _make(_randn(2, 5, 6), _randn(6, 4)),
        {(2,): [[S0], [S1]], (3,): [[S1], [R]], (2, 2): [[S1, R], [R, S1]]},
    ),
    Case(
        "gelu_silu_tanh",
        lambda x: F.gelu(x) + F.silu(x) * torch.tanh(x),
        _make(_randn(5, 7)),
        {(2,): [[S1]], (3,): [[S0]], (2, 2): [[S0, S1]]},
    ),
    Case(
        "layer_norm",
        lambda x, w, b: F.layer_norm(x, (8,), w, b),
        _make(_randn(5, 3, 8), _randn(8), _randn(8)),
        {(2,): [[S0], [R], [R]], (3,): [[S1], [R], [R]], (2, 2): [[S0, S1], [R, R], [R, R]]},
    ),
    Case(
        "layer_norm_sharded_normalized_dim",
        lambda x, w, b: F.layer_norm(x, (8,), w, b),
        _make(_randn(5, 8), _randn(8), _randn(8)),
        {(2,): [[S1], [S0], [R]]},
    ),
    Case(
        "rms_norm",
        lambda x, w: F.rms_norm(x, (8,), w),
        _make(_randn(5, 8), _randn(8)),
        {(2,): [[S0], [R]], (3,): [[S0], [R]], (2, 2): [[S0, R], [R, R]]},
    ),
    Case(
        "softmax_log_softmax",
        lambda x: F.softmax(x, -1) * F.log_softmax(x, -1),
        _make(_randn(5, 7)),
        {(2,): [[S0]], (3,): [[S1]], (2, 2): [[S0, R]]},
    ),
    Case(
        "cross_entropy",
        lambda x, t: F.cross_entropy(x, t),
        _make(_randn(5, 7), _ints(7, 5)),
        {(2,): [[S0], [S0]], (3,): [[S0], [R]], (2, 2): [[S0, R], [S0, R]]},
    ),
    Case(
        "cross_entropy_3d_ignore",
        lambda x, t: F.cross_entropy(x.transpose(1, 2), t, ignore_index=2),
        _make(_randn(3, 5, 7), _ints(7, 3, 5)),
        {(2,): [[S0], [S0]], (3,): [[S1], [S1]]},
    ),
    Case(
        "mse",
        lambda x, y: F.mse_loss(x, y),
        _make(_randn(5, 3), _randn(5, 3)),
        {(2,): [[S1], [S1]], (3,): [[S0], [R]], (2, 2): [[S0, S1], [S0, S1]]},
    ),
    Case(
        "embedding",
        lambda w, i: F.embedding(i, w),
        _make(_randn(11, 4), _ints(11, 5, 3)),
        {(2,): [[R], [S0]], (3,): [[S1], [R]], (2, 2): [[R, S1], [S0, R]]},
    ),
    Case(
        "embedding_vocab_parallel",
        lambda w, i: F.embedding(i, w),
        _make(_randn(11, 4), _ints(11, 5, 3)),
        {(2,): [[S0], [R]], (3,): [[S0], [R]]},
    ),
    Case(
        "sdpa_causal",
        lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
        _make(_randn(1, 2, 5, 4), _randn(1, 2, 5, 4), _randn(1, 2, 5, 4)),
        {(2,): [[S1], [S1], [S1]], (3,): [[R], [R], [R]]},
    ),
    Case(  # a bool mask: torch's fused CPU kernel takes only q's dtype, so the blockwise kernel runs it
        "sdpa_bool_mask",
        lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, attn_mask=m),
        _make(_randn(1, 2, 5, 4), _randn(1, 2, 5, 4), _randn(1, 2, 5, 4), _bool_mask(5, 5)),
        {(1,): [[R], [R], [R], [R]], (2,): [[S1], [S1], [S1], [R]], (3,): [[S2], [R], [R], [S0]]},
    ),
    Case(
        "reductions",
        lambda x: x.mean(-1).pow(2).sum() + x.amax(0).sum() + x.var(1).sum(),
        _make(_randn(5, 6)),
        {(2,): [[S0]], (3,): [[S1]], (2, 2): [[S0, S1]]},
    ),
    Case(
        "views_cat",
        lambda x, y: torch.cat([x.view(5, 2, 3).transpose(1, 2), y.unsqueeze(-1).expand(5, 3, 2)], 0).sum(1),
        _make(_randn(5, 6), _randn(5, 3)),
        {(2,): [[S0], [S1]], (3,): [[S0], [S0]], (2, 2): [[S0, R], [R, S1]]},
    ),
]


PARAMS = [
    pytest.param(c, shape, id=f"{c.name}-{'x'.join(map(str, shape))}") for c in CASES for shape in c.layouts
]


@pytest.mark.parametrize(("case", "mesh_shape"), PARAMS)
def test_input_gradients_equal_torch(case: Case, mesh_shape: tuple[int, ...]) -> None:
    torch.manual_seed(0)
    mesh = init_mesh(mesh_shape)
    values = case.inputs()
    refs = [v.clone().requires_grad_(v.is_floating_point()) for v in values]
    ours = [
        dt.distribute_tensor(v, mesh, pl).requires_grad_(v.is_floating_point())
        for v, pl in zip(values, case.layouts[mesh_shape], strict=True)
    ]
    want = case.fn(*refs)
    weight = torch.randn(want.shape)  # a non-uniform upstream gradient
    (want * weight).sum().backward()
    got = case.fn(*ours)
    assert got.grad_fn is not None
    torch.testing.assert_close(got.detach().full_tensor(), want.detach(), atol=1e-5, rtol=1e-5)
    (got * dt.distribute_tensor(weight, mesh)).sum().backward()
    for i, (r, o) in enumerate(zip(refs, ours, strict=True)):
        if r.grad is None:
            assert o.grad is None
            continue
        assert o.grad is not None, f"input {i}: no gradient"
        torch.testing.assert_close(o.grad.full_tensor(), r.grad, atol=2e-5, rtol=1e-5, msg=f"input {i}")


def test_redistribute_is_differentiable() -> None:
    """Backward of ``redistribute`` moves the gradient back to the source placements (Partial as Replicate)."""
    mesh = init_mesh((2,))
    x = torch.randn(5, 4)
    xs = dt.distribute_tensor(x, mesh, [Shard(0)]).requires_grad_()
    y = xs.redistribute(mesh, [Shard(1)]).redistribute(mesh, [R])
    assert y.grad_fn is not None
    (y * y).sum().backward()
    assert xs.grad.placements == (Shard(0),)
    torch.testing.assert_close(xs.grad.full_tensor(), 2 * x)
    p = dt.distribute_tensor(x, mesh, [Partial()]).requires_grad_()
    (p.redistribute(mesh, [R]) * 3).sum().backward()
    assert p.grad.placements == (R,)
    torch.testing.assert_close(p.grad.full_tensor(), torch.full_like(x, 3.0))


def test_full_tensor_is_differentiable() -> None:
    mesh = init_mesh((3,))
    x = torch.randn(5, 4)
    xs = dt.distribute_tensor(x, mesh, [Shard(0)]).requires_grad_()
    full = (xs * 2).full_tensor()
    assert full.device.type == "cpu" and full.grad_fn is not None
    full.pow(2).sum().backward()
    assert xs.grad.placements == (Shard(0),)
    torch.testing.assert_close(xs.grad.full_tensor(), 8 * x)


@thread_only  # reads the worker threads' blobs
def test_gradients_accumulate_and_zero_grad_frees() -> None:
    mesh = init_mesh((2,))
    w0 = torch.randn(6, 4)
    w = torch.nn.Parameter(dt.distribute_tensor(w0, mesh, [Shard(1)]))
    x = dt.distribute_tensor(torch.randn(3, 6), mesh, [R])
    for _ in range(2):
        (x @ w).pow(2).sum().backward()
    ref = w0.clone().requires_grad_()
    xr = x.full_tensor()
    for _ in range(2):
        (xr @ ref).pow(2).sum().backward()
    torch.testing.assert_close(w.grad.full_tensor(), ref.grad)
    assert w.grad.placements == (Shard(1),)
    grad_id = operand_of(w.grad).id
    dt.sync()
    workers = {d: wk for d, wk in get_session().executor.runner.workers.items() if d in mesh.devices}
    assert all(grad_id in wk.blobs for wk in workers.values())
    torch.optim.SGD([w], lr=0.1).zero_grad(set_to_none=True)
    assert w.grad is None
    gc.collect()
    dt.sync()
    assert not any(grad_id in wk.blobs for wk in workers.values()), (
        "zero_grad left the gradient on the workers"
    )


class _Square(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        (x,) = ctx.saved_tensors
        return 2 * x * g


def test_custom_autograd_function() -> None:
    mesh = init_mesh((2, 2))
    x = torch.randn(5, 3)
    xs = dt.distribute_tensor(x, mesh, [Shard(0), Shard(1)]).requires_grad_()
    _Square.apply(xs).sum().backward()
    assert xs.grad.placements == (Shard(0), Shard(1))
    torch.testing.assert_close(xs.grad.full_tensor(), 2 * x)


def test_unsupported_backward_names_the_op() -> None:
    mesh = init_mesh((2,))
    x = dt.distribute_tensor(torch.randn(4, 6, 3), mesh, [Shard(0)]).requires_grad_()
    w = dt.distribute_tensor(torch.ones(6), mesh, [R]).requires_grad_()
    loss = F.group_norm(x, 2, w).sum()
    with pytest.raises(BackwardNotSupportedError, match=r"native_group_norm_backward.*\n.*Fix:"):
        loss.backward()


def _rope(xq: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
    """Llama-2's ``apply_rotary_emb`` (pytorch/examples' fsdp_tp_example model): complex form."""
    xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
    freqs = freqs_cis.view(1, xq_.shape[1], 1, xq_.shape[-1])
    return torch.view_as_real(xq_ * freqs).flatten(3).type_as(xq)


@pytest.mark.parametrize("mesh_shape", [(2,), (2, 2)], ids=["2", "2x2"])
def test_complex_rope_gradients(mesh_shape: tuple[int, ...]) -> None:
    mesh = init_mesh(mesh_shape)
    torch.manual_seed(0)
    x = torch.randn(3, 5, 4, 8)
    freqs = torch.polar(torch.ones(5, 4), torch.randn(5, 4))
    ref = x.clone().requires_grad_()
    (_rope(ref, freqs) * torch.arange(8.0)).sum().backward()
    seq = [Shard(1)] + [Shard(2)] * (len(mesh_shape) - 1)  # sequence (and heads) sharded
    xs = dt.distribute_tensor(x, mesh, seq).requires_grad_()
    fs = dt.distribute_tensor(freqs, mesh, [Shard(0)] + [R] * (len(mesh_shape) - 1))
    out = _rope(xs, fs)
    assert out.placements == tuple(seq)
    torch.testing.assert_close(out.detach().full_tensor(), _rope(x, freqs))
    (out * dt.distribute_tensor(torch.arange(8.0), mesh)).sum().backward()
    torch.testing.assert_close(xs.grad.full_tensor(), ref.grad)


@pytest.mark.parametrize("reduction", [0, 1, 2], ids=["none", "mean", "sum"])
def test_nll_loss_keeps_the_batch_sharded(reduction: int) -> None:
    """``nll_loss_forward`` on a batch-sharded input runs on the shards (no gather of the log-probabilities);
    ``mean`` exchanges only each rank's (sum, weight) pair."""
    from tests.rules.harness import Sample, check_sample

    x = torch.log_softmax(torch.randn(7, 5), 1)
    sample = Sample((x, torch.randint(0, 5, (7,)), torch.rand(5) + 0.5, reduction, 1))
    pl = [(Shard(0), Replicate()), (Shard(0), Replicate()), (R, R)]
    plan = check_sample(torch.ops.aten.nll_loss_forward.default, sample, (2, 2), pl)
    assert plan.match.in_targets[:2] == ((Shard(0), R), (Shard(0), R))


@pytest.mark.parametrize("mesh_shape", [(3,), (2, 2)], ids=["3", "2x2"])
def test_vocab_parallel_embedding_gradient_is_born_sharded(mesh_shape: tuple[int, ...]) -> None:
    """The weight gradient of a vocab-parallel embedding is computed on each rank's rows: it comes out ``S(0)``
    with no hook to move it (uneven rows, padding index, frequency scaling)."""
    from torch_dtorch.placement_rules.families.backward_embedding import vocab_parallel_embedding

    mesh = init_mesh(mesh_shape)
    torch.manual_seed(0)
    w0, ids = torch.randn(11, 4), torch.randint(0, 11, (5, 3))
    for padding_idx, scale in ((None, False), (3, True)):
        ref = w0.clone().requires_grad_()
        F.embedding(ids, ref, padding_idx, scale_grad_by_freq=scale).pow(2).sum().backward()
        w = dt.distribute_tensor(w0, mesh, [R] * (len(mesh_shape) - 1) + [Shard(0)]).requires_grad_()
        out = vocab_parallel_embedding(dt.distribute_tensor(ids, mesh), w, padding_idx, scale)
        out.pow(2).sum().backward()
        assert w.grad.placements == w.placements
        torch.testing.assert_close(w.grad.full_tensor(), ref.grad)


@thread_only  # reads the worker threads' blobs
@pytest.mark.parametrize("shape", [(1,), (2,)], ids=["1dev", "2dev"])
def test_weight_gradients_take_their_parameters_layout_on_the_workers(shape: tuple[int, ...]) -> None:
    """A ``Linear`` weight's gradient arrives through ``t()``'s backward as a transposed view. torch's
    ``AccumulateGrad`` stores it with the parameter's strides (a copy); dtorch tensors report contiguous strides,
    so the parameters' gradient hook makes that copy: on every worker the gradient is laid out as the parameter
    (else the optimizer's ``_foreach_*`` kernels fall back to one strided kernel per tensor). Values equal torch."""
    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
    model.load_state_dict(ref.state_dict())
    mesh = init_mesh(shape)
    replicate_module(model, mesh)
    x = torch.randn(6, 8)
    ref(x).square().sum().backward()
    model(dt.distribute_tensor(x, mesh, [Replicate()] * len(shape))).square().sum().backward()
    dt.sync()
    workers = get_session().executor.runner.workers
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad.full_tensor(), q.grad, msg=name)
        for d in mesh.devices:
            local = workers[d].blobs[operand_of(p.grad).id].tensor
            assert local.stride() == q.grad.stride(), (name, d, local.stride(), q.grad.stride())
