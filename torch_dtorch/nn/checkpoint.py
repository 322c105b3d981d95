"""Sharded checkpoints: every worker writes and reads only its own shards.

``dt.nn.checkpoint.save(state_dict, checkpoint_id=dir)`` / ``load(state_dict, checkpoint_id=dir)`` follow
``torch.distributed.checkpoint.save`` / ``load``: ``state_dict`` is a (nested) dict of a model's or an optimizer's
state; ``load`` fills the tensors of the given ``state_dict`` **in place** (so the target's placements decide where
each value goes — a checkpoint saved on one layout loads into another) and replaces its other leaves by the saved
values.

Format (version 1), a directory:

- ``shard-<device>.safetensors``: one per device, written BY that device's worker: the device's local block of every
  distributed tensor it is the writer of (the block's first holder: coordinate 0 on every mesh axis that does not
  shard the tensor, so replicated blocks are written once). Keys are the flattened state-dict keys.
- ``controller.safetensors``: plain torch tensors of the state dict (e.g. an optimizer's ``step``).
- ``dtorch_checkpoint.json``: ``{"version": 1, "tensors": {key: {"shape", "dtype", "placements", "mesh_shape",
  "shards": [{"file", "offset", "shape"}]}}, "plain": [keys], "objects": {key: JSON value}}``. Nested keys are joined
  with ``.`` (list positions are numbers); a ``Partial`` tensor is reduced before it is saved.

Loading, each worker reads the parts of the saved blocks that overlap its own block (safetensors slices, memory
mapped), so a worker never reads more than its shard plus the overlap with the saved layout; nothing is gathered on
the controller.

``save_dcp`` / ``load_dcp`` (``checkpoint_dcp.py``) read and write ``torch.distributed.checkpoint`` checkpoints
instead, to exchange state with upstream (SPMD) training jobs.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from torch_dtorch.nn.checkpoint_dcp import load_dcp, save_dcp
from torch_dtorch.placement import (
    Partial,
    Placement,
    Replicate,
    Shard,
    local_shape_and_offset,
    placements_str,
)
from torch_dtorch.placement_rules.call import LocalContext, OpCall
from torch_dtorch.placement_rules.rule import register_rule as _register_rule
from torch_dtorch.placement_rules.signature import PlacementSignature, sig

__all__ = ["FORMAT_VERSION", "load", "load_dcp", "save", "save_dcp"]

FORMAT_VERSION = 1
METADATA = "dtorch_checkpoint.json"
CONTROLLER_FILE = "controller.safetensors"

_R = Replicate()
_S0 = Shard(0)
#: per (checkpoint dir, device): the blocks a worker stashed, written by the flush op
_STASH: dict[tuple[str, int], dict[str, torch.Tensor]] = {}
_STASH_LOCK = threading.Lock()
#: per checkpoint dir: its metadata, read once per process
_META: dict[str, dict[str, Any]] = {}


def shard_file(device: int) -> str:
    return f"shard-{device:05d}.safetensors"


# --- the worker-side ops ------------------------------------------------------------------------------------------


@torch.library.custom_op("dtorch_ckpt::stash", mutates_args=())
def _stash(x: torch.Tensor, token: torch.Tensor, path: str, key: str) -> torch.Tensor:
    """On a plain tensor: nothing to stash (dtorch tensors reach the rule's kernel on every worker). ``token`` (one
    element per device) makes the output depend on every device, so fetching it waits for all of them."""
    return torch.zeros_like(token)


@_stash.register_fake
def _(x: torch.Tensor, token: torch.Tensor, path: str, key: str) -> torch.Tensor:
    return torch.empty_like(token)


@torch.library.custom_op("dtorch_ckpt::flush", mutates_args=())
def _flush(token: torch.Tensor, path: str) -> torch.Tensor:
    """On a plain tensor: nothing was stashed."""
    return torch.zeros_like(token)


@_flush.register_fake
def _(token: torch.Tensor, path: str) -> torch.Tensor:
    return torch.empty_like(token)


@torch.library.custom_op("dtorch_ckpt::load_shard", mutates_args=())
def _load_shard(like: torch.Tensor, path: str, key: str) -> torch.Tensor:
    """On a plain tensor: the whole saved tensor."""
    entry = _metadata(path)["tensors"][key]
    return _gather_saved(path, key, entry).to(device=like.device, dtype=like.dtype)


@_load_shard.register_fake
def _(like: torch.Tensor, path: str, key: str) -> torch.Tensor:
    return torch.empty_like(like)


def _writer(call: OpCall, ctx: LocalContext) -> bool:
    """Whether this rank writes its block: coordinate 0 on every axis that does not shard the tensor."""
    pl = call.placements[0]
    assert pl is not None
    return all(type(p) is Shard or c == 0 for p, c in zip(pl, ctx.coordinate, strict=True))


def _stash_kernel(call: OpCall, ctx: LocalContext, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    x, token, path, key = args[0], args[1], args[2], args[3]
    if ctx.device >= 0 and _writer(call, ctx):  # (device -1: the plain-torch simulator, which writes nothing)
        with _STASH_LOCK:
            _STASH.setdefault((path, ctx.device), {})[key] = x.detach().to("cpu", copy=True).contiguous()
    return torch.zeros_like(token)


def _flush_kernel(call: OpCall, ctx: LocalContext, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    from safetensors.torch import save_file

    token, path = args[0], args[1]
    with _STASH_LOCK:
        tensors = _STASH.pop((path, ctx.device), None)
    if tensors:
        save_file(tensors, os.path.join(path, shard_file(ctx.device)))
    return torch.zeros_like(token)


def _metadata(path: str) -> dict[str, Any]:
    meta = _META.get(path)
    if meta is None:
        with open(os.path.join(path, METADATA)) as f:
            meta = _META[path] = json.load(f)
    return meta


def _load_kernel(call: OpCall, ctx: LocalContext, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """This rank's block, assembled from the overlapping parts of the saved blocks."""
    from safetensors import safe_open

    like, path, key = args[0], args[1], args[2]
    entry = _metadata(path)["tensors"][key]
    x = call.inputs[0]
    pl = call.placements[0]
    assert x is not None and pl is not None and call.mesh is not None
    shape, offset = local_shape_and_offset(x.shape, call.mesh.shape, pl, ctx.coordinate)
    out = torch.empty(shape, dtype=like.dtype, device=like.device)
    for saved in entry["shards"]:
        lo = [max(o, so) for o, so in zip(offset, saved["offset"], strict=True)]
        hi = [
            min(o + n, so + sn)
            for o, n, so, sn in zip(offset, shape, saved["offset"], saved["shape"], strict=True)
        ]
        if any(a >= b for a, b in zip(lo, hi, strict=True)) and len(shape) > 0:
            continue
        src = tuple(slice(a - so, b - so) for a, b, so in zip(lo, hi, saved["offset"], strict=True))
        dst = tuple(slice(a - o, b - o) for a, b, o in zip(lo, hi, offset, strict=True))
        with safe_open(os.path.join(path, saved["file"]), framework="pt") as f:
            part = f.get_slice(key)[src] if len(shape) > 0 else f.get_tensor(key)
        out[dst] = part.to(device=like.device, dtype=like.dtype)
    return out


def _keep_placements(call: OpCall) -> list[PlacementSignature]:
    """Any Shard/Replicate input stays where it is (the output, when a tensor, in the same placements)."""
    pl = call.placements[0] or ()
    return [sig([p], p) for p in dict.fromkeys(pl) if not isinstance(p, Partial)]


def _with_token(call: OpCall) -> list[PlacementSignature]:
    """``stash(x, token)``: ``x`` stays where it is; the token and the output are ``Shard(0)`` on every axis."""
    pl = call.placements[0] or ()
    return [sig([p, _S0], _S0) for p in dict.fromkeys(pl) if not isinstance(p, Partial)]


def _token_only(call: OpCall) -> list[PlacementSignature]:
    return [sig([_S0], _S0)]


# the rules are registered at import (worker processes decode the ops by name against this registry); the dtorch
# device kernels of the custom ops on first use, on the controller (after the device is set up)
_CKPT_OPS = (
    (torch.ops.dtorch_ckpt.stash.default, _stash_kernel, _with_token),
    (torch.ops.dtorch_ckpt.flush.default, _flush_kernel, _token_only),
    (torch.ops.dtorch_ckpt.load_shard.default, _load_kernel, _keep_placements),
)
for _op, _kernel, _sigs in _CKPT_OPS:
    _register_rule(_op, family="checkpoint", kernel=_kernel)(_sigs)


def _register() -> None:
    from torch_dtorch.device.registration import register_kernels

    register_kernels([op for op, _, _ in _CKPT_OPS])  # idempotent


# --- the controller side ------------------------------------------------------------------------------------------


def _flatten(tree: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    if isinstance(tree, Mapping):
        for k, v in tree.items():
            yield from _flatten(v, f"{prefix}{k}.")
    elif isinstance(tree, (list, tuple)) and not _is_leaf_sequence(tree):
        for i, v in enumerate(tree):
            yield from _flatten(v, f"{prefix}{i}.")
    else:
        yield prefix[:-1], tree


def _is_leaf_sequence(seq: list[Any] | tuple[Any, ...]) -> bool:
    """Lists of plain values (``betas``, an optimizer param group's ``params`` ids) are leaves."""
    return not any(isinstance(v, (torch.Tensor, Mapping, list, tuple)) for v in seq)


def _json_value(v: Any, key: str) -> Any:
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, (list, tuple)):
        return [_json_value(x, key) for x in v]
    raise TypeError(
        f"checkpoint.save: {key!r} holds a {type(v).__name__}; a sharded checkpoint stores tensors and JSON values "
        "(None, bool, int, float, str and lists of them)"
    )


def save(state_dict: Mapping[str, Any], *, checkpoint_id: str | os.PathLike[str]) -> None:
    """Write ``state_dict`` to the directory ``checkpoint_id`` (created if needed); every worker writes its own
    blocks. Blocks until the files are written (errors of a worker raise here)."""
    from safetensors.torch import save_file

    from torch_dtorch.api import redistribute, to_torch, to_torch_async
    from torch_dtorch.device.dispatch import operand_of
    from torch_dtorch.device.tensors import is_dtorch

    _register()
    path = os.path.abspath(os.fspath(checkpoint_id))
    os.makedirs(path, exist_ok=True)
    meta: dict[str, Any] = {"version": FORMAT_VERSION, "tensors": {}, "plain": [], "objects": {}}
    plain: dict[str, torch.Tensor] = {}
    roots: dict[Any, torch.Tensor] = {}
    pending = []
    with torch.no_grad():
        for key, v in _flatten(state_dict):
            if not isinstance(v, torch.Tensor):
                meta["objects"][key] = _json_value(v, key)
                continue
            if not is_dtorch(v) or operand_of(v).mesh is None:
                plain[key] = (to_torch(v) if is_dtorch(v) else v).detach().cpu().contiguous()
                meta["plain"].append(key)
                continue
            op = operand_of(v)
            assert op.mesh is not None
            if any(isinstance(p, Partial) for p in op.placements):
                v = redistribute(v, op.mesh, [_R if isinstance(p, Partial) else p for p in op.placements])
                op = operand_of(v)
                assert op.mesh is not None
            assert op.mesh is not None
            root = op.mesh.root
            rp: tuple[Placement, ...] = tuple(op.root_placements)
            shards = []
            for device, coord in root.coordinates():
                if all(type(p) is Shard or c == 0 for p, c in zip(rp, coord, strict=True)):
                    shape, offset = local_shape_and_offset(v.shape, root.shape, rp, coord)
                    shards.append({"file": shard_file(device), "offset": list(offset), "shape": list(shape)})
            meta["tensors"][key] = {
                "shape": list(v.shape),
                "dtype": str(v.dtype).removeprefix("torch."),
                "placements": placements_str(rp),
                "mesh_shape": list(root.shape),
                "shards": shards,
            }
            token = roots.get(root)
            if token is None:
                token = roots[root] = device_token(root)
            pending.append(torch.ops.dtorch_ckpt.stash(v, token, path, key))
        pending += [torch.ops.dtorch_ckpt.flush(token, path) for token in roots.values()]
        for fut in [to_torch_async(t) for t in pending]:
            fut.get()  # every device's part is fetched: waits for all of them; a worker's error raises here
    if plain:
        save_file(plain, os.path.join(path, CONTROLLER_FILE))
    with open(os.path.join(path, METADATA), "w") as f:
        json.dump(meta, f, indent=1)
    _META.pop(path, None)


def device_token(root: Any) -> torch.Tensor:
    """One element per device of ``root`` (``Shard(0)`` on every axis): ops on it run on, and a fetch of their
    output waits for, every device."""
    from torch_dtorch.api import zeros

    return zeros(root.size(), device_mesh=root, placements=[_S0] * root.ndim)


def load(state_dict: dict[str, Any], *, checkpoint_id: str | os.PathLike[str]) -> None:
    """Fill ``state_dict`` (nested dicts/lists) from the checkpoint: dtorch tensors in place, each worker reading
    its own block; plain tensors in place; other leaves replaced by the saved values."""
    from safetensors import safe_open

    from torch_dtorch.device.dispatch import operand_of
    from torch_dtorch.device.tensors import is_dtorch
    from torch_dtorch.errors import DTorchError

    _register()
    path = os.path.abspath(os.fspath(checkpoint_id))
    _META.pop(path, None)
    meta = _metadata(path)
    if meta.get("version") != FORMAT_VERSION:
        raise DTorchError(
            f"checkpoint.load: {path} has format version {meta.get('version')}, expected {FORMAT_VERSION}"
        )
    with torch.no_grad():
        for key, v in list(_flatten(state_dict)):
            if not isinstance(v, torch.Tensor):
                if key in meta["objects"]:
                    _set(state_dict, key, _like(v, meta["objects"][key]))
                continue
            if key in meta["tensors"]:
                entry = meta["tensors"][key]
                if list(v.shape) != entry["shape"]:
                    raise DTorchError(
                        f"checkpoint.load: {key!r} has shape {tuple(v.shape)}, the checkpoint holds "
                        f"{tuple(entry['shape'])}"
                    )
                if is_dtorch(v) and operand_of(v).mesh is not None:
                    v.copy_(torch.ops.dtorch_ckpt.load_shard(v, path, key))
                else:
                    v.copy_(_gather_saved(path, key, entry))
            elif key in meta["plain"]:
                with safe_open(os.path.join(path, CONTROLLER_FILE), framework="pt") as f:
                    v.copy_(f.get_tensor(key))
            else:
                raise DTorchError(f"checkpoint.load: {path} has no entry {key!r}")


def _gather_saved(path: str, key: str, entry: dict[str, Any]) -> torch.Tensor:
    """A saved distributed tensor as one torch tensor (for a plain torch target)."""
    from safetensors import safe_open

    out = torch.empty(entry["shape"], dtype=getattr(torch, entry["dtype"]))
    for saved in entry["shards"]:
        dst = tuple(slice(o, o + n) for o, n in zip(saved["offset"], saved["shape"], strict=True))
        with safe_open(os.path.join(path, saved["file"]), framework="pt") as f:
            out[dst] = f.get_tensor(key)
    return out


def _like(target: Any, value: Any) -> Any:
    """``value`` (decoded JSON) with ``target``'s sequence types (a tuple stays a tuple)."""
    if isinstance(target, tuple) and isinstance(value, list):
        return tuple(value)
    return value


def _set(tree: Any, key: str, value: Any) -> None:
    """Replace the leaf at the flattened ``key`` (dict keys may contain dots themselves: the longest one wins)."""
    if isinstance(tree, dict) and key in tree:
        tree[key] = value
        return
    if isinstance(tree, list):
        head, _, rest = key.partition(".")
        if rest:
            _set(tree[int(head)], rest, value)
        else:
            tree[int(head)] = value
        return
    assert isinstance(tree, dict)
    parts = key.split(".")
    for n in range(len(parts) - 1, 0, -1):
        head, rest = ".".join(parts[:n]), ".".join(parts[n:])
        k = head if head in tree else next((k for k in tree if str(k) == head), None)
        if k is not None:
            _set(tree[k], rest, value)
            return
    raise KeyError(key)
