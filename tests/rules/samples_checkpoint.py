"""Samples for the sharded-checkpoint ops (``torch_dtorch.nn.checkpoint``): a checkpoint of one saved block per
row band is written once to a temporary directory; ``load_shard`` must give every rank its block of it."""

from __future__ import annotations

import atexit
import json
import os
import shutil
import tempfile

import torch
from safetensors.torch import save_file

from tests.rules.harness import Sample
from torch_dtorch.nn.checkpoint import FORMAT_VERSION, METADATA

ops = torch.ops.dtorch_ckpt
g = torch.Generator().manual_seed(11)

_DIR = tempfile.mkdtemp(prefix="dtorch-ckpt-samples-")
atexit.register(shutil.rmtree, _DIR, True)
VALUE = torch.randn(5, 3, generator=g)
# saved as two uneven row blocks (3 + 2 rows) in two files
save_file({"w": VALUE[:3].contiguous()}, os.path.join(_DIR, "shard-00000.safetensors"))
save_file({"w": VALUE[3:].contiguous()}, os.path.join(_DIR, "shard-00001.safetensors"))
with open(os.path.join(_DIR, METADATA), "w") as f:
    json.dump(
        {
            "version": FORMAT_VERSION,
            "tensors": {
                "w": {
                    "shape": [5, 3], "dtype": "float32", "placements": "S(0)", "mesh_shape": [2],
                    "shards": [
                        {"file": "shard-00000.safetensors", "offset": [0, 0], "shape": [3, 3]},
                        {"file": "shard-00001.safetensors", "offset": [3, 0], "shape": [2, 3]},
                    ],
                }
            },
            "plain": [],
            "objects": {},
        },
        f,
    )  # fmt: skip

SAMPLES: dict[object, list[Sample]] = {
    ops.stash.default: [Sample((torch.randn(5, 3, generator=g), torch.zeros(4), _DIR, "x"))],
    ops.flush.default: [Sample((torch.zeros(4), _DIR))],
    ops.load_shard.default: [Sample((torch.zeros(5, 3), _DIR, "w"))],
}
