"""Per-shard weight loading: a Hugging Face checkpoint folder (``config.json`` + ``*.safetensors``) onto a mesh
without the controller ever holding the whole model.

:class:`SafetensorsFolder` is a read-only state dict whose tensors are zero-copy views of the memory-mapped
safetensors files (nothing is read when it is built). :func:`load_llama` builds the model on the meta device
(:func:`torch_dtorch.nn.init_empty_weights`: parameters on meta, rotary buffers real) and hands the folder to
:func:`~torch_dtorch.apps.llama.parallelize.parallelize_llama`, which cuts each parameter into narrowed views per
device and uploads each view to its own worker (``dt.from_local``). So the controller reads, for each worker, only
that worker's bytes from the page cache, copies them once into the upload, and drops them; it never allocates a
full weight. Limits: a shard of a tensor sharded on a non-leading dim (``Shard(1)``: ``o_proj`` / ``down_proj``
under tp) is a strided view, so its pages are touched for every rank (read from disk once, then from the page
cache); a replicated weight is uploaded to each rank of its mesh; the checkpoint's dtype is kept (no conversion).
"""

from __future__ import annotations

import json
import logging
import mmap
import struct
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from torch_dtorch.errors import DTorchError
from torch_dtorch.mesh import DeviceMesh

__all__ = ["SafetensorsFolder", "load_llama"]

log = logging.getLogger(__name__)

_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


class SafetensorsFolder(Mapping[str, torch.Tensor]):
    """Every tensor of the ``*.safetensors`` files in ``path`` by name, as a view of the memory-mapped file."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        files = sorted(self.path.glob("*.safetensors"))
        if not files:
            raise DTorchError(f"SafetensorsFolder: no *.safetensors file in {self.path}")
        self._maps: list[mmap.mmap] = []
        self._entries: dict[str, tuple[int, torch.dtype, tuple[int, ...], int, int]] = {}
        for f in files:
            with f.open("rb") as fh:
                mm = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_COPY)  # copy-on-write: never written
            (n,) = struct.unpack("<Q", mm[:8])
            header = json.loads(mm[8 : 8 + n])
            base = 8 + n
            for name, info in header.items():
                if name == "__metadata__":
                    continue
                if info["dtype"] not in _DTYPES:
                    raise DTorchError(
                        f"SafetensorsFolder: {f.name}: {name} has unsupported dtype {info['dtype']}"
                    )
                start, end = info["data_offsets"]
                self._entries[name] = (
                    len(self._maps),
                    _DTYPES[info["dtype"]],
                    tuple(info["shape"]),
                    base + start,
                    end - start,
                )
            self._maps.append(mm)

    def __getitem__(self, name: str) -> torch.Tensor:
        i, dtype, shape, offset, nbytes = self._entries[name]
        if nbytes == 0:
            return torch.empty(shape, dtype=dtype)
        numel = nbytes // torch.empty((), dtype=dtype).element_size()
        return torch.frombuffer(self._maps[i], dtype=dtype, count=numel, offset=offset).view(shape)

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def dtype(self) -> torch.dtype:
        """The dtype of the floating-point weights (the first one found)."""
        for _, dtype, _, _, _ in self._entries.values():
            if dtype.is_floating_point:
                return dtype
        return torch.float32


def load_llama(model_path: str | Path, mesh: DeviceMesh, *, cp_mode: str = "ulysses") -> nn.Module:
    """A ``LlamaForCausalLM``-style model from a local Hugging Face folder, laid out on ``mesh`` (see
    :func:`~torch_dtorch.apps.llama.parallelize.parallelize_llama`); each worker receives only its shards."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from torch_dtorch.apps.llama.parallelize import parallelize_llama
    from torch_dtorch.nn.parallelize import init_empty_weights

    path = Path(model_path)
    weights = SafetensorsFolder(path)
    config: Any = AutoConfig.from_pretrained(path, local_files_only=True)
    dtype = weights.dtype()
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # parameters (on meta) and buffers in the checkpoint's dtype
    try:
        with init_empty_weights():
            model = AutoModelForCausalLM.from_config(config)
    finally:
        torch.set_default_dtype(old)
    model.eval()
    log.info("load_llama: %s (%d tensors, %s) from %s", type(model).__name__, len(weights), dtype, path)
    return parallelize_llama(model, mesh, cp_mode=cp_mode, state_dict=weights)
