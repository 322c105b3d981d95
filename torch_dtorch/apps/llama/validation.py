"""Checks that a Llama-style model can be laid out on a mesh, and the mesh the layout runs on.

The mesh's axis names say what is parallel: ``dp`` (batch), ``tp`` (attention heads and MLP, vocab-parallel
embedding and LM head), ``pp`` (decoder layers in stages), ``cp`` (the sequence during prefill). Context-parallel
attention picks Ulysses or ring by axis name (``placement_rules/context_parallel.py``), so :func:`cp_mesh` renames
the ``cp`` axis after ``cp_mode`` (``cp_ulysses`` / ``cp_ring``) or, for ``"both"``, splits it in two axes
(``cp_ulysses`` x ``cp_ring``) over the same devices.
"""

from __future__ import annotations

from typing import Any, Literal

from torch_dtorch.errors import ModelLayoutError
from torch_dtorch.mesh import DeviceMesh

__all__ = ["AXES", "CP_MODES", "CpMode", "check_layout", "cp_mesh"]

CpMode = Literal["ulysses", "ring", "both"]
CP_MODES: tuple[str, ...] = ("ulysses", "ring", "both")
#: mesh axis names parallelize_llama understands
AXES: tuple[str, ...] = ("dp", "tp", "pp", "cp")
#: the model's modules parallelize_llama reaches by name (Llama, Mistral, Qwen2 share them)
_MODULES = (
    "model.embed_tokens",
    "model.layers",
    "model.norm",
    "model.rotary_emb",
    "lm_head",
)
_LAYER_MODULES = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
)


def _size(mesh: DeviceMesh, name: str) -> int:
    names = mesh.mesh_dim_names or ()
    return mesh.size(name) if name in names else 1


def check_layout(model: Any, mesh: DeviceMesh, *, cp_mode: str) -> None:
    """Raise :class:`ModelLayoutError` naming what does not fit (and the fix) before anything is placed."""
    what = f"parallelize_llama({type(model).__name__}, mesh {mesh!r}, cp_mode={cp_mode!r})"
    if mesh.is_submesh:
        raise ModelLayoutError(f"{what}: pass the root mesh (with axes {AXES}), not a sub-mesh view")
    names = mesh.mesh_dim_names
    if names is None:
        raise ModelLayoutError(
            f"{what}: the mesh has no axis names; name them after what is parallel, e.g. "
            "dt.init_device_mesh('cpu', (2, 2), mesh_dim_names=('dp', 'tp'))"
        )
    unknown = [n for n in names if n not in AXES]
    if unknown:
        raise ModelLayoutError(
            f"{what}: unknown mesh axis name(s) {unknown}; use {AXES} (dp: batch, tp: heads and MLP, pp: decoder "
            "layers in stages, cp: the sequence in prefill; cp_mode picks Ulysses, ring or both)"
        )
    if cp_mode not in CP_MODES:
        raise ModelLayoutError(f"{what}: cp_mode must be one of {CP_MODES}")
    missing = [m for m in _MODULES if _get(model, m) is None]
    layers = _get(model, "model.layers")
    if layers is not None and len(layers) > 0:
        missing += [f"model.layers.0.{m}" for m in _LAYER_MODULES if _get(layers[0], m) is None]
    if missing:
        raise ModelLayoutError(
            f"{what}: the model has no module(s) {missing}; parallelize_llama takes a LlamaForCausalLM-style "
            "model (Llama, Mistral, Qwen2 module names); other models: dt.parallelize_module with their own plan"
        )
    cfg = model.config
    tp = _size(mesh, "tp")
    heads = cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    if heads % tp or kv_heads % tp:
        raise ModelLayoutError(
            f"{what}: tp={tp} must divide the attention heads (num_attention_heads={heads}, "
            f"num_key_value_heads={kv_heads}): each tp rank holds whole query and key/value heads.\n"
            f"  fix: a tp size that divides {kv_heads}, or move devices to dp / cp / pp"
        )
    pp = _size(mesh, "pp")
    num_layers = len(layers) if layers is not None else 0
    if num_layers < pp:
        raise ModelLayoutError(
            f"{what}: pp={pp} stages but the model has {num_layers} decoder layers; every stage needs one.\n"
            f"  fix: pp <= {num_layers}"
        )
    cp = _size(mesh, "cp")
    if cp_mode == "both" and cp > 1 and _split(cp) is None:
        raise ModelLayoutError(
            f"{what}: cp_mode='both' splits the cp axis into Ulysses x ring, which needs a cp size with a factor "
            f"other than 1 and itself (4, 6, 8, ...); got cp={cp}.\n  fix: cp_mode='ulysses' or 'ring', or cp >= 4"
        )


def _get(model: Any, path: str) -> Any:
    try:
        return model.get_submodule(path)
    except AttributeError:
        return None


def _split(n: int) -> tuple[int, int] | None:
    """``n = u * r`` with both factors > 1 (Ulysses the smaller), ``None`` for primes."""
    for u in range(2, int(n**0.5) + 1):
        if n % u == 0:
            return u, n // u
    return None


def cp_mesh(mesh: DeviceMesh, cp_mode: str) -> DeviceMesh:
    """``mesh`` with its ``cp`` axis named after ``cp_mode`` (same devices); without a ``cp`` axis, ``mesh``."""
    names = list(mesh.mesh_dim_names or ())
    if "cp" not in names:
        return mesh
    a = names.index("cp")
    if cp_mode != "both" or mesh.shape[a] == 1:
        names[a] = "cp_ring" if cp_mode == "ring" else "cp_ulysses"
        return DeviceMesh(mesh.device_type, mesh.mesh, mesh_dim_names=names)
    split = _split(mesh.shape[a])
    assert split is not None  # check_layout refused primes
    ids = mesh.mesh.reshape(*mesh.shape[:a], *split, *mesh.shape[a + 1 :])
    return DeviceMesh(
        mesh.device_type, ids, mesh_dim_names=[*names[:a], "cp_ulysses", "cp_ring", *names[a + 1 :]]
    )
