"""Step caches for the diffusion transformer: First-Block Cache (``fbc``) and TeaCache (``tea``).

Consecutive denoising steps often change the transformer's input little; a step cache then skips most blocks and
reuses the residual (output minus input) they added at the last computed step.

- **First-Block Cache** (ParaAttention's rule): run the first block; its residual ``r`` is compared with the one of
  the last computed step, ``d = mean|r - r_prev| / mean|r_prev|``. If ``d < threshold`` the remaining blocks are
  skipped: their cached residual is added to the first block's output. Otherwise they run, and ``r`` and their
  residual become the cache.
- **TeaCache** (Liu et al. 2024): the signal is the first block's timestep-modulated input (``norm1(x, temb)``,
  cheap: no block runs before the decision). Its relative L1 change against the previous step is rescaled by a
  polynomial (the published FLUX coefficients) and accumulated; while the sum stays below ``threshold`` every block
  is skipped and the cached residual of all blocks added; once it reaches the threshold the blocks run and the sum
  restarts at 0. The first and the last step always compute.

**One decision per step for the whole mesh.** The distance is a reduction over the global-view (sharded) signal:
the workers reduce it, the controller reads the one scalar (``item()``) and takes the decision, and every device
then runs the same branch. No device can skip alone. With ``ExecuteConfig(compile=True)`` the blocks before and after the
decision are compiled as two programs (:class:`CachedBlocks`), and the decision runs between them.

``threshold=0`` never skips (the distance is never below 0): the result is exactly the uncached one. Skipped steps are
reported: :func:`cache_report` (the last generation's :class:`CacheReport`); ``dtorch diffuse`` prints them.
:class:`CachedBlocks` replaces the transformer's block lists (``transformer_blocks`` holds it alone; FLUX's
``single_transformer_blocks`` becomes empty) and runs every block in order.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from torch_dtorch.apps.diffusion.config import CacheConfig
from torch_dtorch.device.tensors import is_dtorch
from torch_dtorch.errors import PipelineParallelError

__all__ = [
    "FLUX_TEA_COEFFICIENTS",
    "CacheReport",
    "CacheState",
    "CachedBlocks",
    "StepClock",
    "cache_report",
    "install_cache",
    "relative_l1",
    "rescale",
    "scheduler_clock",
]

log = logging.getLogger(__name__)

#: TeaCache's rescaling polynomial for FLUX (highest power first), from the TeaCache4FLUX reference code
FLUX_TEA_COEFFICIENTS: tuple[float, ...] = (
    4.98651651e02,
    -2.83781631e02,
    5.58554382e01,
    -3.82021401e00,
    2.64230861e-01,
)

#: ``() -> (step index, number of steps or None)`` of the generation in progress
StepClock = Callable[[], tuple[int, int | None]]


def relative_l1(x: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
    """``mean|x - prev| / mean|prev|`` in float32 (a 0-d tensor: reduced over every device for dtorch tensors)."""
    xf, pf = x.float(), prev.float()
    return (xf - pf).abs().mean() / pf.abs().mean()


def rescale(coefficients: tuple[float, ...], x: float) -> float:
    """The polynomial ``coefficients`` (highest power first, as ``numpy.poly1d``) at ``x``."""
    acc = 0.0
    for c in coefficients:
        acc = acc * x + c
    return acc


def scheduler_clock(scheduler: Any) -> StepClock:
    """The step of a diffusers scheduler's loop: ``step_index`` is ``None`` before the first ``step()`` of a
    generation (``set_timesteps`` resets it) and counts the steps after; the step count is ``len(timesteps)``."""

    def clock() -> tuple[int, int | None]:
        idx = getattr(scheduler, "step_index", None)
        timesteps = getattr(scheduler, "timesteps", None)
        return (0 if idx is None else int(idx)), (None if timesteps is None else len(timesteps))

    return clock


@dataclass
class CacheReport:
    """What the cache did in one generation: the steps, the skipped step indices and every step's distance
    (``None`` where none was computed: a first step)."""

    kind: str
    threshold: float
    num_steps: int = 0
    skipped: list[int] = field(default_factory=list)
    distances: list[float | None] = field(default_factory=list)

    def __str__(self) -> str:
        return (
            f"{self.kind} cache (threshold {self.threshold:g}): skipped {len(self.skipped)} of {self.num_steps} "
            f"steps {self.skipped}"
        )


class CacheState:
    """The cache's memory across steps and its decision rule (plain Python state, read and written on the
    controller, between the compiled segments of :class:`CachedBlocks`)."""

    def __init__(
        self, config: CacheConfig, *, coefficients: tuple[float, ...], clock: StepClock | None
    ) -> None:
        self.config = config
        self.kind = config.kind
        self.threshold = config.resolved_threshold
        self.coefficients = coefficients
        self._clock = clock
        self.calls = 0
        self.reset()

    def reset(self) -> None:
        self.prev_signal: torch.Tensor | None = None
        self.residual: tuple[torch.Tensor, torch.Tensor | None] | None = None
        self.accumulated = 0.0
        self.report = CacheReport(self.kind, self.threshold)
        #: host copies of every step's signal (``CacheConfig.record``)
        self.signals: list[torch.Tensor] = []

    def clock(self) -> tuple[int, int | None]:
        """The step of the generation in progress (without a clock: the number of calls so far)."""
        if self._clock is not None:
            return self._clock()
        return self.calls, None

    def _forced(self, step: int) -> bool:
        f = self.config.force_skip
        return bool(f) and step > 0 and math.floor((step + 1) * f) > math.floor(step * f)  # type: ignore[operator]

    def decide(self, signal: torch.Tensor) -> bool:
        """Whether this step skips; reads the one global scalar of the distance (every device gets the same
        answer, because the controller decides)."""
        step, num_steps = self.clock()
        self.calls += 1
        if step == 0:
            self.reset()
        report = self.report
        report.num_steps = max(report.num_steps, step + 1) if num_steps is None else num_steps
        distance: float | None = None
        if self.prev_signal is not None and self.residual is not None:
            distance = float(relative_l1(signal, self.prev_signal).item())
        if self.config.record:
            self.signals.append(_host(signal))
        skip = self._rule(step, num_steps, distance)
        if self.config.force_skip:
            skip = self.residual is not None and self._forced(step)
        report.distances.append(distance)
        if skip:
            report.skipped.append(step)
        if self.kind == "tea" or not skip:
            self.prev_signal = (
                signal  # FBC compares with the last *computed* step, TeaCache with the previous one
            )
        return skip

    def _rule(self, step: int, num_steps: int | None, distance: float | None) -> bool:
        if distance is None:
            return False
        if self.kind == "fbc":
            return distance < self.threshold
        if num_steps is not None and step >= num_steps - 1:
            self.accumulated = 0.0
            return False
        self.accumulated += rescale(self.coefficients, distance)
        if self.accumulated < self.threshold:
            return True
        self.accumulated = 0.0
        return False

    def store(self, residual: torch.Tensor, context_residual: torch.Tensor | None) -> None:
        self.residual = (residual, context_residual)

    def cached(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        assert self.residual is not None
        return self.residual


def _host(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if is_dtorch(t) else t.detach().cpu()  # type: ignore[attr-defined]


def _add(x: torch.Tensor | None, r: torch.Tensor | None) -> torch.Tensor | None:
    return x if x is None or r is None else x + r


def _sub(x: torch.Tensor | None, y: torch.Tensor | None) -> torch.Tensor | None:
    return None if x is None or y is None else x - y


class CachedBlocks(nn.Module):
    """Every block of the transformer in order (FLUX: double then single blocks), with a step cache in front.

    Called like one diffusers block — ``(hidden_states, encoder_hidden_states, temb, **kwargs) ->
    (encoder_hidden_states, hidden_states)`` — so the unmodified ``forward`` of the transformer runs it. It runs in
    two segments with the decision between them: the *head* (FBC: the first block and its residual; TeaCache: the
    modulated input) and the *tail* (the other blocks and their residual). ``compile`` wraps each segment (e.g.
    ``torch.compile(backend="dtorch")``): a decision inside a compiled graph would be a graph break in the
    transformer's block loop, which dynamo cannot resume, so with a cache the segments are compiled instead of the
    whole forward."""

    #: SD3's loop reads ``block.context_pre_only`` for ControlNet residuals (``is False``: never added here)
    context_pre_only = None

    def __init__(
        self,
        blocks: list[nn.Module],
        state: CacheState,
        *,
        compile: Callable[[Callable[..., Any]], Callable[..., Any]] | None = None,
    ) -> None:
        super().__init__()
        if not blocks:
            raise PipelineParallelError("CachedBlocks: the transformer has no blocks to cache")
        self.blocks = nn.ModuleList(blocks)
        self.state = state
        head, tail = (
            (self._tea_head, self._tea_tail) if state.kind == "tea" else (self._fbc_head, self._fbc_tail)
        )
        self._head = head if compile is None else compile(head)
        self._tail = tail if compile is None else compile(tail)

    def _run(
        self, blocks: Any, h: torch.Tensor, e: torch.Tensor | None, temb: torch.Tensor, kwargs: dict[str, Any]
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        for block in blocks:
            e, h = block(hidden_states=h, encoder_hidden_states=e, temb=temb, **kwargs)
        return e, h

    def _fbc_head(
        self, h: torch.Tensor, e: torch.Tensor | None, temb: torch.Tensor, kwargs: dict[str, Any]
    ) -> Any:
        e1, h1 = self._run(self.blocks[:1], h, e, temb, kwargs)
        return e1, h1, h1 - h

    def _fbc_tail(
        self, h: torch.Tensor, e: torch.Tensor | None, temb: torch.Tensor, kwargs: dict[str, Any]
    ) -> Any:
        e2, h2 = self._run(self.blocks[1:], h, e, temb, kwargs)
        return e2, h2, h2 - h, _sub(e2, e)

    def _tea_head(
        self, h: torch.Tensor, e: torch.Tensor | None, temb: torch.Tensor, kwargs: dict[str, Any]
    ) -> Any:
        first: Any = self.blocks[0]
        return e, h, first.norm1(h, emb=temb)[0]

    def _tea_tail(
        self, h: torch.Tensor, e: torch.Tensor | None, temb: torch.Tensor, kwargs: dict[str, Any]
    ) -> Any:
        e2, h2 = self._run(self.blocks, h, e, temb, kwargs)
        return e2, h2, h2 - h, _sub(e2, e)

    def forward(
        self,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None,
        temb: torch.Tensor,
        **kwargs: Any,
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        state = self.state
        e, h, signal = self._head(hidden_states, encoder_hidden_states, temb, kwargs)
        if state.decide(signal):
            res, res_e = state.cached()
            return _add(e, res_e), h + res
        e2, h2, res, res_e = self._tail(h, e, temb, kwargs)
        state.store(res, res_e)
        return e2, h2


def install_cache(
    transformer: nn.Module,
    config: CacheConfig,
    *,
    clock: StepClock | None = None,
    compile: Callable[[Callable[..., Any]], Callable[..., Any]] | None = None,
) -> CacheState:
    """Replace ``transformer``'s block lists by one :class:`CachedBlocks` (in place); returns its state.
    ``clock`` gives the step of the generation (:func:`scheduler_clock`); without one, calls are counted.
    ``compile`` wraps the cached blocks' two segments (see :class:`CachedBlocks`)."""
    blocks = list(getattr(transformer, "transformer_blocks", []))
    single = getattr(transformer, "single_transformer_blocks", None)
    if single is not None:
        blocks += list(single)
    if any(isinstance(b, CachedBlocks) for b in blocks):
        raise PipelineParallelError("install_cache: the transformer already has a step cache")
    if config.kind == "tea" and not hasattr(blocks[0] if blocks else None, "norm1"):
        raise PipelineParallelError(
            f"CacheConfig(kind='tea'): the first block of {type(transformer).__name__} has no norm1 (the "
            "timestep-modulated input TeaCache compares); use kind='fbc'"
        )
    coefficients = config.coefficients
    if coefficients is None:
        coefficients = FLUX_TEA_COEFFICIENTS if type(transformer).__name__.startswith("Flux") else (1.0, 0.0)
    state = CacheState(config, coefficients=coefficients, clock=clock)
    transformer.transformer_blocks = nn.ModuleList([CachedBlocks(blocks, state, compile=compile)])
    if single is not None:
        transformer.single_transformer_blocks = nn.ModuleList()
    log.info("step cache %s (threshold %g) over %d blocks", config.kind, state.threshold, len(blocks))
    return state


def cache_state(transformer: nn.Module) -> CacheState | None:
    for block in getattr(transformer, "transformer_blocks", []):
        if isinstance(block, CachedBlocks):
            return block.state
    return None


def cache_report(pipe: Any) -> CacheReport | None:
    """The last generation's :class:`CacheReport` of a pipeline parallelized with ``ExecuteConfig(cache=...)``
    (``None`` without a cache or before the first call)."""
    state = cache_state(getattr(pipe, "transformer", pipe))
    return None if state is None or not state.report.num_steps else state.report
