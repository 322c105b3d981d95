"""``torch.distributed.checkpoint`` (DCP) interop: ``dt.checkpoint.save_dcp`` / ``load_dcp``.

A DCP checkpoint is what upstream training jobs (FSDP2, torchtitan) write: ``.metadata`` plus ``__<rank>_0.distcp``
files, resharded on load to whatever the reader holds. These two functions let a dtorch program exchange state with
them through DCP's own public API in its no-process-group mode (``dcp.save`` / ``dcp.load`` with ``no_dist=True``):

- ``save_dcp(state_dict, checkpoint_id=dir)``: every dtorch tensor is gathered to the controller (``full_tensor``:
  a ``Partial`` is reduced) and DCP writes the plain state dict; an SPMD job loads it into its DTensors, any world
  size (DCP slices the saved full tensors for each rank).
- ``load_dcp(state_dict, checkpoint_id=dir)``: DCP reads each dtorch tensor's global value into a CPU tensor
  (from any saved sharding: a checkpoint written by 8 FSDP ranks loads as well) and it is copied into the target
  **in place**, shard by shard into the target's placements; plain tensors are filled in place and other leaves
  (learning rates, ``step`` counters saved as objects) replaced, as ``dt.checkpoint.load``.

Cost: unlike dtorch's own format (``dt.checkpoint.save`` / ``load``, each worker writing its blocks), every tensor
passes through the controller's memory once, one at a time on load and all at once on save (DCP writes one
state dict). Use the native format for large models and DCP to move state to or from upstream jobs.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from torch_dtorch.api import to_torch
from torch_dtorch.device.tensors import is_dtorch

__all__ = ["load_dcp", "save_dcp"]


def _to_plain(tree: Any) -> Any:
    """``tree`` with every dtorch tensor replaced by its global value on the CPU."""
    if isinstance(tree, Mapping):
        return {k: _to_plain(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_to_plain(v) for v in tree)
    if isinstance(tree, torch.Tensor) and is_dtorch(tree):
        return to_torch(tree.detach()).cpu()
    return tree


def _empty_like_global(tree: Any) -> Any:
    """``tree`` with every dtorch tensor replaced by an empty CPU tensor of its global shape and dtype (DCP's
    load target); lists become dicts keyed by position so DCP can write their leaves back."""
    if isinstance(tree, Mapping):
        return {k: _empty_like_global(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_empty_like_global(v) for v in tree)
    if isinstance(tree, torch.Tensor) and is_dtorch(tree):
        return torch.empty(tree.shape, dtype=tree.dtype)
    return tree


def _fill(target: Any, loaded: Any) -> Any:
    """Copy ``loaded`` into ``target``: tensors in place (dtorch ones into their placements); returns the value
    the caller stores for a non-tensor leaf."""
    if isinstance(target, Mapping):
        for k in list(target):
            new = _fill(target[k], loaded[k])
            if not isinstance(target[k], torch.Tensor):
                target[k] = new  # type: ignore[index]
        return target
    if isinstance(target, list):
        for i, v in enumerate(target):
            new = _fill(v, loaded[i])
            if not isinstance(v, torch.Tensor):
                target[i] = new
        return target
    if isinstance(target, tuple):
        return tuple(_fill(v, w) for v, w in zip(target, loaded, strict=True))
    if isinstance(target, torch.Tensor):
        if target is not loaded:
            with torch.no_grad():
                target.copy_(loaded)
        return target
    return loaded


def save_dcp(state_dict: Mapping[str, Any], *, checkpoint_id: str | os.PathLike[str]) -> None:
    """Write ``state_dict`` as a ``torch.distributed.checkpoint`` checkpoint (see the module doc)."""
    # DCP's default writer overlaps copies on the PrivateUse1 device's streams when that device is available — here
    # the dtorch device, whose module has none; the values are CPU tensors already, so the serial loader is right
    writer = dcp.FileSystemWriter(os.fspath(checkpoint_id), per_thread_copy_ahead=0)
    dcp.save(dict(_to_plain(state_dict)), storage_writer=writer, no_dist=True)


def load_dcp(state_dict: dict[str, Any], *, checkpoint_id: str | os.PathLike[str]) -> None:
    """Fill ``state_dict`` from a ``torch.distributed.checkpoint`` checkpoint, dtorch tensors in place in their
    placements (see the module doc)."""
    staging = _empty_like_global(state_dict)
    dcp.load(staging, checkpoint_id=checkpoint_id, no_dist=True)
    _fill(state_dict, staging)
