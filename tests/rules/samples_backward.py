"""Samples for the backward family (uneven sizes on purpose: 5 and 3 do not divide by 2 or 4). The saved tensors
(``mean``/``rstd``, ``total_weight``) come from the forward ops, as autograd passes them."""

from __future__ import annotations

import torch

import torch_dtorch.placement_rules.families.backward_embedding  # noqa: F401 - registers dtorch_train ops
from tests.rules.harness import Sample

aten = torch.ops.aten
g = torch.Generator().manual_seed(7)
NONE, MEAN, SUM = 0, 1, 2


def rand(*shape: int) -> torch.Tensor:
    return torch.randn(shape, generator=g)


def _layer_norm(shape: tuple[int, ...], normalized: list[int], affine: bool) -> list[Sample]:
    x = rand(*shape)
    w = rand(*normalized) if affine else None
    b = rand(*normalized) if affine else None
    _, mean, rstd = aten.native_layer_norm(x, normalized, w, b, 1e-5)
    grad = rand(*shape)
    masks = (
        [[True, True, True], [True, False, True], [False, True, True]] if affine else [[True, False, False]]
    )
    return [Sample((grad, x, normalized, mean, rstd, w, b, m), atol=2e-5) for m in masks]


def _nll(
    shape: tuple[int, ...], classes: int, reduction: int, *, weighted: bool, ignore: int = -100
) -> Sample:
    x = torch.log_softmax(rand(*shape), dim=1 if len(shape) > 1 else 0)
    tshape = (shape[0], *shape[2:]) if len(shape) > 1 else ()
    target = torch.randint(0, classes, tshape, generator=g)
    w = rand(classes).abs() + 0.5 if weighted else None
    fwd = aten.nll_loss2d_forward if len(shape) == 4 else aten.nll_loss_forward
    loss, total = fwd(x, target, w, reduction, ignore)
    grad = rand(*loss.shape)
    return Sample((grad, x, target, w, reduction, ignore, total))


def _nll_forward(n: int, classes: int, reduction: int, *, weighted: bool, ignore: int = -100) -> Sample:
    x = torch.log_softmax(rand(n, classes), dim=1) if n else torch.log_softmax(rand(classes), dim=0)
    target = torch.randint(0, classes, (n,) if n else (), generator=g)
    w = rand(classes).abs() + 0.5 if weighted else None
    return Sample((x, target, w, reduction, ignore), no_partial=True)


_IDX = torch.randint(0, 7, (5, 3), generator=g)
_X, _Y = rand(5, 3), rand(5, 3)

SAMPLES: dict[object, list[Sample]] = {
    aten.native_layer_norm_backward.default: [
        *_layer_norm((5, 3, 4), [4], affine=True),
        *_layer_norm((5, 4), [4], affine=False),
        *_layer_norm((3, 5, 2, 3), [2, 3], affine=True),
    ],
    aten.embedding_dense_backward.default: [
        Sample((rand(5, 3, 4), _IDX, 7, -1, False), no_partial=True),
        Sample((rand(5, 3, 4), _IDX, 7, 2, False), no_partial=True),
        Sample((rand(5, 3, 4), _IDX, 7, -1, True), no_partial=True),
        Sample((rand(5, 6), _IDX[:, 0], 7, -1, False), no_partial=True),
    ],
    torch.ops.dtorch_train.embedding_rows_backward.default: [
        Sample((rand(5, 3, 4), _IDX, rand(7, 4), -1, False), no_partial=True),
        Sample((rand(5, 3, 4), _IDX, rand(7, 4), 2, False), no_partial=True),
        Sample((rand(5, 3, 4), _IDX, rand(7, 4), 4, True), no_partial=True),
    ],
    aten.nll_loss_backward.default: [
        _nll((5, 4), 4, MEAN, weighted=False),
        _nll((5, 4), 4, SUM, weighted=True),
        _nll((5, 4), 4, NONE, weighted=True),
        _nll((5, 4), 4, MEAN, weighted=True, ignore=1),
        _nll((4,), 4, MEAN, weighted=False),
    ],
    aten.nll_loss_forward.default: [
        _nll_forward(5, 4, MEAN, weighted=False),
        _nll_forward(5, 4, MEAN, weighted=True, ignore=1),
        _nll_forward(5, 4, SUM, weighted=True),
        _nll_forward(5, 4, NONE, weighted=False),
        _nll_forward(7, 3, MEAN, weighted=False, ignore=0),
        _nll_forward(0, 4, MEAN, weighted=False),
    ],
    aten.nll_loss2d_backward.default: [
        _nll((3, 4, 5, 2), 4, MEAN, weighted=False),
        _nll((3, 4, 5, 2), 4, NONE, weighted=True),
    ],
    aten.mse_loss.default: [
        Sample((_X, _Y)),
        Sample((_X, _Y, NONE)),
        Sample((_X, _Y, SUM)),
        Sample((rand(2, 5, 3), rand(5, 3), MEAN)),
    ],
    aten.mse_loss_backward.default: [
        Sample((rand(), _X, _Y, MEAN)),
        Sample((rand(), _X, _Y, SUM)),
        Sample((rand(5, 3), _X, _Y, NONE)),
        Sample((rand(), rand(2, 5, 3), rand(2, 5, 3), MEAN)),
    ],
}
