"""RNG functions of the ``torch.dtorch`` device module: what ``torch.random.fork_rng``, ``torch.manual_seed`` and
``torch.get_device_module("dtorch")`` callers expect a backend to have.

dtorch has no generator of its own. It draws random numbers where single-device torch would, so that results and
the random stream equal torch's under the same seed:

- ``rand``/``randn``/``*_like`` are drawn on the controller from the **controller device's default generator**
  (the CPU generator for a ``cpu`` mesh, ``cuda:0``'s for a ``cuda`` one) and uploaded;
- ``multinomial`` (sampling: HF ``generate(do_sample=True)``) is drawn on the controller too: ``probs`` is fetched
  (one ``[batch, vocab]`` row block per call), sampled with torch's own ``multinomial`` and the indices uploaded —
  so thread and process mode both equal torch (:func:`multinomial`);
- ``dropout`` / ``native_dropout`` in eager mode are drawn on the controller too (``device/dropout.py``), so a
  ``set_rng_state`` / ``manual_seed`` (``fork_rng``, ``freeze_rng_state``) right after the call does not change them;
- ops drawn by the workers (``native_dropout`` in compiled programs) replay that generator's state
  (``placement_rules/creation.py``, ``draw_global``); in thread mode the workers share the controller's process
  and advance the same generator. Known gap: they read the state when they *run*, not when the call was issued, so
  a ``set_rng_state`` / ``manual_seed`` between the two changes their draw.

So the dtorch device generator *is* the controller device's default generator, and these functions delegate to
it: ``fork_rng`` over the dtorch device saves and restores exactly the stream dtorch draws from. In process
(cluster) mode ``manual_seed``, ``set_rng_state`` and ``seed`` also set the worker processes' generators to the
new state (``device/worker_rng.py``), so worker-drawn ops agree across ranks and follow the seed; the controller's
generator does not advance by their draws (docs/training.md "Dropout").
"""

from __future__ import annotations

from typing import Any

import torch

from torch_dtorch._tree import map_only
from torch_dtorch.device import binding
from torch_dtorch.device.dispatch import controller_device, dispatch_op, wrap
from torch_dtorch.device.state import get_session, session_or_none
from torch_dtorch.device.tensors import TABLE, is_dtorch
from torch_dtorch.device.transfer import fetch
from torch_dtorch.device.worker_rng import sync_worker_rng
from torch_dtorch.graph import Operand
from torch_dtorch.placement import Replicate, Shard, is_partial, is_shard

__all__ = [
    "RANDOM_INPLACE_OPS",
    "RNG_FUNCTIONS",
    "install_rng_functions",
    "multinomial",
    "random_inplace",
    "upload_like",
]


def _controller_device() -> torch.device:
    rt = session_or_none()
    if rt is None or rt.device_type == "cpu":
        return torch.device("cpu")
    return torch.device(rt.device_type, 0)


def _generator() -> torch.Generator:
    device = _controller_device()
    if device.type == "cpu":
        return torch.default_generator
    if not torch.cuda.is_initialized():
        # the generators exist once CUDA is initialized (a process-mode controller may not have touched CUDA yet:
        # ``torch.manual_seed`` right after ``init_device_mesh("cuda", ...)``)
        torch.cuda.init()
    return torch.cuda.default_generators[device.index or 0]


def get_rng_state(device: Any = None) -> torch.Tensor:
    """The state of the generator dtorch draws from (``device`` is accepted for the backend API; dtorch has one)."""
    return _generator().get_state()


def set_rng_state(new_state: torch.Tensor, device: Any = None) -> None:
    gen = _generator()
    gen.set_state(new_state)
    sync_worker_rng(session_or_none(), gen)


def get_rng_state_all() -> list[torch.Tensor]:
    return [get_rng_state()]


def set_rng_state_all(new_states: list[torch.Tensor]) -> None:
    for state in new_states:
        set_rng_state(state)


def manual_seed(seed: int) -> None:
    gen = _generator()
    gen.manual_seed(int(seed))
    sync_worker_rng(session_or_none(), gen)  # (``torch.manual_seed`` calls ``manual_seed_all``)


def manual_seed_all(seed: int) -> None:
    manual_seed(seed)


def seed() -> None:
    gen = _generator()
    gen.seed()
    sync_worker_rng(session_or_none(), gen)


def seed_all() -> None:
    seed()


def initial_seed() -> int:
    return _generator().initial_seed()


RNG_FUNCTIONS = {
    f.__name__: f
    for f in (
        get_rng_state,
        set_rng_state,
        get_rng_state_all,
        set_rng_state_all,
        manual_seed,
        manual_seed_all,
        seed,
        seed_all,
        initial_seed,
    )
}


def install_rng_functions(device_name: str) -> None:
    """Add the RNG functions to the device module torch registered for ``device_name`` (``torch.<device_name>``)."""
    module = torch.get_device_module(device_name)
    for name, fn in RNG_FUNCTIONS.items():
        setattr(module, name, fn)


#: in-place random fills, drawn as :data:`RANDOM_OPS` are: on the controller from torch's own generator (in
#: ``self``'s global strides, so the values and the RNG stream equal single-device torch's), then written into
#: ``self`` in its placements by an in-place ``copy_`` (views of ``self`` see the write)
RANDOM_INPLACE_OPS = {
    torch.ops.aten.uniform_.default,
    torch.ops.aten.normal_.default,
    torch.ops.aten.cauchy_.default,
    torch.ops.aten.exponential_.default,
    torch.ops.aten.geometric_.default,
    torch.ops.aten.log_normal_.default,
    torch.ops.aten.bernoulli_.float,
    torch.ops.aten.bernoulli_.Tensor,
    torch.ops.aten.random_.default,
    getattr(torch.ops.aten.random_, "from"),
    torch.ops.aten.random_.to,
}


def random_inplace(op: Any, self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    """The dtorch kernel of the :data:`RANDOM_INPLACE_OPS`."""
    rt = get_session()
    x = TABLE.lookup(self, rt.generation)
    dev = controller_device(rt)
    value = torch.empty_strided(x.shape, x.stride or (), dtype=x.dtype, device=dev)
    host_args, host_kwargs = map_only(
        torch.Tensor, lambda t: fetch(t).to(dev) if is_dtorch(t) else t, (args, kwargs)
    )
    op(value, *host_args, **host_kwargs)
    dispatch_op(torch.ops.aten.copy_.default, (self, upload_like(x, value)), {})
    return self


def upload_like(x: Operand, value: torch.Tensor) -> torch.Tensor:
    """``value`` (drawn on the controller, ``x``'s global shape) as a dtorch tensor in ``x``'s placements — a
    ``Partial`` axis becomes ``Replicate`` (one draw for every part) — or unbound like ``x``."""
    rt = get_session()
    if x.mesh is None:
        return wrap(rt, binding.defer_upload(rt, value))
    placements = [p if not is_partial(p) else Replicate() for p in x.placements]
    operand = rt.executor.input(tuple(value.shape), x.mesh, placements, dtype=value.dtype)
    rt.executor.upload(operand, value.contiguous())
    return wrap(rt, operand)


def multinomial(
    probs: torch.Tensor,
    num_samples: int,
    replacement: bool = False,
    *,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """The dtorch kernel of ``aten.multinomial``: drawn on the controller from torch's own generator (``generator``
    if given, else the controller device's default one), so the samples and the generator's state afterwards equal
    single-device torch's in thread and process mode alike. ``probs`` is fetched (a sync point: one ``[B, V]``
    block per call, what HF ``generate`` samples from each step); invalid rows raise torch's own error here, at the
    call. The indices are uploaded batch-sharded like ``probs`` (``Shard(0)`` of a 2-d ``probs`` stays, anything
    else becomes Replicate: a row is one distribution) — the placements of the rule in
    ``placement_rules/families/sampling.py``, which compiled programs use."""
    rt = get_session()
    x = TABLE.lookup(probs, rt.generation)
    host = fetch(probs).to(controller_device(rt))
    value = torch.multinomial(host, num_samples, replacement, generator=generator)
    if x.mesh is None:
        return wrap(rt, binding.defer_upload(rt, value))
    rows = [Shard(0) if x.ndim == 2 and is_shard(p, 0) else Replicate() for p in x.placements]
    operand = rt.executor.input(tuple(value.shape), x.mesh, rows, dtype=value.dtype)
    rt.executor.upload(operand, value)
    return wrap(rt, operand)
