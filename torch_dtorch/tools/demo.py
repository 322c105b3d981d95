"""A tiny built-in model for the debugging tools and their CLI (``dtorch debug-mismatch``, ``dtorch roofline``).

``TinyNet``: ``num_blocks`` pre-norm blocks ``x + down(act(up(norm(x))))`` with single-head self-attention in
front, each block with its own activation (so a planted fault in one activation's rule shows up in one block).
:func:`build_demo` returns the model parallelized on a ``(tp,)`` CPU mesh (up: column-parallel, down:
row-parallel) and its plain torch twin with the same weights.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["ACTIVATIONS", "TinyBlock", "TinyNet", "build_demo", "plant_fault"]

#: activation name -> (function, the aten overload it reaches dtorch as)
ACTIVATIONS: dict[str, tuple[Callable[[torch.Tensor], torch.Tensor], Any]] = {
    "relu": (torch.relu, torch.ops.aten.relu.default),
    "gelu": (F.gelu, torch.ops.aten.gelu.default),
    "silu": (F.silu, torch.ops.aten.silu.default),
    "tanh": (torch.tanh, torch.ops.aten.tanh.default),
}


class TinyBlock(nn.Module):
    def __init__(self, dim: int, hidden: int, act: str) -> None:
        super().__init__()
        self.act = act
        self.norm = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        q, k, v = self.qkv(h).chunk(3, dim=-1)
        h = h + F.scaled_dot_product_attention(q, k, v, is_causal=True)
        fn = ACTIVATIONS[self.act][0]
        return x + self.down(fn(self.up(h)))


class TinyNet(nn.Module):
    def __init__(
        self, *, dim: int = 16, hidden: int = 32, acts: Sequence[str] = ("relu", "gelu", "silu")
    ) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(TinyBlock(dim, hidden, a) for a in acts)
        self.head = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def build_demo(
    *,
    tp: int = 2,
    dim: int = 16,
    hidden: int = 32,
    acts: Sequence[str] = ("relu", "gelu", "silu"),
    seed: int = 0,
) -> tuple[nn.Module, nn.Module, Any]:
    """(dtorch model, torch twin, mesh): ``TinyNet`` tensor-parallel over ``tp`` simulated CPU devices."""
    import torch_dtorch as dt
    from torch_dtorch.nn import ColumnParallel, RowParallel

    torch.manual_seed(seed)
    twin = TinyNet(dim=dim, hidden=hidden, acts=acts).eval()
    model = TinyNet(dim=dim, hidden=hidden, acts=acts).eval()
    model.load_state_dict(twin.state_dict())
    mesh = dt.init_device_mesh("cpu", (tp,), mesh_dim_names=("tp",))
    dt.parallelize_module(model, mesh, {"blocks.*.up": ColumnParallel(), "blocks.*.down": RowParallel()})
    return model, twin, mesh


@contextmanager
def plant_fault(op: Any, *, device: int = 1, scale: float = 1.01) -> Iterator[None]:
    """Make ``op``'s local kernel scale its output by ``scale`` on worker ``device`` (a deliberately wrong rule,
    for demos and tests of the localizer; thread mode only)."""
    from torch_dtorch.placement_rules import get_rule

    rule = get_rule(op)
    original = rule.kernel
    own = "kernel" in vars(rule)  # an instance attribute already (another patch) rather than the method

    def kernel(call: Any, ctx: Any, args: Any, kwargs: Any) -> Any:
        out = original(call, ctx, args, kwargs)
        if call.op is op and ctx.device == device:
            return out * scale
        return out

    rule.kernel = kernel  # type: ignore[method-assign]
    try:
        yield
    finally:
        if own:
            rule.kernel = original  # type: ignore[method-assign]
        else:
            del rule.kernel  # back to the class's method
