"""In-place and ``out=`` conformance: OpInfo's in-place variants and ``out=`` calls on dtorch tensors, sharded.

For an OpInfo, the first float32 sample torch itself accepts in that form (up to ``SAMPLES`` tried) runs once per
placement config of ``harness.placement_configs`` (all-Replicate, then ``Shard(d)`` of the sample input and every
tensor like it):

- **in-place** (``info.inplace_variant``): the call must return its ``self`` (the same Python object) and leave
  ``self`` — and the result — equal to torch's. Then again **through a view**: ``self`` is a transposing view
  (``base.movedim(-1, 0)`` of a contiguous ``base``, or ``base[0]`` for a 0/1-d input) of a dtorch ``base`` sharded
  where the view's dim ``d`` lives; the write must land in ``base``.
- **out=** (``info.supports_out``): every output gets an ``out=`` dtorch tensor of torch's shape and dtype,
  ``Shard(d)`` where it has dim ``d`` (else Replicate); the call must return those very tensors, filled as torch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils import _pytree as pytree

import torch_dtorch as dt
from tests.conformance import harness
from torch_dtorch.errors import NoRuleError
from torch_dtorch.placement import Placement, Replicate, Shard

__all__ = ["SAMPLES", "VariantCase", "run_inplace", "run_out"]

#: samples tried per OpInfo until torch accepts one in the variant's form
SAMPLES = 4


@dataclass
class VariantCase:
    kind: str  # "inplace", "inplace-view" or "out"
    placements: str
    status: harness.Status
    detail: str = ""


def _classify(body: Callable[..., str], *args: Any) -> tuple[harness.Status, str]:
    """Run one case ``body(*args)`` (which returns '' or a difference) and classify it as the harness does."""
    try:
        diff = body(*args)
    except NoRuleError as e:
        return harness.Status.NO_RULE, str(e).splitlines()[0]
    except Exception as e:  # noqa: BLE001 - every failure is classified and reported
        text = str(e).strip().splitlines()
        return harness.Status.ERROR, f"{type(e).__name__}: {text[0] if text else ''}"[:300]
    return (harness.Status.WRONG, diff[:300]) if diff else (harness.Status.SHARDED, "")


def _clone_args(sample: Any) -> tuple[Any, Any, Any]:
    return pytree.tree_map_only(torch.Tensor, torch.clone, (sample.input, sample.args, sample.kwargs))


def _torch_inplace(fn: Callable[..., Any], sample: Any) -> tuple[torch.Tensor, Any]:
    inp, args, kwargs = _clone_args(sample)
    torch.manual_seed(0)
    return inp, fn(inp, *args, **kwargs)


def _first_sample(info: Any, reference: Callable[[Any], Any]) -> tuple[Any, Any] | None:
    """The first sample (of ``SAMPLES``) whose reference torch computes, with that reference."""
    for sample in harness.samples_for(info, SAMPLES):
        if not isinstance(sample.input, torch.Tensor):
            continue
        try:
            return sample, reference(sample)
        except Exception:  # noqa: BLE001 - torch rejects this form of the sample (e.g. a broadcast self)
            continue
    return None


# --- in-place ------------------------------------------------------------------------------------------------------


def _inplace_direct(fn: Callable[..., Any], sample: Any, mesh: Any, d: int | None, want: Any) -> str:
    inp, args, kwargs = harness._to_dtorch(sample, mesh, d)
    torch.manual_seed(0)
    ret = fn(inp, *args, **kwargs)
    if ret is not inp:
        return f"returned {type(ret).__name__} {id(ret):#x}, not self"
    want_self, want_ret = want
    return harness._compare(dt.to_torch(inp), want_self, exact=False) or harness._compare(
        harness._fetch(ret), want_ret, exact=False
    )


def _view_of(
    x: torch.Tensor,
) -> tuple[torch.Tensor, Callable[[torch.Tensor], torch.Tensor], Callable[[int], int]]:
    """``(base, view_fn, base_dim)``: a contiguous ``base`` whose ``view_fn(base)`` equals ``x`` as a strided view;
    ``base_dim(d)`` is the base dim holding the view's dim ``d``."""
    if x.ndim >= 2:
        return (
            x.movedim(0, -1).contiguous(),
            lambda b: b.movedim(-1, 0),
            lambda d: x.ndim - 1 if d == 0 else d - 1,
        )
    return x.unsqueeze(0).contiguous(), lambda b: b[0], lambda d: d + 1


def _inplace_view(fn: Callable[..., Any], sample: Any, mesh: Any, d: int | None, want: Any) -> str:
    _, args, kwargs = harness._to_dtorch(sample, mesh, d)
    base_t, view_fn, base_dim = _view_of(sample.input.detach())
    spec: list[Placement] = [Replicate()] * mesh.ndim
    if d is not None and sample.input.ndim:
        spec = [Shard(base_dim(d))] * mesh.ndim
    base = dt.distribute_tensor(base_t.clone(), mesh, spec)
    view = view_fn(base)
    torch.manual_seed(0)
    ret = fn(view, *args, **kwargs)
    if ret is not view:
        return f"through a view: returned {type(ret).__name__}, not the view"
    # torch through the same view (random ops draw in the view's memory order, not the contiguous input's)
    want_base = base_t.clone()
    _, t_args, t_kwargs = _clone_args(sample)
    torch.manual_seed(0)
    want_ret = fn(view_fn(want_base), *t_args, **t_kwargs)
    return harness._compare(dt.to_torch(base), want_base, exact=False) or harness._compare(
        harness._fetch(ret), want_ret, exact=False
    )


def run_inplace(info: Any, mesh: Any, *, views: bool = True) -> list[VariantCase]:
    """Every placement config of the first sample torch runs in place (``[]``: no such sample)."""
    fn = info.inplace_variant
    found = _first_sample(info, lambda s: _torch_inplace(fn, s))
    if found is None:
        return []
    sample, want = found
    cases = []
    for name, d in harness.placement_configs(sample, tuple(mesh.shape)):
        status, detail = _classify(_inplace_direct, fn, sample, mesh, d, want)
        cases.append(VariantCase("inplace", name, status, detail))
        if views:
            status, detail = _classify(_inplace_view, fn, sample, mesh, d, want)
            cases.append(VariantCase("inplace-view", name, status, detail))
    return cases


# --- out= ----------------------------------------------------------------------------------------------------------


def _out_case(fn: Callable[..., Any], sample: Any, mesh: Any, d: int | None, torch_out: Any) -> str:
    want, returns_none = torch_out
    inp, args, kwargs = harness._to_dtorch(sample, mesh, d)
    kwargs = {
        k: v for k, v in kwargs.items() if k != "device"
    }  # out= decides the device (torch rejects others)

    def out_tensor(w: torch.Tensor) -> torch.Tensor:
        spec: list[Placement] = [Replicate()] * mesh.ndim
        if d is not None and d < w.ndim:
            spec = [Shard(d)] * mesh.ndim
        return dt.distribute_tensor(torch.zeros_like(w), mesh, spec)

    out = pytree.tree_map_only(torch.Tensor, out_tensor, want)
    torch.manual_seed(0)
    ret = fn(inp, *args, out=out, **kwargs)
    if (
        returns_none
    ):  # ``Tensor(a!)[] out`` overloads (split_copy, unbind_copy, ...) return nothing, as in torch
        if ret is not None:
            return f"returned {type(ret).__name__}, torch returns None"
    else:
        rets, outs = pytree.tree_leaves(ret), pytree.tree_leaves(out)
        if len(rets) != len(outs) or any(r is not o for r, o in zip(rets, outs)):
            return "the result is not the out= tensor(s)"
    return harness._compare(harness._fetch(out), want, exact=False)


def run_out(info: Any, mesh: Any) -> list[VariantCase]:
    """Every placement config of the first sample with a tensor (or tuple of tensors) result."""

    def reference(sample: Any) -> tuple[Any, bool]:
        """``(outs, returns_none)``: torch's own ``out=`` call on zeroed CPU outs of the functional result's
        structure (a sample whose ``out=`` form torch rejects is no case)."""
        want = harness._reference(info.op, sample)
        leaves = pytree.tree_leaves(want)
        if not leaves or not all(isinstance(t, torch.Tensor) for t in leaves):
            raise TypeError("no tensor result to write out=")
        out = pytree.tree_map_only(torch.Tensor, torch.zeros_like, want)
        inp, args, kwargs = _clone_args(sample)
        torch.manual_seed(0)
        ret = info.op(inp, *args, out=out, **kwargs)
        return out, ret is None

    found = _first_sample(info, reference)
    if found is None:
        return []
    sample, want = found
    return [
        VariantCase("out", name, *_classify(_out_case, info.op, sample, mesh, d, want))
        for name, d in harness.placement_configs(sample, tuple(mesh.shape))
    ]
