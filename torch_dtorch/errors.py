"""Typed exceptions of torch-dtorch.

Messages follow the style of JAX's ``shard_map`` errors: what was called, each offending argument with its
shape and placements, the rule that was broken, and the fix.
"""

from __future__ import annotations

from collections.abc import Sequence

DOCS_PLACEMENT_RULES = "docs/placement_rules.md"


class DTorchError(Exception):
    """Base class of every error raised by torch-dtorch."""


class MeshError(DTorchError, ValueError):
    """A device mesh was built or indexed with invalid arguments."""


class PlacementError(DTorchError, ValueError):
    """Placements that do not fit a mesh or a tensor (wrong count, shard dim out of range, ...)."""


class RuleRegistrationError(DTorchError, RuntimeError):
    """A placement rule was registered twice, or registered for something that is not an op overload."""


class NoRuleError(DTorchError, NotImplementedError):
    """An aten op reached dtorch but no placement rule is registered for it."""

    def __init__(self, op: object, *, detail: str = "") -> None:
        self.op = op
        msg = (
            f"dtorch has no placement rule for {op}.{(' ' + detail) if detail else ''}\n"
            f"Fix: register one with @torch_dtorch.placement_rules.register_rule({op}) "
            f"(see {DOCS_PLACEMENT_RULES}, 'Adding a rule'), or compute this op on torch tensors "
            f"(x.full_tensor()) and distribute the result."
        )
        super().__init__(msg)


class PlacementMismatchError(DTorchError, ValueError):
    """The inputs of an op fit none of its placement signatures and the redistribute policy forbids fixing it."""

    def __init__(
        self,
        op: object,
        *,
        arguments: Sequence[str],
        axis: int | None,
        signatures: Sequence[str],
        reason: str,
        fix: str,
    ) -> None:
        self.op = op
        self.axis = axis
        lines = [f"{op}: {reason}"]
        lines.append("  arguments:")
        lines.extend(f"    {a}" for a in arguments)
        if signatures:
            where = f" on mesh axis {axis}" if axis is not None else ""
            lines.append(f"  legal signatures{where} (inputs -> outputs):")
            lines.extend(f"    {s}" for s in signatures)
        lines.append(f"  fix: {fix}")
        super().__init__("\n".join(lines))


class RedistributeError(DTorchError, ValueError):
    """A redistribute between two layouts that cannot be planned (e.g. to an unsupported Partial op)."""


class ShapeError(DTorchError, ValueError):
    """An op's inputs have shapes the op rejects (reported before anything reaches a worker)."""


class AsStridedError(DTorchError, RuntimeError):
    """``as_strided`` on a sharded or partial dtorch tensor (it addresses memory the tensor does not have whole)."""


class RestrideError(DTorchError, NotImplementedError):
    """An in-place op that changes a dtorch tensor's shape or strides (``t_``, ``transpose_``, ``squeeze_``, ...):
    the controller tensor has no storage to restride."""


class PipelineParallelError(DTorchError, ValueError):
    """An application's pipeline cannot be parallelized as asked (an unsupported pipeline class, a mesh axis name it
    cannot use, a parallel degree that does not divide the sequence or the attention heads)."""


class ModelLayoutError(DTorchError, ValueError):
    """A model cannot be laid out on the mesh as asked (an axis name the application does not know, attention heads
    not divisible by the tensor-parallel degree, fewer decoder layers than pipeline stages, ...)."""


class BackwardNotSupportedError(NoRuleError):
    """``loss.backward()`` reached an autograd overload (``aten.*_backward``) that has no placement rule yet."""

    def __init__(self, op: object, *, detail: str = "") -> None:
        NotImplementedError.__init__(
            self,
            f"backward through dtorch tensors is not supported for {op} yet (autograd produced it while computing "
            f"gradients, and dtorch has no placement rule for it).{(' ' + detail) if detail else ''}\n"
            f"Fix: compute this layer on torch tensors (x.full_tensor(), then dt.distribute_tensor the result), "
            f"run it under torch.no_grad(), or register a rule with "
            f"@torch_dtorch.placement_rules.register_rule({op}) (see {DOCS_PLACEMENT_RULES}); docs/training.md "
            "lists the backward overloads that have one.",
        )
        self.op = op


def __getattr__(name: str) -> object:
    # DeviceMemoryError subclasses torch.OutOfMemoryError: it lives in errors_oom.py so that importing this module
    # does not import torch (heartbeat-only worker processes start without it)
    if name == "DeviceMemoryError":
        from torch_dtorch.errors_oom import DeviceMemoryError

        return DeviceMemoryError
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class AcceleratorConflictError(DTorchError, RuntimeError):
    """torch's autograd failed on plain CUDA tensors because the dtorch PrivateUse1 backend is torch's accelerator in
    this process (pytorch/pytorch#161129)."""
