"""The denoising loop on the mesh: the latents stay dtorch tensors from the first transformer call to the last
scheduler step, and come back to the host once.

Without this, every step would upload the latents and fetch the transformer's output (``full_tensor``): a full
sync per step, so the controller could never run ahead of the devices and its per-step Python (dynamo's guards,
the pipeline, the scheduler) would never overlap with their work. With it:

- the transformer returns its output as a dtorch tensor (:func:`~.parallelize._mesh_forward`), so the pipeline's
  guidance arithmetic (SD3's ``chunk`` and combination, FLUX's true CFG) runs as dtorch ops;
- the scheduler's ``step`` (an instance attribute wrapping the pipeline's own scheduler) places a host ``sample``
  on the mesh like the model output — reusing the copy the transformer call already placed when it is the same
  tensor — and runs the unmodified ``step``: a few pointwise ops whose plain-tensor sigmas (0-d CPU tensors; moved
  to the CPU once per call when diffusers put them on the CUDA host device) mix with the dtorch operands; its
  result feeds the next step as a dtorch tensor;
- after the last step (the scheduler's ``step_index`` reaches its ``timesteps``) the latents come back to the host
  once, so the VAE decode and ``output_type="latent"`` see plain tensors. Should they still be on the mesh (an
  interrupted loop, a scheduler without ``step_index``), ``vae.decode``, FLUX's ``_unpack_latents`` and the
  pipeline's ``__call__`` bring them back: the user never gets a dtorch tensor from the pipeline.

``callback_on_step_end`` sees the latents as dtorch tensors (plain ones after the last step); a callback that needs
their values calls ``full_tensor()`` (a sync).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from dataclasses import fields, is_dataclass
from typing import Any

import torch

import torch_dtorch as dt
from torch_dtorch.device.tensors import is_dtorch
from torch_dtorch.mesh import DeviceMesh
from torch_dtorch.placement import Partial, Placement, Replicate

__all__ = ["host_call", "keep_loop_on_mesh", "to_host"]


def to_host(x: Any) -> Any:
    """``x`` with every dtorch tensor replaced by its global value (``full_tensor``), through tuples, lists and
    diffusers' output dataclasses."""
    if isinstance(x, torch.Tensor):
        return x.full_tensor() if is_dtorch(x) else x  # type: ignore[attr-defined]
    if isinstance(x, tuple) and hasattr(x, "_fields"):  # a NamedTuple
        return type(x)(*(to_host(v) for v in x))
    if isinstance(x, tuple | list):
        return type(x)(to_host(v) for v in x)
    if is_dataclass(x) and not isinstance(x, type):  # diffusers' BaseOutput (a dataclass and an OrderedDict)
        for f in fields(x):
            setattr(x, f.name, to_host(getattr(x, f.name)))
        if isinstance(x, dict):
            for k in list(x.keys()):
                x[k] = getattr(x, k)
    return x


def _like(placements: tuple[Placement, ...]) -> list[Placement]:
    """``placements`` for a freshly placed tensor: a Partial axis becomes Replicate."""
    return [Replicate() if isinstance(p, Partial) else p for p in placements]


def _loop_done(scheduler: Any) -> bool:
    """Whether the scheduler has taken its last step (``step_index`` counts the steps taken)."""
    idx = getattr(scheduler, "step_index", None)
    timesteps = getattr(scheduler, "timesteps", None)
    return idx is not None and timesteps is not None and idx >= len(timesteps)


def _sigmas_on_cpu(scheduler: Any) -> None:
    """The scheduler's ``sigmas`` on the CPU (once per ``set_timesteps``): a step's ``sigma_next - sigma`` is then
    a 0-d CPU tensor, a scalar to dtorch ops, instead of a 0-d tensor on the pipeline's CUDA device (diffusers'
    ``set_timesteps(device=...)`` puts them there)."""
    sigmas = getattr(scheduler, "sigmas", None)
    if isinstance(sigmas, torch.Tensor) and sigmas.device.type != "cpu" and not is_dtorch(sigmas):
        scheduler.sigmas = sigmas.cpu()


def _wrap_step(
    scheduler: Any, mesh: DeviceMesh, placed: Callable[[torch.Tensor], torch.Tensor | None]
) -> None:
    base = scheduler.step
    if getattr(base, "_dtorch_loop", False):
        return
    signature = inspect.signature(base)

    @functools.wraps(base)
    def step(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(*args, **kwargs)
        out_ = bound.arguments.get("model_output")
        sample = bound.arguments.get("sample")
        if (
            isinstance(out_, torch.Tensor)
            and is_dtorch(out_)
            and isinstance(sample, torch.Tensor)
            and not is_dtorch(sample)
        ):  # the first step: the latents the transformer call placed (or a fresh copy laid out like its output)
            hit = placed(sample)
            if hit is None:
                hit = dt.distribute_tensor(sample.contiguous(), mesh, _like(out_.placements))  # type: ignore[attr-defined]
            bound.arguments["sample"] = hit
        if isinstance(out_, torch.Tensor) and is_dtorch(out_):
            _sigmas_on_cpu(scheduler)
        result = base(*bound.args, **bound.kwargs)
        return to_host(result) if _loop_done(scheduler) else result

    step._dtorch_loop = True  # type: ignore[attr-defined]
    scheduler.step = step


def _host_first(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` with its dtorch arguments brought to the host first."""
    if getattr(fn, "_dtorch_loop", False):
        return fn

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        return fn(*to_host(args), **{k: to_host(v) for k, v in kwargs.items()})

    call._dtorch_loop = True  # type: ignore[attr-defined]
    return call


def keep_loop_on_mesh(
    pipe: Any, mesh: DeviceMesh, placed: Callable[[torch.Tensor], torch.Tensor | None]
) -> None:
    """Keep ``pipe``'s denoising loop on ``mesh`` (module docstring): wrap its scheduler's ``step``, its VAE's
    ``decode`` and FLUX's ``_unpack_latents`` (instance attributes; diffusers' classes are not edited).

    ``placed(t)`` returns the dtorch copy of the host tensor ``t`` that the transformer call placed, or ``None``."""
    scheduler = getattr(pipe, "scheduler", None)
    if scheduler is not None and hasattr(scheduler, "step"):
        _wrap_step(scheduler, mesh, placed)
    vae = getattr(pipe, "vae", None)
    if vae is not None and hasattr(vae, "decode"):
        vae.decode = _host_first(vae.decode)
    if hasattr(pipe, "_unpack_latents"):
        pipe._unpack_latents = _host_first(pipe._unpack_latents)


def host_call(cls: type) -> Callable[..., Any]:
    """A ``__call__`` for a subclass of the pipeline class ``cls``: the base call, its output on the host."""
    base = cls.__call__

    @functools.wraps(base)
    def __call__(self: Any, *args: Any, **kwargs: Any) -> Any:
        return to_host(base(self, *args, **kwargs))

    return __call__
