"""``OpRule`` — the template every core operator follows — and the registry keyed by dispatcher overload.

The skeleton (:meth:`OpRule.plan`) is fixed: check inputs -> infer output metadata -> placement signatures -> match
per mesh axis -> assign devices/stream -> cost. Families override hooks only.

Rules are registered at import by decorator, one file per op family::

    @register_rule(aten.mm.default, family="matmul")
    def mm(call: OpCall) -> list[PlacementSignature]: ...

    @register_rule(aten.view.default, aten._unsafe_view.default, family="view", intercept=True)
    class ViewRule(OpRule): ...

``intercept=True`` puts the overload on the **intercept list**: the overloads the ``dtorch`` device must receive
whole (views and semantic composite ops that the dispatcher would otherwise decompose before our key).

The plan cache and the keys of constant arguments live in :mod:`.plan_keys` (re-exported here).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from torch_dtorch._compat import has_kernel_for_dispatch_key
from torch_dtorch.config import RedistributePolicy, get_config
from torch_dtorch.errors import NoRuleError, RuleRegistrationError, ShapeError
from torch_dtorch.graph import AssignInfo, OperatorCost, TensorMeta
from torch_dtorch.ops.cost import elementwise_cost
from torch_dtorch.placement import Placements
from torch_dtorch.placement_rules.call import LocalContext, OpCall
from torch_dtorch.placement_rules.matcher import Match, match
from torch_dtorch.placement_rules.plan_keys import (
    PLAN_CACHE,
    PLAN_CACHE_SIZE,
    clear_plan_cache,
    const_key,
    float_bits,
    number_key,
    plan_key,
)
from torch_dtorch.placement_rules.signature import PlacementSignature, all_replicate

__all__ = [
    "FunctionRule",
    "Growth",
    "add_rule_listener",
    "clear_plan_cache",
    "const_key",
    "float_bits",
    "number_key",
    "OpPlan",
    "OpRule",
    "get_rule",
    "intercept_list",
    "register_rule",
    "registered_ops",
    "unregister_rule",
]

SignatureFn = Callable[[OpCall], Sequence[PlacementSignature]]
KernelFn = Callable[[OpCall, LocalContext, tuple[Any, ...], dict[str, Any]], Any]


class Growth(NamedTuple):
    """A function rule's :meth:`OpRule.growth_key` and :meth:`OpRule.grown_meta` (``register_rule(growth=...)``)."""

    key: Callable[[OpCall], Any]
    meta: Callable[[OpCall, Sequence[TensorMeta]], list[TensorMeta] | None]


@dataclass(frozen=True)
class OpPlan:
    """Everything the graph constructor needs to add one operator."""

    out_meta: list[TensorMeta]
    match: Match
    assign: AssignInfo
    cost: OperatorCost

    @property
    def out_placements(self) -> tuple[Placements, ...]:
        return self.match.out_placements


class OpRule:
    """Base of every op's rule. Override :meth:`signatures`; the defaults below cover the rest."""

    family: str = ""
    #: stream the operator runs on: ``compute`` or ``comm``
    stream: str = "compute"
    #: the output is a view of input slot ``view_of`` (``None``: a fresh tensor)
    view_of: int | None = None
    #: input slots that must keep their placements (in-place ops write ``self`` where it is)
    pinned_inputs: tuple[int, ...] = ()
    #: the output IS input slot ``output_is_input`` (in-place ops), not a new value
    output_is_input: int | None = None
    #: the outputs ARE the first ``len(out_meta)`` input slots, written in place (``_foreach_*_`` list ops)
    writes_inputs: bool = False
    #: when no signature fits (or the inputs span several meshes), the device runs torch's own
    #: CompositeExplicitAutograd kernel instead, which calls the per-tensor op on each element (list ops)
    op_by_op_fallback: bool = False
    #: a plan never depends on the call's Python scalars (``Scalar``/``Scalar[]`` arguments; list ops: an
    #: optimizer's per-step step sizes), only on their types: the eager fast path keys them by type
    #: (``device/fastpath_lists.py``) and every run carries its own
    plan_ignores_scalars: bool = False
    #: the all-Replicate signature joins :meth:`signatures` automatically (a rule that always returns a reachable
    #: signature may turn it off, so that a cheaper-looking gather of everything never competes)
    auto_replicate: bool = True
    ops: tuple[Any, ...] = ()

    # --- the skeleton ---------------------------------------------------------------------------------------------
    def plan(
        self,
        call: OpCall,
        *,
        policy: RedistributePolicy | None = None,
        prefer_outputs: tuple[Placements, ...] | None = None,
    ) -> OpPlan:
        """The fixed skeleton. ``prefer_outputs`` asks for given output placements (factories with
        ``placements=``): among matching signatures the one producing them wins, and if none does it is an error."""
        policy = policy if policy is not None else get_config().redistribute
        key = plan_key(call, policy, prefer_outputs, self)
        if key is not None:
            hit = PLAN_CACHE.get(key)
            if hit is not None:
                call.out_meta = hit.out_meta
                return hit
        self.check_inputs(call)
        call.out_meta = self.infer_meta(call)
        sigs = list(self.signatures(call))
        n_in, n_out = len(call.inputs), len(call.out_meta)
        if self.auto_replicate and not any(s.is_all_replicate and len(s.inputs) == n_in for s in sigs):
            sigs.append(all_replicate(n_in, n_out))
        m = match(call, sigs, policy, prefer_outputs=prefer_outputs, pinned=self.pinned_for(call))
        plan = OpPlan(call.out_meta, m, self.assign(call), self.cost(call))
        if key is not None:
            if len(PLAN_CACHE) >= PLAN_CACHE_SIZE:
                PLAN_CACHE.clear()
            PLAN_CACHE[key] = plan
        return plan

    # --- abstract hooks -------------------------------------------------------------------------------------------
    def signatures(self, call: OpCall) -> Sequence[PlacementSignature]:
        """Legal placements on one mesh axis for this call (all-Replicate is added automatically)."""
        raise NotImplementedError(f"{type(self).__name__}.signatures")

    # --- defaults -------------------------------------------------------------------------------------------------
    def check_inputs(self, call: OpCall) -> None:
        """Reject bad arguments with a :class:`ShapeError` before anything is queued (default: nothing)."""

    def infer_meta(self, call: OpCall) -> list[TensorMeta]:
        """Global output metadata, by running the op on meta tensors."""
        args, kwargs = call.to_meta_args()
        try:
            try:
                out = call.op(*args, **kwargs)
            except RuntimeError:
                if self.family != "view":
                    raise
                # ``view`` of a strided value: the user's tensor claims contiguity; locally it is a reshape
                args, kwargs = call.to_meta_args(contiguous=True)
                out = call.op(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 - re-raised typed, with the operands named
            described = "\n".join(f"    {x.describe()}" for x in call.present())
            raise ShapeError(f"{call.op}: shape inference failed: {e}\n  arguments:\n{described}") from e
        outs = out if isinstance(out, (list, tuple)) else (out,)
        return [TensorMeta.of(t) for t in outs if isinstance(t, torch.Tensor)]

    def pinned_for(self, call: OpCall) -> Sequence[int]:
        """Input slots this call must not redistribute (default: :attr:`pinned_inputs`)."""
        return self.pinned_inputs

    def constants_key(self, call: OpCall) -> Any:
        """The plan cache's key for the non-tensor arguments (default: all of them). A rule whose plan does not
        depend on some constant (a list op's per-tensor scalars, which change every optimizer step) leaves it out,
        so that the call plans once."""
        return (const_key(call.args), const_key(call.kwargs))

    def localize(self, call: OpCall, ctx: LocalContext) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """Args/kwargs of the local kernel on one rank (operands stay in place; the runtime swaps in shards).

        The default passes the global arguments unchanged; ops whose arguments name sizes (views, factories,
        ``split`` with uneven shards, ...) override it.
        """
        return call.args, call.kwargs

    def kernel(self, call: OpCall, ctx: LocalContext, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Run the local op on one rank with localized args (shards already substituted). Default: the op itself.

        Override for ops whose local result is not the op on local arguments (e.g. random factories that must
        generate the global tensor and keep the rank's slice, so results equal single-device torch)."""
        return call.op(*args, **kwargs)

    def kernel_is_op(self, op: Any) -> bool:
        """The local kernel of ``op`` is the op itself on the localized arguments (the default :meth:`kernel`): a
        worker may resolve such a call once — :meth:`localize` included, whose result depends only on what a
        fast-path plan fixes (layouts, shapes, constants) and the rank — and replay it (``runtime/replay.py``)."""
        return type(self).kernel is OpRule.kernel and "kernel" not in vars(self)

    def may_run_op_as_is(self, op: Any) -> bool:
        """Some calls of ``op`` run the op itself locally (:meth:`runs_op_as_is`): checked by a worker before every
        replay, so that a kernel patched at run time (tests, tools) takes the general path."""
        return self.kernel_is_op(op)

    def runs_op_as_is(self, call: OpCall, ctx: LocalContext) -> bool:
        """This call's local kernel on the rank ``ctx`` describes is its op on the localized arguments, so a worker
        may resolve it once and replay it (``runtime/replay.py``). Default: :meth:`kernel_is_op`; a rule whose
        kernel is the op only for some calls (``dropout`` without training, ``arange`` whole on the rank) decides
        from what a fast-path plan fixes (constants, layouts, the rank's shapes)."""
        return self.kernel_is_op(call.op)

    def local_op(self, call: OpCall) -> Any:
        """The overload a call that :meth:`runs_op_as_is` runs on the localized arguments: the call's own (the
        default), or the one the rule's kernel runs instead (``squeeze.dim`` runs as ``squeeze.dims``)."""
        return call.op

    def assign(self, call: OpCall) -> AssignInfo:
        devices = tuple(call.mesh.devices) if call.mesh is not None else ()
        return AssignInfo(devices, self.stream)

    def cost(self, call: OpCall) -> OperatorCost:
        return elementwise_cost(call.inputs, call.out_meta)

    # --- shape-generic decisions (placement_rules/growth.py) -------------------------------------------------------
    def growth_key(self, call: OpCall) -> Any:
        """A key of the call's shapes and strides such that every call of the op with an equal key (and equal
        meshes, placements, dtypes and constants) gets the same signatures, pinned slots and input checks, and
        :meth:`grown_meta` gives its output metadata; ``None`` (the default): the decision depends on the exact
        shapes. See ``growth.py`` for what makes such a key sound."""
        return None

    def grown_meta(self, call: OpCall, kept: Sequence[TensorMeta]) -> list[TensorMeta] | None:
        """The output metadata of ``call``, by arithmetic, given ``kept``: that of a call with the same
        :meth:`growth_key` (``None``: not derivable, infer it)."""
        return None


class FunctionRule(OpRule):
    """A rule given as a plain function ``call -> signatures`` (plus optional hook functions)."""

    def __init__(
        self,
        fn: SignatureFn,
        *,
        family: str,
        localize: Callable[[OpCall, LocalContext], tuple[tuple[Any, ...], dict[str, Any]]] | None = None,
        cost: Callable[[OpCall], OperatorCost] | None = None,
        check: Callable[[OpCall], None] | None = None,
        kernel: KernelFn | None = None,
        as_is: Callable[[OpCall], bool] | None = None,
        view_of: int | None = None,
        stream: str = "compute",
        growth: Growth | None = None,
    ) -> None:
        self._fn = fn
        self._growth = growth
        self._kernel = kernel
        #: the calls for which ``kernel`` runs the op itself (see :meth:`OpRule.runs_op_as_is`)
        self._as_is = as_is
        self._declared_kernel = kernel
        self.family = family
        self._localize = localize
        self._cost = cost
        self._check = check
        self.view_of = view_of
        self.stream = stream
        self.__doc__ = fn.__doc__

    def signatures(self, call: OpCall) -> Sequence[PlacementSignature]:
        return self._fn(call)

    def check_inputs(self, call: OpCall) -> None:
        if self._check is not None:
            self._check(call)

    def localize(self, call: OpCall, ctx: LocalContext) -> tuple[tuple[Any, ...], dict[str, Any]]:
        if self._localize is not None:
            return self._localize(call, ctx)
        return super().localize(call, ctx)

    def kernel(self, call: OpCall, ctx: LocalContext, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if self._kernel is not None:
            return self._kernel(call, ctx, args, kwargs)
        return super().kernel(call, ctx, args, kwargs)

    def kernel_is_op(self, op: Any) -> bool:
        return self._kernel is None and "kernel" not in vars(self)

    def _declared(self) -> bool:
        """The kernel is the one registered with ``as_is`` (not patched since)."""
        return (
            self._as_is is not None and self._kernel is self._declared_kernel and "kernel" not in vars(self)
        )

    def may_run_op_as_is(self, op: Any) -> bool:
        return self.kernel_is_op(op) or self._declared()

    def runs_op_as_is(self, call: OpCall, ctx: LocalContext) -> bool:
        if self._declared():
            assert self._as_is is not None
            return self._as_is(call)
        return self.kernel_is_op(call.op)

    def local_op(self, call: OpCall) -> Any:
        # a declared kernel that runs another overload says which (``kernel.local_op``: see ``_kernel_as``)
        if self._declared():
            return getattr(self._declared_kernel, "local_op", call.op)
        return call.op

    def cost(self, call: OpCall) -> OperatorCost:
        if self._cost is not None:
            return self._cost(call)
        return super().cost(call)

    def growth_key(self, call: OpCall) -> Any:
        return None if self._growth is None else self._growth.key(call)

    def grown_meta(self, call: OpCall, kept: Sequence[TensorMeta]) -> list[TensorMeta] | None:
        return None if self._growth is None else self._growth.meta(call, kept)

    def __repr__(self) -> str:
        return f"FunctionRule({self._fn.__qualname__}, family={self.family!r})"


_RULES: dict[Any, OpRule] = {}
_INTERCEPT: dict[Any, None] = {}


#: called with the overload whenever its rule is registered or removed (caches above the registry subscribe)
_RULE_LISTENERS: list[Callable[[Any], None]] = []


def add_rule_listener(fn: Callable[[Any], None]) -> None:
    """Call ``fn(op)`` whenever ``op``'s rule is registered or removed (to drop what a cache derived from it)."""
    if fn not in _RULE_LISTENERS:
        _RULE_LISTENERS.append(fn)


#: overloads outside ``aten`` whose rules want a dtorch device kernel, and who installs them (the device layer, once
#: it is registered: rules never import it)
_KERNEL_REQUESTS: list[Any] = []
_KERNEL_SERVERS: list[Callable[[list[Any]], Any]] = []


def request_device_kernels(ops: Iterable[Any]) -> None:
    """Give ``ops`` (ruled overloads of any namespace) a dtorch device kernel: now if the device is registered,
    else when it is."""
    ops = list(ops)
    _KERNEL_REQUESTS.extend(ops)
    for serve in list(_KERNEL_SERVERS):
        serve(ops)


def serve_kernel_requests(serve: Callable[[list[Any]], Any]) -> None:
    """Called by the device layer: ``serve(ops)`` installs kernels for the requests so far and every later one."""
    if serve not in _KERNEL_SERVERS:
        _KERNEL_SERVERS.append(serve)
        serve(list(_KERNEL_REQUESTS))


def _rules_changed(ops: Iterable[Any]) -> None:
    PLAN_CACHE.clear()
    for op in ops:
        for fn in list(_RULE_LISTENERS):
            fn(op)


def _check_op(op: Any) -> None:
    if not isinstance(op, (torch._ops.OpOverload, str)):
        raise RuleRegistrationError(
            f"register_rule: {op!r} is not a dispatcher overload; register e.g. torch.ops.aten.mm.default, "
            "not the packet torch.ops.aten.mm"
        )


def _is_composite_implicit(op: Any) -> bool:
    """Composite ops decompose above the backend key, so the ``dtorch`` device must intercept them to see them."""
    if isinstance(op, str):
        return False
    return has_kernel_for_dispatch_key(op, "CompositeImplicitAutograd")


def register_rule(
    *ops: Any,
    family: str,
    intercept: bool = False,
    localize: Callable[[OpCall, LocalContext], tuple[tuple[Any, ...], dict[str, Any]]] | None = None,
    cost: Callable[[OpCall], OperatorCost] | None = None,
    check: Callable[[OpCall], None] | None = None,
    kernel: KernelFn | None = None,
    as_is: Callable[[OpCall], bool] | None = None,
    view_of: int | None = None,
    stream: str = "compute",
    growth: Growth | None = None,
) -> Callable[[Any], Any]:
    """Register a rule for one or more overloads. Decorates a function ``call -> signatures`` or an
    :class:`OpRule` subclass (instantiated once). Registering an overload twice raises
    :class:`RuleRegistrationError`. CompositeImplicitAutograd overloads join the intercept list automatically;
    ``intercept=True`` adds others (views, which would otherwise arrive as anonymous ``as_strided``). ``as_is``:
    the calls for which ``kernel`` is the op itself (:meth:`OpRule.runs_op_as_is`); ``growth``: the rule's
    :meth:`OpRule.growth_key` and :meth:`OpRule.grown_meta`."""

    def deco(target: Any) -> Any:
        if isinstance(target, OpRule):  # a rule object (re-registered, or derived like in-place variants)
            rule: OpRule = target
        elif isinstance(target, type) and issubclass(target, OpRule):
            rule = target()
            if not rule.family:
                rule.family = family
        else:
            rule = FunctionRule(
                target,
                family=family,
                localize=localize,
                cost=cost,
                check=check,
                kernel=kernel,
                as_is=as_is,
                view_of=view_of,
                stream=stream,
                growth=growth,
            )
        for op in ops:
            _check_op(op)
            if op in _RULES:
                raise RuleRegistrationError(
                    f"register_rule: {op} already has a rule ({_RULES[op]!r}); an overload has exactly one rule — "
                    "remove the other registration or use unregister_rule() first"
                )
        for op in ops:
            _RULES[op] = rule
            if intercept or _is_composite_implicit(op):
                _INTERCEPT[op] = None
        rule.ops = tuple(rule.ops) + tuple(ops)
        _rules_changed(ops)
        return target

    return deco


def unregister_rule(op: Any) -> OpRule:
    """Remove and return a rule (for tests and for users replacing a built-in rule)."""
    _INTERCEPT.pop(op, None)
    rule = _RULES.pop(op)
    _rules_changed([op])
    return rule


def get_rule(op: Any) -> OpRule:
    try:
        return _RULES[op]
    except KeyError:
        raise NoRuleError(op) from None


def registered_ops() -> list[Any]:
    return list(_RULES)


def intercept_list() -> list[Any]:
    """Overloads the ``dtorch`` device registers kernels for so that they arrive whole (views, composites)."""
    return list(_INTERCEPT)


def rules_by_family() -> dict[str, list[Any]]:
    out: dict[str, list[Any]] = {}
    for op, rule in _RULES.items():
        out.setdefault(rule.family, []).append(op)
    return out


def iter_rules() -> Iterable[tuple[Any, OpRule]]:
    return _RULES.items()
