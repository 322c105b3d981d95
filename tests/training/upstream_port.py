"""Run PyTorch's own ``pytorch/examples`` ``distributed/tensor_parallelism/`` scripts, unmodified but for the
port, on dtorch — and the same scripts as single-device torch for reference.

The upstream files are not in this repository: point ``DTORCH_PYTORCH_EXAMPLES`` at a checkout of
``pytorch/examples`` (tests/training/test_examples.py skips the upstream cases without it). :func:`port` applies the
**whole port** as a list of textual edits, each of which must match: imports (``init_device_mesh``,
``parallelize_module``, ``fully_shard`` from ``torch_dtorch``) and torchrun boilerplate (the GPU-count check, the
accelerator choice, the process's rank). Nothing in the model code or the training loop changes. The torchrun
environment (``WORLD_SIZE``, ``RANK``) is set by the caller, as torchrun would. ``tiny=True`` adds the test's sizing
edits (smaller model, batch and iteration count: the upstream scripts have no size arguments).

``target="torch"`` is the reference port: the same script with ``init_device_mesh`` giving a mesh stand-in,
``parallelize_module`` / ``fully_shard`` returning the module, so it trains single-device torch on the batches the
dtorch run sees as global (the sequence-parallel script's plain input is each rank's local shard: the reference
model sees ``WORLD_SIZE`` copies of it, see docs/training.md "Porting upstream training scripts").

Run as a script: ``python tests/training/upstream_port.py SCRIPT dtorch|torch OUT.pt [--tiny]`` ports
``$DTORCH_PYTORCH_EXAMPLES/distributed/tensor_parallelism/SCRIPT`` into a temporary folder (with upstream's
``log_utils.py`` and ``llama2_model.py``), runs it and saves the trained model's parameters (full tensors) to OUT.pt.
"""

from __future__ import annotations

import argparse
import os
import runpy
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any, NamedTuple

import torch

__all__ = ["MODEL_GLOBAL", "SCRIPTS", "Edit", "port", "port_edits", "upstream_dir"]

#: the scripts and the global each one's trained model ends in
MODEL_GLOBAL = {
    "tensor_parallel_example.py": "tp_model",
    "sequence_parallel_example.py": "sp_model",
    "fsdp_tp_example.py": "sharded_model",
}
SCRIPTS = tuple(MODEL_GLOBAL)


class Edit(NamedTuple):
    """Replace ``old`` (which must occur in the upstream file) by ``new``; ``why`` says which kind of edit it is."""

    old: str
    new: str
    why: str


_DT_IMPORT = "from torch_dtorch import init_device_mesh, parallelize_module, fully_shard  # the port\n"

#: imports and torchrun boilerplate: every script
_COMMON = (
    Edit("    parallelize_module,\n", "", "import: parallelize_module comes from torch_dtorch"),
    Edit(
        "if not verify_min_gpu_count(min_gpus=_min_gpu_count):",
        "if False:  # the port: one controller drives every mesh device",
        "boilerplate: the per-process GPU-count check",
    ),
    Edit(
        "torch.accelerator.current_accelerator().type",
        "os.environ['DTORCH_PORT_DEVICE']",
        "boilerplate: torchrun's per-process accelerator ('cpu' or 'cuda' here)",
    ),
)

_EDITS: dict[str, tuple[Edit, ...]] = {
    "tensor_parallel_example.py": (
        Edit(
            "from torch.distributed._tensor.device_mesh import init_device_mesh\n",
            _DT_IMPORT,
            "import: init_device_mesh",
        ),
        Edit("_rank = device_mesh.get_rank()", "_rank = 0", "boilerplate: no current rank (log on 'rank 0')"),
    ),
    "sequence_parallel_example.py": (
        Edit(
            "from torch.distributed._tensor.device_mesh import init_device_mesh\n",
            _DT_IMPORT,
            "import: init_device_mesh",
        ),
        Edit("_rank = device_mesh.get_rank()", "_rank = 0", "boilerplate: no current rank (log on 'rank 0')"),
    ),
    "fsdp_tp_example.py": (
        Edit("from torch.distributed.device_mesh import init_device_mesh\n", "", "import: init_device_mesh"),
        Edit("from torch.distributed.fsdp import fully_shard\n", _DT_IMPORT, "import: fully_shard"),
        Edit(
            "dp_rank = dp_mesh.get_local_rank()",
            "dp_rank = 0",
            "boilerplate: no current rank; every dp rank draws the batch rank 0 draws",
        ),
    ),
}

#: the test's sizing (not part of the port): the upstream scripts have no size arguments
_TINY: dict[str, tuple[Edit, ...]] = {
    "tensor_parallel_example.py": (Edit("num_iters = 10", "num_iters = 3", "size"),),
    "sequence_parallel_example.py": (Edit("num_iters = 10", "num_iters = 3", "size"),),
    "fsdp_tp_example.py": (
        Edit(
            "ModelArgs(dim=256, n_layers=2, n_heads=16, vocab_size=32000)",
            "ModelArgs(dim=32, n_layers=2, n_heads=4, vocab_size=64, multiple_of=16, max_seq_len=32)",
            "size",
        ),
        Edit("torch.randint(32000, (8, 256)", "torch.randint(64, (2, 16)", "size"),
        Edit("num_iterations = 10", "num_iterations = 2", "size"),
    ),
}

#: the reference port: the parallel APIs become no-ops, the script trains one torch model
_TORCH_REFERENCE = """
class _Mesh:  # a stand-in for a mesh of WORLD_SIZE devices (the reference trains one model)
    def __init__(self, shape, names=None):
        self.shape, self.names = tuple(shape), names

    def __getitem__(self, name):
        return _Mesh((self.shape[self.names.index(name)],), (name,))

    def size(self):
        n = 1
        for s in self.shape:
            n *= s
        return n

    def get_rank(self):
        return 0

    def get_local_rank(self):
        return 0


def init_device_mesh(device_type, mesh_shape, *, mesh_dim_names=None):
    return _Mesh(mesh_shape, mesh_dim_names)


class _LocalShards(nn.Module):  # a plain input declared Shard(0) is each rank's local shard: n copies of it
    def __init__(self, module, copies):
        super().__init__()
        self.module, self.copies = module, copies

    def forward(self, x):
        return self.module(torch.cat([x] * self.copies))


def parallelize_module(module=None, device_mesh=None, parallelize_plan=None, **kw):
    first = next(iter((parallelize_plan or {}).values()), None)
    layouts = getattr(first, "input_layouts", None) or ()
    if any(type(p).__name__ == "Shard" for p in layouts) and module.__class__.__name__ == "ToyModel":
        return _LocalShards(module, device_mesh.size())
    return module


def fully_shard(module, **kw):
    return module
"""


#: verbatim copies of the BSD-licensed upstream scripts (llama2_model.py is not vendored: its own license)
VENDORED = Path(__file__).resolve().parent / "upstream_tensor_parallelism"


def upstream_dir() -> Path:
    """The ``distributed/tensor_parallelism`` folder of ``$DTORCH_PYTORCH_EXAMPLES`` when set, else the vendored
    copy of the upstream scripts."""
    root = os.environ.get("DTORCH_PYTORCH_EXAMPLES")
    if not root:
        return VENDORED
    folder = Path(root) / "distributed" / "tensor_parallelism"
    if not folder.is_dir():
        raise FileNotFoundError(
            f"DTORCH_PYTORCH_EXAMPLES={root!r} has no distributed/tensor_parallelism folder"
        )
    return folder


def port_edits(script: str) -> tuple[Edit, ...]:
    """The port of ``script``: its import and torchrun-boilerplate edits (not the test's sizing)."""
    return (*_COMMON, *_EDITS[script])


def port(source: str, script: str, *, target: str = "dtorch", tiny: bool = False) -> str:
    """The upstream ``script``'s ``source`` with the port's edits applied (each must match once or more)."""
    edits = (*port_edits(script), *(_TINY[script] if tiny else ()))
    for edit in edits:
        if edit.old not in source:
            raise ValueError(f"{script}: the port expects {edit.old!r} ({edit.why}); upstream changed?")
        source = source.replace(edit.old, edit.new)
    if target == "torch":
        source = source.replace(_DT_IMPORT, "")
        marker = "\ntp_size = 2\n" if script == "fsdp_tp_example.py" else "\nclass ToyModel"
        source = source.replace(marker, _TORCH_REFERENCE + marker, 1)
    elif target != "dtorch":
        raise ValueError(f"target must be 'dtorch' or 'torch', got {target!r}")
    return source


def _full(p: torch.Tensor) -> torch.Tensor:
    t = p.detach()
    return t.full_tensor().cpu() if t.device.type == "dtorch" else t.cpu()


def main() -> None:
    ap = argparse.ArgumentParser(description="run one ported upstream tensor_parallelism script")
    ap.add_argument("script", choices=SCRIPTS)
    ap.add_argument("target", choices=("dtorch", "torch"))
    ap.add_argument("out")
    ap.add_argument("--tiny", action="store_true")
    args = ap.parse_args()
    folder = upstream_dir()
    with tempfile.TemporaryDirectory() as tmp:
        for helper in ("log_utils.py", "llama2_model.py"):
            if (folder / helper).exists():
                shutil.copy(folder / helper, Path(tmp) / helper)
        ported = Path(tmp) / args.script
        ported.write_text(
            port((folder / args.script).read_text(), args.script, target=args.target, tiny=args.tiny)
        )
        sys.path.insert(0, tmp)
        os.environ.setdefault("DTORCH_PORT_DEVICE", "cpu")
        torch.manual_seed(0)  # the scripts draw their initial weights from the global generator
        scope: dict[str, Any] = runpy.run_path(str(ported), run_name="__main__")
    model = scope[MODEL_GLOBAL[args.script]]
    state = {name.removeprefix("module."): _full(p) for name, p in model.named_parameters()}
    torch.save(state, args.out)
    print(f"saved {len(state)} parameters of {args.script} ({args.target})")


if __name__ == "__main__":
    main()
