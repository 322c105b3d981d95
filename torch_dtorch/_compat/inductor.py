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
    boxed: bool = False,
) -> Any:
    """Compile an aten-level FX graph with inductor; returns a callable taking the inputs positionally, or with
    ``boxed`` one taking them as one list, which it empties (the compiled code then drops each input after its last
    use, as inductor's own boxed calls do: a worker's backward frees the saved activations as it goes). The boxed form
    goes through dynamo's ``GmWrapper``, for which ``aot_module_simplified`` (torch >= 2.4) returns its boxed
    ``forward`` (``tests/backend/test_donation.py`` checks that the list is emptied).

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
    model: Any = gm
    if boxed:
        from torch._dynamo.utils import GmWrapper

        model = GmWrapper(gm, _same)
    with torch.no_grad():
        fn = compile_fx(
            model,
            list(example_inputs),
            inner_compile=inner,
            config_patches=config_patches or None,
            decompositions=table,
        )
    return fn


def _same(args: list[Any]) -> list[Any]:
    return args


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


#: one input of :func:`inductor_compile_symbolic`: a tensor's dims (an int: static; a str: the name of a size
#: symbol) with its dtype, or a size input's symbol name (str)
SymbolicInput = tuple[tuple[int | str, ...], torch.dtype] | str


def inductor_compile_symbolic(
    gm: Any,
    inputs: Sequence[SymbolicInput],
    example_args: Sequence[Any],
    *,
    decompositions: Mapping[Any, Callable[..., Any]] | None = None,
) -> tuple[Callable[..., Any], Callable[[Sequence[Any]], bool] | None]:
    """Compile an aten-level FX graph with symbolic sizes for every size, as inductor does under dynamo with
    ``dynamic=True``: the inputs become fake tensors whose named dims are symbols (one symbol per name: dims that
    share a name are equal at every call, which the caller guarantees), size inputs become SymInts.
    ``example_args``: one call's real arguments (the symbols' hints, the tensors' device; every tensor input must
    be contiguous, and so must later calls' be).

    Returns the compiled callable (taking the real arguments positionally) and its *guard*: ``None``, or a
    predicate on a call's arguments that is False where the compiled code does not hold — the conditions inductor
    put on the sizes while compiling (a heuristic that holds below a bound, say), which dynamo would check at every
    call and which the caller must check here. Wraps ``ShapeEnv``, ``FakeTensorMode`` and ``compile_fx``."""
    from torch._dynamo.source import ConstantSource
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv

    from torch_dtorch._compat.symbolic import sym_expr

    shape_env = ShapeEnv()
    fake_mode = FakeTensorMode(shape_env=shape_env)
    symbols: dict[str, Any] = {}
    #: per symbol: (sympy symbol, input index, dim or None for a size input)
    binders: list[tuple[Any, int, int | None]] = []

    def size(name: str, hint: int, where: tuple[int, int | None]) -> Any:
        s = symbols.get(name)
        if s is None:
            source = ConstantSource(f"dtorch_{name}")
            sym = shape_env.create_symbol(hint, source=source, dynamic_dim=DimDynamic.DYNAMIC)
            s = symbols[name] = shape_env.create_symintnode(sym, hint=hint, source=source)
            binders.append((sym_expr(s), *where))
        return s

    fakes: list[Any] = []
    for i, (spec, arg) in enumerate(zip(inputs, example_args, strict=True)):
        if isinstance(spec, str):
            fakes.append(size(spec, int(arg), (i, None)))
            continue
        dims, dtype = spec
        if not isinstance(arg, torch.Tensor) or not arg.is_contiguous() or arg.dim() != len(dims):
            raise ValueError(f"input {i}: a contiguous {len(dims)}-d tensor was expected")
        shape = [
            d if isinstance(d, int) else size(d, int(n), (i, k))
            for k, (d, n) in enumerate(zip(dims, arg.shape, strict=True))
        ]
        strides: list[Any] = []
        acc: Any = 1
        for d in reversed(shape):
            strides.append(acc)
            acc = acc * d
        with fake_mode:
            fakes.append(torch.empty_strided(shape, tuple(reversed(strides)), dtype=dtype, device=arg.device))
    table: dict[Any, Any] | None = None
    if decompositions:
        from torch._inductor.decomposition import select_decomp_table

        table = {**select_decomp_table(), **decompositions}
    from torch._inductor.compile_fx import compile_fx

    with torch.no_grad():
        fn: Callable[..., Any] = compile_fx(gm, fakes, decompositions=table)  # type: ignore[assignment]
    exprs = [g.expr for g in shape_env.guards]
    if not exprs:
        return fn, None

    def guard(args: Sequence[Any]) -> bool:
        env = {s: int(args[i]) if d is None else int(args[i].shape[d]) for s, i, d in binders}
        return all(bool(e.xreplace(env)) for e in exprs)

    return fn, guard
