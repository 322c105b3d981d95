"""``dtorch::place``: a layout request that survives ``torch.compile``.

Module hooks of :mod:`torch_dtorch.nn` (ParallelStyle inputs/outputs, parallel layers, pipeline stage moves) decide
redistributes from a tensor's *current* placements. Under dynamo those are unknown (hooks see fake tensors), so a
hook that runs while compiling emits ``torch.ops.dtorch.place(x, mesh, axis, placement, strict, what)`` instead —
plain constants only: ``mesh`` is a key from :func:`mesh_key` (taken when the hook is installed). Placement
propagation (:mod:`~torch_dtorch.backend.propagate`) asks :func:`place_target` for the layout of the operand it has —
what the eager hook would have computed — and records a plain ``redistribute`` (to another mesh for a stage move).
Run eagerly (``dtorch_debug``, a graph that falls back to eager execution), the op redistributes the real tensor.

- ``axis >= 0``: the tensor must live on root mesh ``mesh``; its placement on root axis ``axis`` becomes
  ``placement`` (``S(d)``, ``R``, ``P(op)``; a negative shard dim counts from the end), the other axes keep theirs.
  ``strict`` raises :class:`PlacementError` instead of converting.
- ``axis == -1``: a pipeline stage move to root mesh ``mesh``: placements kept when both meshes have the same shape,
  else Replicate.

Training (``torch.compile`` with ``requires_grad`` inputs) differentiates through it: the gradient of ``place(x)``
is ``torch.ops.dtorch.place_as(grad, x)``, which puts the gradient in ``x``'s layout (a ``Partial`` there becomes
``Replicate``, as upstream's ``Redistribute`` backward does) — decided at propagation like ``place`` itself.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch

from torch_dtorch.errors import PlacementError
from torch_dtorch.mesh import DeviceMesh
from torch_dtorch.placement import Placement, Replicate, Shard, is_partial, parse_placements, placements_str

__all__ = [
    "PLACE_AS_OP",
    "PLACE_OP",
    "STAGE_MOVE",
    "mesh_key",
    "mesh_of",
    "place",
    "place_as_target",
    "place_target",
]

STAGE_MOVE = -1

_LOCK = threading.Lock()
_MESHES: list[DeviceMesh] = []
_KEYS: dict[DeviceMesh, int] = {}


def mesh_key(mesh: DeviceMesh) -> int:
    """A process-wide integer naming ``mesh.root`` inside compiled graphs (registered once)."""
    root = mesh.root
    with _LOCK:
        key = _KEYS.get(root)
        if key is None:
            key = _KEYS[root] = len(_MESHES)
            _MESHES.append(root)
        return key


def mesh_of(key: int) -> DeviceMesh:
    if not 0 <= key < len(_MESHES):
        raise KeyError(f"dtorch::place: no mesh with key {key}")
    return _MESHES[key]


def place_target(
    mesh: DeviceMesh | None,
    root_placements: Sequence[Placement],
    ndim: int,
    key: int,
    axis: int,
    placement: str,
    strict: bool,
    what: str,
) -> tuple[DeviceMesh, list[Placement]] | None:
    """``(root mesh, root placements)`` a tensor on ``mesh`` with ``root_placements`` must move to, or ``None``
    when it already has them (``mesh=None``: an unbound tensor, left to bind to its consumer)."""
    if mesh is None:
        return None
    dst = mesh_of(key)
    src = mesh.root
    if axis == STAGE_MOVE:
        if src == dst:
            return None
        if src.shape == dst.shape:
            return dst, list(root_placements)
        return dst, [Replicate()] * dst.ndim
    if src != dst:
        raise PlacementError(
            f"{what}: input {src.describe(root_placements)} lives on another mesh than the layer "
            f"(axis {dst.axis_name(axis)!r} of {dst!r}).\n"
            "  fix: move it with x.redistribute(device_mesh=..., placements=...) (pipeline stages do this "
            "automatically when the layer belongs to a stage built by dt.nn.pipeline)"
        )
    (want,) = parse_placements(placement)
    if type(want) is Shard and want.dim < 0:
        if -want.dim > ndim:
            raise PlacementError(f"{what}: {placement} is out of range for a {ndim}-d tensor")
        want = Shard(want.dim + ndim)
    cur = list(root_placements)
    if cur[axis] == want:
        return None
    if strict:
        raise PlacementError(
            f"{what}: input has {placements_str((cur[axis],))} on mesh axis {dst.axis_name(axis)!r}, the layer "
            f"needs {placements_str((want,))}.\n  fix: redistribute the input first, or build the layer with "
            "strict=False to convert it automatically"
        )
    cur[axis] = want
    return dst, cur


@torch.library.custom_op("dtorch::place", mutates_args=())
def _place_op(x: torch.Tensor, mesh: int, axis: int, placement: str, strict: bool, what: str) -> torch.Tensor:
    from torch_dtorch.api import redistribute
    from torch_dtorch.device.dispatch import operand_of

    op = operand_of(x)
    tgt = place_target(op.mesh, op.root_placements, x.ndim, mesh, axis, placement, strict, what)
    if tgt is None:
        return x.clone()  # a custom op's output must not alias its input
    return redistribute(x, tgt[0], tgt[1])


@_place_op.register_fake
def _place_fake(
    x: torch.Tensor, mesh: int, axis: int, placement: str, strict: bool, what: str
) -> torch.Tensor:
    return torch.empty_like(x)


PLACE_OP = torch.ops.dtorch.place.default


def place_as_target(
    mesh: DeviceMesh | None,
    root_placements: Sequence[Placement],
    like_mesh: DeviceMesh | None,
    like: Sequence[Placement],
) -> tuple[DeviceMesh, list[Placement]] | None:
    """Where ``place_as`` moves a gradient on ``mesh`` to: ``like``'s root mesh and root placements, a ``Partial``
    made ``Replicate`` (``None``: already there, or unbound)."""
    if mesh is None or like_mesh is None:
        return None
    want = [Replicate() if is_partial(p) else p for p in like]
    if mesh.root == like_mesh.root and list(root_placements) == want:
        return None
    return like_mesh.root, want


@torch.library.custom_op("dtorch::place_as", mutates_args=())
def _place_as_op(grad: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    from torch_dtorch.api import redistribute
    from torch_dtorch.device.dispatch import operand_of

    g, x = operand_of(grad), operand_of(like)
    tgt = place_as_target(g.mesh, g.root_placements, x.mesh, x.root_placements)
    if tgt is None:
        return grad.clone()
    return redistribute(grad, tgt[0], tgt[1])


@_place_as_op.register_fake
def _place_as_fake(grad: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(grad)


PLACE_AS_OP = torch.ops.dtorch.place_as.default


def _place_setup(ctx: object, inputs: tuple[object, ...], output: object) -> None:
    ctx.save_for_backward(inputs[0])  # type: ignore[attr-defined]


def _place_backward(ctx: object, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
    (x,) = ctx.saved_tensors  # type: ignore[attr-defined]
    return PLACE_AS_OP(grad, x), None, None, None, None, None


_place_op.register_autograd(_place_backward, setup_context=_place_setup)


def place(
    t: torch.Tensor, mesh: int, axis: int, placement: str = "R", *, strict: bool = False, what: str = "dtorch"
) -> torch.Tensor:
    """``t`` laid out as requested (call it from hooks while ``torch.compiler.is_compiling()``)."""
    return torch.ops.dtorch.place(t, mesh, axis, placement, strict, what)  # type: ignore[no-any-return]
