"""The ``torch.compile`` front end: dynamo's backend registry and optimizer tracing, aot_autograd, decompositions
and the tracing context (used by :mod:`torch_dtorch.backend`).

Wraps ``torch._dynamo.backends.registry`` (register ``backend="dtorch"`` from a source checkout without entry
points), ``torch._dynamo.variables.optimizer.OptimizerVariable._set_capturable`` (capturable optimizer steps on
the dtorch device, as CUDA gets), ``torch._functorch.aot_autograd.aot_module_simplified``,
``torch._decomp.get_decompositions`` and ``torch._guards.TracingContext`` (which inputs aot_autograd marks
static). All are private torch modules: a torch release may move them.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch

log = logging.getLogger(__name__)


def register_dynamo_backend(name: str, compiler_fn: Any) -> None:
    """Make ``torch.compile(backend=name)`` find ``compiler_fn`` once ``torch_dtorch`` is imported, also from a source
    checkout that has no installed entry points; a name already registered (the entry point, a second import) is kept."""
    from torch._dynamo.backends import registry

    if name not in registry._COMPILER_FNS:
        registry.register_backend(compiler_fn=compiler_fn, name=name)


def capturable_optimizers_on(device_type: str) -> bool:
    """Make dynamo treat parameters on ``device_type`` as it treats CUDA ones when it traces an optimizer step.

    Tracing ``opt.step``, dynamo runs ``_init_group`` eagerly and sets the group's ``capturable`` flag first when
    every parameter is a CUDA/XPU one with no state yet (``OptimizerVariable._set_capturable``), so Adam/AdamW make
    their ``step`` counters on the parameters' device; the traced code always takes the capturable path. For other
    devices the real flag stays ``False`` and ``_init_group`` makes CPU ``step`` tensors, which the compiled graph
    then updates on the device and copies back to the host after every call (one download per parameter). Wrapped
    here: groups whose parameters are all on ``device_type`` (torch's ``_get_capturable_supported_devices`` lists
    the PrivateUse1 backend) and have no state get ``capturable=True`` as CUDA groups do. Returns whether the hook
    is in place (``False`` on a torch without that method: the host copies then remain, still correct)."""
    try:
        from torch._dynamo.variables.optimizer import OptimizerVariable
    except ImportError:  # pragma: no cover - other torch versions
        return False
    original = getattr(OptimizerVariable, "_set_capturable", None)
    if original is None:
        log.debug(
            "capturable_optimizers_on: torch %s has no OptimizerVariable._set_capturable", torch.__version__
        )
        return False
    if getattr(original, "_dtorch_device", None) == device_type:
        return True

    def _set_capturable(self: Any, tx: Any) -> None:
        optimizer = self.value
        for group in optimizer.param_groups:
            params = group.get("params", [])
            if (
                "capturable" in group
                and params
                and all(p.device.type == device_type and p not in optimizer.state for p in params)
            ):
                group["capturable"] = True
        original(self, tx)

    _set_capturable._dtorch_device = device_type  # type: ignore[attr-defined]
    OptimizerVariable._set_capturable = _set_capturable  # type: ignore[method-assign]
    return True


def aot_module_simplified(gm: Any, example_inputs: Sequence[Any], **kwargs: Any) -> Any:
    """``torch._functorch.aot_autograd.aot_module_simplified`` (the functionalizing aten tracer dynamo backends use)."""
    from torch._functorch.aot_autograd import aot_module_simplified as aot

    return aot(gm, example_inputs, **kwargs)


def core_decompositions(ops: Sequence[Any]) -> dict[Any, Any]:
    """``torch._decomp.get_decompositions`` restricted to ``ops`` (never the whole Core ATen table)."""
    from torch._decomp import get_decompositions

    return dict(get_decompositions(list(ops)))


def static_input_indices(num_inputs: int) -> tuple[int, ...]:
    """The inputs of the graph being compiled now (called inside a backend's ``fw_compiler``) that aot_autograd
    marks static: parameters and buffers dynamo lifted (``fw_metadata.static_input_indices``); ``()`` outside one."""
    ctx = torch._guards.TracingContext.try_get()
    meta = getattr(ctx, "fw_metadata", None) if ctx is not None else None
    idxs = getattr(meta, "static_input_indices", None) or ()
    return tuple(sorted({int(i) for i in idxs if 0 <= int(i) < num_inputs}))
