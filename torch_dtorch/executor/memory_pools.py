"""Memory pools and their free figures for the memory pre-check (:mod:`torch_dtorch.executor.memory_check`): what
devices share memory, how much is free (host RAM, a CUDA device with what PyTorch's caching allocator holds
unused), and how many bytes a tensor's local shards take on each device."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from torch_dtorch.graph import Operand
from torch_dtorch.placement import Shard, local_shape_and_offset

__all__ = [
    "DEFAULT_MARGIN",
    "MemoryPool",
    "check_enabled",
    "cuda_free_bytes",
    "env_margin",
    "gib",
    "host_available_bytes",
    "operand_bytes",
    "pool_free_of_cuda",
    "shard_bytes",
]

DEFAULT_MARGIN = 0.1


def env_margin() -> float:
    raw = os.environ.get("DTORCH_MEMORY_MARGIN", "").strip()
    if not raw:
        return DEFAULT_MARGIN
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"DTORCH_MEMORY_MARGIN={raw!r} is not a number (a fraction such as 0.1)") from None
    if not 0.0 <= value < 1.0:
        raise ValueError(f"DTORCH_MEMORY_MARGIN={raw!r} must be in [0, 1)")
    return value


def check_enabled() -> bool:
    return os.environ.get("DTORCH_MEMORY_CHECK", "1").strip().lower() not in ("0", "false", "no", "off")


def host_available_bytes() -> int | None:
    """``MemAvailable`` of this host (``/proc/meminfo``), in bytes; ``None`` where it cannot be read."""
    try:
        with open("/proc/meminfo", "rb") as f:
            for line in f:
                if line.startswith(b"MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def gib(n: float) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if abs(n) >= 1 << shift:
            return f"{n / (1 << shift):.2f} {unit}"
    return f"{int(n)} B"


@dataclass(frozen=True)
class MemoryPool:
    """Memory shared by ``devices`` (one host's RAM, one GPU); ``free()`` is its free bytes (``None``: unknown,
    not checked). A live figure (``generation=None``: read now) already shows what the workers allocated, so the
    planned bytes are forgotten once the workers are idle; a reported one (a worker process's last report) shows
    what they had allocated when it was sent, so the planned bytes are forgotten when ``generation()`` changes
    (a new report)."""

    name: str
    devices: tuple[int, ...]
    free: Callable[[], int | None]
    generation: Callable[[], int] | None = None


def operand_bytes(x: Operand) -> dict[int, int]:
    """Bytes of ``x``'s local shard on each device of its mesh (nothing for an unbound operand)."""
    if x.mesh is None:
        return {}
    return shard_bytes(x.shape, x.dtype, x.mesh.root, x.root_placements)


_SHARD_BYTES: dict[Any, tuple[Any, dict[int, int]]] = {}
_SHARD_BYTES_MAX = 4096


def shard_bytes(shape: Sequence[int], dtype: Any, root: Any, root_placements: Any) -> dict[int, int]:
    """Bytes of the local shard on each device of ``root`` (a root mesh) of a ``dtype`` tensor of global
    ``shape`` laid out as ``root_placements`` (cached: the caller must not modify the result)."""
    key = (tuple(shape), dtype, id(root), tuple(root_placements))
    hit = _SHARD_BYTES.get(key)
    if hit is not None and hit[0] is root:  # the same mesh, not a new one at a reused address
        return hit[1]
    item = dtype.itemsize
    out: dict[int, int] = {}
    if all(not isinstance(p, Shard) for p in root_placements):
        n = item
        for s in shape:
            n *= s
        out = dict.fromkeys(root.devices, n)
    else:
        for d, c in root.coordinates():
            n = item
            for s in local_shape_and_offset(tuple(shape), root.shape, root_placements, c)[0]:
                n *= s
            out[d] = n
    if len(_SHARD_BYTES) >= _SHARD_BYTES_MAX:
        _SHARD_BYTES.clear()
    _SHARD_BYTES[key] = (root, out)
    return out


def cuda_free_bytes(device: Any) -> int:
    """Free bytes of a CUDA device for this process: what the driver reports free plus what PyTorch's caching
    allocator holds reserved but unused (it hands that out again before asking the driver)."""
    import torch

    from torch_dtorch._compat import cuda_cached_free_bytes

    index = device if isinstance(device, int) else torch.device(device).index
    if index is None:
        index = torch.cuda.current_device()
    return int(torch.cuda.mem_get_info(index)[0]) + cuda_cached_free_bytes(index)


def pool_free_of_cuda(index: int) -> Callable[[], int | None]:
    def free() -> int | None:
        try:
            return cuda_free_bytes(index)
        except Exception:  # noqa: BLE001 - no figure: not checked
            return None

    return free
