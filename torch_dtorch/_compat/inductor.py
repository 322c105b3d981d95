"""Inductor as the workers' compiler: ``compile_fx`` on an aten-level graph, and CUDA graph trees in any thread.

Wraps ``torch._inductor.compile_fx.compile_fx`` / ``compile_fx_inner`` (static inputs, inference-mode compile,
extra decompositions), ``torch._inductor.decomposition.select_decomp_table`` and
``torch._inductor.cudagraph_trees``' thread-local state (which torch < 2.12 sets up only in the importing thread).
All are private to inductor: a torch release may move them.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch


def inductor_compile(
    gm: Any,
    example_inputs: Sequence[Any],
    *,
    mode: str | None = None,
    static_input_idxs: Sequence[int] | None = None,
    decompositions: Mapping[Any, Callable[..., Any]] | None = None,
) -> Any:
    """Compile an aten-level FX graph with inductor; returns a callable taking the inputs positionally.

    ``decompositions``: extra entries for inductor's decomposition table (``select_decomp_table()``, which
    ``compile_fx`` uses when given none): what inductor traces in place of those ops (dtorch's registered ops, see
    :mod:`torch_dtorch.ops.decompositions`), so that their arithmetic is lowered and fused with the graph's.

    ``static_input_idxs``: the inputs whose tensors stay the same from call to call (parameters, buffers), as
    dynamo tells inductor for a module's parameters. ``compile_fx`` called on a graph dynamo did not make treats
    no input as static, so each call would check every input's alignment (and copy a misaligned one), and CUDA
    graphs would copy every weight into their memory pool at every replay. They reach inductor's inner compile
    only while aot_autograd keeps the inputs as given (same count: no duplicate folded away).

    The graph is compiled as an inference graph whatever the calling thread's grad mode: its autograd is the outer
    aot_autograd's (dtorch's capture). A fresh thread (a worker's, or the plain-input path's compile thread) starts
    with grad enabled, and with inputs that require grad (a module's parameters) inductor then traced a joint
    graph: a forward that also returned the activations a backward would save (more ops, more buffers per call)."""
    from torch._inductor.compile_fx import compile_fx, compile_fx_inner

    config_patches: dict[str, Any] = {}
    if mode == "reduce-overhead":
        config_patches["triton.cudagraphs"] = True
        _ensure_cudagraph_tls()
    inner: Any = compile_fx_inner
    if static_input_idxs:
        count = len(example_inputs)
        static = sorted(set(static_input_idxs))

        def inner(gm: Any, inputs: Sequence[Any], **kwargs: Any) -> Any:
            if len(inputs) == count and not kwargs.get("static_input_idxs"):
                kwargs["static_input_idxs"] = static
            return compile_fx_inner(gm, inputs, **kwargs)

    table: dict[Any, Any] | None = None
    if decompositions:
        from torch._inductor.decomposition import select_decomp_table

        table = {**select_decomp_table(), **decompositions}
    with torch.no_grad():
        return compile_fx(
            gm,
            list(example_inputs),
            inner_compile=inner,
            config_patches=config_patches or None,
            decompositions=table,
        )


def _ensure_cudagraph_tls() -> None:
    """Set up CUDA graph trees' thread-local state in this thread. torch < 2.12 does it only in the thread that
    imports ``torch._inductor.cudagraph_trees`` (and copies it into autograd's threads): a dtorch worker thread
    compiling with CUDA graphs failed an ``assert torch._C._is_key_in_tls(...)`` in ``cudagraph_trees.get_obj``.
    This does what newer torch's ``_initialize_tls`` does for any thread."""
    from torch._inductor import cudagraph_trees

    local = cudagraph_trees.local
    if hasattr(local, "tree_manager_containers"):
        return
    init = getattr(cudagraph_trees, "_initialize_tls", None)
    if init is not None:
        init(local)
        return
    local.tree_manager_containers = {}
    local.tree_manager_locks = collections.defaultdict(threading.Lock)
    torch._C._stash_obj_in_tls("tree_manager_containers", local.tree_manager_containers)
    torch._C._stash_obj_in_tls("tree_manager_locks", local.tree_manager_locks)
