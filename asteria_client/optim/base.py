"""What Shampoo, SOAP and KL-Shampoo share: named parameters, blocking, sources, state, safety.

Subclasses implement two methods: :meth:`AsteriaOptimizer._first_step` (a parameter's state
from its first gradient) and :meth:`AsteriaOptimizer._step_groups`, one regular step of every
*tile group* — the tiles of one shape stepping together, whose state is stacked so that each
operation runs once per group (see :mod:`asteria_client.optim.grouped`); everything around them
lives here:

- parameters are known by name (``model.named_parameters()``), so state is keyed by parameter
  name and tile, not by position: a checkpoint loads into a model whose groups are ordered
  differently, or (later) into another world size;
- every gradient is checked for NaN/Inf *before* anything changes; a bad one raises
  :class:`NonFiniteGradientError` naming the parameter (or, with ``nonfinite="skip"``, the whole
  step is skipped and counted) — never a silent NaN in the weights;
- roots and bases come from the :class:`~asteria_client.runtime.FreshnessRuntime` it holds
  (submit, install, staleness budget, barrier, local fallback, hooks); the optimizer only says
  what to compute (``_make_request``) and how a result enters its state (``_install``).
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import math
import warnings
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from asteria_client.distributed import JobLayout, distributed_job, job_source, replica_agreement
from asteria_client.optim import grouped as batched
from asteria_client.optim.blocking import BlockingPlan, LargeDimPolicy, plan_blocking
from asteria_client.optim.grouped import (
    GroupCache,
    GroupKernels,
    GroupStep,
    ParamStep,
    StepMask,
    StorageSpec,
    TileGroup,
)
from asteria_client.optim.installs import InstallBatch, Pending
from asteria_client.optim.params import ParamNamer, model_names, named_param_groups
from asteria_client.optim.reshard import ReshardReport, reshard_state
from asteria_client.optim.sharding import (
    ShardGeometry,
    is_dtensor,
    local_tensor,
    param_of_key,
    parse_key,
    shard_geometry,
)
from asteria_client.runtime import (
    DEFAULT_REFRESH_OVERHEAD,
    FreshnessRuntime,
    Mode,
    PreconditionerRequest,
    PreconditionerResult,
    PreconditionerSource,
    Refresh,
    StalenessPolicy,
    TileBlocks,
    make_source,
    parse_enum,
    resolve_mode,
)
from asteria_server.errors import (
    InvalidInputError,
    NonFiniteGradientError,
    UnsupportedParameterError,
)
from asteria_server.types import SolveKind

if TYPE_CHECKING:
    from asteria_client.runtime.embedded import EngineConfig

logger = logging.getLogger(__name__)

STATE_FORMAT = "asteria.optim/1"
#: A block whose solve is estimated above this many seconds is named in a construction warning.
COSTLY_SOLVE_S = 10.0
SUPPORTED_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


class NonFinitePolicy(enum.Enum):
    """What ``step()`` does when a gradient holds NaN or Inf."""

    RAISE = "raise"
    SKIP = "skip"


def check_range(
    name: str, value: float, low: float, high: float, *, high_open: bool = True
) -> None:
    ok = low <= value < high if high_open else low <= value <= high
    if not ok or math.isnan(value):
        bracket = ")" if high_open else "]"
        raise InvalidInputError(f"{name}={value!r} must be in [{low}, {high}{bracket}")


def validate_hyperparameters(
    *, lr: float, betas: tuple[float, float], weight_decay: float, **non_negative: float
) -> None:
    """The checks every optimizer makes; ``non_negative`` are further fields (eps, ...)."""
    check_range("lr", lr, 0.0, math.inf)
    if len(betas) != 2:
        raise InvalidInputError(f"betas={betas!r} must be a pair (beta1, beta2)")
    check_range("betas[0]", betas[0], 0.0, 1.0)
    check_range("betas[1]", betas[1], 0.0, 1.0)
    check_range("weight_decay", weight_decay, 0.0, math.inf)
    for name, value in non_negative.items():
        check_range(name, value, 0.0, math.inf)


def state_dtype(param: torch.Tensor) -> torch.dtype:
    """Optimizer state is float64 for float64 parameters, float32 otherwise (incl. half)."""
    return torch.float64 if param.dtype == torch.float64 else torch.float32


def block_name(param_name: str, tile: int, dim: int) -> str:
    return f"{param_name}/tile{tile}/dim{dim}"


@dataclasses.dataclass
class _DeviceCheck:
    """A usual step's finite check on its way to the host: ``[all finite, max |g| per tile]``,
    the tiles' parameter names, the states that stepped and the step."""

    copy: Any  # the runtime's PendingCopy
    names: list[str]
    states: list[dict[str, Any]]
    step: int


class AsteriaOptimizer(torch.optim.Optimizer):
    """Base class; see the module docstring. Not used directly."""

    def __init__(
        self,
        params: Iterable[Any],
        defaults: dict[str, Any],
        *,
        mode: Mode | str | None = None,
        nonfinite: NonFinitePolicy | str = NonFinitePolicy.RAISE,
        staleness_budget: int = 1,
        barrier_timeout_s: float = 30.0,
        refresh: Refresh | str = Refresh.AMORTIZED,
        refresh_overhead: float = DEFAULT_REFRESH_OVERHEAD,
        engine_config: EngineConfig | None = None,
        source: PreconditionerSource | None = None,
        address: str | None = None,
        model: torch.nn.Module | None = None,
        process_group: Any = None,
        share_blocks: bool = True,
        compile: bool | str = False,
    ) -> None:
        self._namer = ParamNamer(model_names(model))
        self._positional_warned = 0  # positional names already warned about
        self._warned: set[str] = set()
        mode = resolve_mode(mode, address if source is None else None)
        schedule: Refresh = parse_enum(Refresh, refresh, "refresh")
        try:
            policy = StalenessPolicy(
                budget_intervals=staleness_budget,
                barrier_timeout_s=barrier_timeout_s,
                refresh=schedule,
                refresh_overhead=refresh_overhead,
            )
        except ValueError as exc:
            raise InvalidInputError(str(exc)) from None
        if policy.continuous and not self.supports_continuous:
            raise InvalidInputError(
                f"refresh='continuous' is for eigenbasis optimizers (SOAP, KLShampoo); "
                f"{type(self).__name__} refreshes every precondition_frequency steps "
                "(refresh='amortized')"
            )
        self.nonfinite: NonFinitePolicy = parse_enum(NonFinitePolicy, nonfinite, "nonfinite")
        check_range("max_preconditioner_dim", defaults["max_preconditioner_dim"], 1, math.inf)
        check_range("precondition_frequency", defaults["precondition_frequency"], 1, math.inf)
        defaults["large_dim_policy"] = parse_enum(
            LargeDimPolicy, defaults["large_dim_policy"], "large_dim_policy"
        )
        if defaults.get("max_dim_ratio") is not None:
            check_range("max_dim_ratio", defaults["max_dim_ratio"], 0.0, math.inf)
        self._plans: dict[str, BlockingPlan] = {}
        #: id(param) -> where its local shard lies (None: not a DTensor)
        self._geometry: dict[int, ShardGeometry | None] = {}
        #: the tile groups of the last step (stacked state, see :mod:`.grouped`)
        self._tile_groups = GroupCache()
        #: the per-group math, compiled with ``torch.compile`` when ``compile`` asks for it
        self.kernels = GroupKernels(self._compile_backend(compile))
        self._any_dtensor: bool | None = None
        #: the last usual step's finite check, on its way to the host (see _check_on_device)
        self._pending_check: _DeviceCheck | None = None
        self._pending_error: NonFiniteGradientError | None = None
        self._skipped_steps = 0
        self.finite_check_waits = 0  # reads of a check that had not landed (a host wait)
        #: the installs of one call into the runtime, applied per tile group (see .installs)
        self._installs = InstallBatch(self._note_install, self._install_rows, self._apply_noted)
        super().__init__(named_param_groups(params, self._namer), defaults)
        #: Where results come from and how fresh they are: the only thing the math talks to.
        self.layout: JobLayout | None = None
        #: the optimizer's group: every collective of its own runs on it or on one made from it
        self._process_group = process_group
        if source is None:
            source = self._make_source(
                mode, engine_config, address, process_group, share_blocks, pulls=policy.continuous
            )
        # Replicas that share their blocks install each result at one agreed step (see
        # asteria_client.runtime.agreement): collective, like the shared source.
        agreement = None
        if self.layout is not None and self.layout.world_size > 1:
            group, shards = self._replica_group(process_group)
            agreement = replica_agreement(
                group, timeout_s=2 * policy.barrier_timeout_s + 30.0, share_shards=shards
            )
        self.runtime = FreshnessRuntime(
            source,
            policy,
            mode=mode,
            needs_first_result=self.needs_first_result,
            agreement=agreement,
        )
        self.skipped_steps = 0
        self._warn_costly_blocks()
        source.plan_blocks(self._planned_blocks())  # replicas' owners from the whole set
        if agreement is None:
            self._warn_replicas_may_drift(mode, policy, process_group)

    #: Whether ``compile=`` is supported: the optimizer's group math is written as functions
    #: whose arguments that change every step are tensors.
    supports_compile = False

    def _compile_backend(self, compile: bool | str) -> str | None:
        """The ``torch.compile`` backend of ``compile`` (True: inductor), or None (eager)."""
        if compile is False:
            return None
        if not self.supports_compile:
            raise InvalidInputError(
                f"compile={compile!r}: {type(self).__name__} has no compiled step yet (SOAP has);"
                " pass compile=False"
            )
        backend = "inductor" if compile is True else compile
        if not isinstance(backend, str):
            raise InvalidInputError(f"compile={compile!r} must be a bool or a backend name")
        known = torch._dynamo.list_backends(exclude_tags=())
        if backend not in known:
            raise InvalidInputError(
                f"compile={compile!r} is not a torch.compile backend; known: {', '.join(known)}"
            )
        return backend

    def _make_source(
        self,
        mode: Mode,
        engine_config: EngineConfig | None,
        address: str | None,
        process_group: Any,
        share_blocks: bool,
        *,
        pulls: bool = False,
    ) -> PreconditionerSource:
        """The source of ``mode``; in a ``torch.distributed`` job (and unless ``share_blocks``
        is False) one whose blocks the job's data-parallel replicas share: each is uploaded and
        solved once (per node with a daemon, per job embedded), see
        :mod:`asteria_client.distributed.replicas`. Collective then: every rank constructs.
        ``pulls``: the continuous schedule pulls from it (see ``make_source``)."""
        #: This rank's place in its job (None: a single process, or sharing turned off).
        self.layout = None
        if mode is Mode.NATIVE or not share_blocks or not distributed_job():
            return make_source(mode, engine_config, address=address, pulls=pulls)
        group, shards = self._replica_group(process_group)
        source, self.layout = job_source(
            mode, engine_config, address=address, group=group, share_shards=shards, pulls=pulls
        )
        return source

    def _replica_group(self, process_group: Any) -> tuple[Any, bool]:
        """The group whose ranks hold the same blocks, and whether those include shards' blocks.

        Under HSDP (every parameter a DTensor on one mesh, replicated along one mesh dim and
        sharded along the others) a shard's replicas are the ranks along that replicate dim:
        they share the shard's blocks, ``@`` names and all. Otherwise ``process_group`` (None:
        the world), whose ranks share the replicated parameters' blocks."""
        params: list[Any] = [p for _, p, _ in self.named_params()]
        if not params or not all(is_dtensor(p) for p in params):
            return process_group, False
        mesh = params[0].device_mesh
        if any(p.device_mesh != mesh for p in params) or mesh.ndim < 2:
            return process_group, False
        replicated = [
            dim
            for dim in range(mesh.ndim)
            if all(type(p.placements[dim]).__name__ == "Replicate" for p in params)
        ]
        if len(replicated) != 1:
            return process_group, False
        return mesh.get_group(replicated[0]), True

    # ------------------------------------------------------------------ parameters and names
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(self._namer.named_group(param_group, "the param group"))
        self._any_dtensor = None
        group = self.param_groups[-1]
        if self._namer.num_positional > self._positional_warned:
            self._positional_warned = self._namer.num_positional
            warnings.warn(
                "parameters were given without names, so Asteria keys their optimizer state by "
                "position ('param0', 'param1', ...): a checkpoint then depends on the order of "
                "the parameters. Pass model.named_parameters() (or named groups), model=model, "
                "or call optimizer.attach(model) before the first step to key it by name.",
                UserWarning,
                stacklevel=4,
            )
        for name, p in zip(group["param_names"], group["params"], strict=True):
            if p.dtype not in SUPPORTED_DTYPES:
                raise UnsupportedParameterError(
                    f"parameter {name!r} has dtype {p.dtype}; Asteria supports "
                    "float32, float64, float16 and bfloat16"
                )
        group.setdefault("large_dim_policy", self.defaults.get("large_dim_policy"))
        group["large_dim_policy"] = parse_enum(
            LargeDimPolicy, group["large_dim_policy"], "large_dim_policy"
        )
        names = [n for g in self.param_groups for n in g["param_names"]]
        if len(names) != len(set(names)):
            raise InvalidInputError("parameter names must be unique across param groups")

    def named_params(self) -> Iterator[tuple[str, torch.Tensor, dict[str, Any]]]:
        for group in self.param_groups:
            for name, p in zip(group["param_names"], group["params"], strict=True):
                yield name, p, group

    def shard(self, name: str, param: torch.Tensor) -> ShardGeometry | None:
        """Where ``param``'s local shard lies (FSDP2), or None for a tensor that is not a
        DTensor; see :mod:`~asteria_client.optim.sharding`."""
        if id(param) not in self._geometry:
            self._geometry[id(param)] = shard_geometry(name, param)
        return self._geometry[id(param)]

    def state_key(self, name: str, param: torch.Tensor) -> str:
        """The name of ``param``'s state and the prefix of its blocks: the parameter's name, and
        for a DTensor the global coordinates of this rank's shard (``fc.weight@rows0:12``)."""
        geometry = self.shard(name, param)
        return name if geometry is None else f"{name}@{geometry.key}"

    def plan(self, name: str, param: torch.Tensor, group: dict[str, Any]) -> BlockingPlan:
        """The tiles of ``param`` (a local shard for DTensors), cached under ``name`` (its state
        key)."""
        plan = self._plans.get(name)
        if plan is None:
            plan = plan_blocking(
                param.shape,
                int(group["max_preconditioner_dim"]),
                group["large_dim_policy"],
                group.get("max_dim_ratio"),
            )
            self._plans[name] = plan
        return plan

    def _warn_replicas_may_drift(
        self, mode: Mode, policy: StalenessPolicy, process_group: Any
    ) -> None:
        """Warn once, at construction, when data-parallel replicas may install results at
        different steps: their optimizers do not share blocks (``share_blocks=False``, or a
        source of the caller's own), so nothing agrees on their install steps."""
        if mode is Mode.NATIVE or policy.budget_intervals == 0 or not distributed_job():
            return
        if torch.distributed.get_world_size(process_group) < 2:
            return
        if all(is_dtensor(p) for _, p, _ in self.named_params()):
            return  # FSDP2 shards: each rank preconditions its own blocks
        warnings.warn(
            f"{type(self).__name__} with staleness_budget={policy.budget_intervals} in a "
            "torch.distributed job, without shared blocks (share_blocks=False or a source of "
            "your own): each rank installs a result in the step it arrives there, which can "
            "differ by a step between ranks, so the replicas of a replicated (DDP) parameter "
            "drift apart slightly. Leave share_blocks=True (its replicas agree on install "
            "steps), or pass staleness_budget=0 to keep replicas identical.",
            UserWarning,
            stacklevel=4,
        )

    def _planned_blocks(self) -> dict[str, int]:
        """Every block this optimizer will submit (name -> n), from the blocking plans."""
        blocks = {}
        for name, p, group in self.named_params():
            key, local = self.state_key(name, p), local_tensor(p)
            if local.numel() == 0:
                continue
            for tile in self.plan(key, local, group).tiles:
                for dim, (size, pre) in enumerate(
                    zip(tile.shape, tile.preconditioned, strict=True)
                ):
                    if pre:
                        blocks[block_name(key, tile.index, dim)] = int(size)
        return blocks

    def _warn_costly_blocks(self) -> None:
        """Warn once, at construction, when a block's solve is estimated to take long."""
        seconds_per_n3 = self.runtime.seconds_per_n3()
        costly = []
        for name, p, group in self.named_params():
            plan = self.plan(self.state_key(name, p), local_tensor(p), group)
            sizes = {
                size
                for tile in plan.tiles
                for size, pre in zip(tile.shape, tile.preconditioned, strict=True)
                if pre
            }
            if sizes and (cost := seconds_per_n3 * max(sizes) ** 3) > COSTLY_SOLVE_S:
                costly.append((cost, name, tuple(p.shape), max(sizes)))
        if not costly:
            return
        costly.sort(reverse=True)
        listed = "; ".join(
            f"{name} {shape}: {n}x{n} factor, ~{cost:.0f} s" for cost, name, shape, n in costly[:3]
        )
        more = f" (and {len(costly) - 3} more)" if len(costly) > 3 else ""
        warnings.warn(
            f"{len(costly)} parameter(s) have factors whose eigendecomposition is estimated to "
            f"take over {COSTLY_SOLVE_S:.0f} s on one core each: {listed}{more}. Lower "
            "max_preconditioner_dim (tiles), pass large_dim_policy='identity' or a smaller "
            "max_dim_ratio to leave such dims unpreconditioned, or expect slow refreshes.",
            UserWarning,
            stacklevel=4,
        )

    # ------------------------------------------------------------------ the step
    def _stepping(self) -> list[ParamStep]:
        """The parameters with a non-empty gradient, each with its gradient cut into tiles in
        the state's dtype and the step it is about to take. Changes nothing."""
        stepping = []
        for position, (name, p, group) in enumerate(self.named_params()):
            grad = p.grad
            if grad is None:
                continue
            if grad.is_sparse:
                raise UnsupportedParameterError(
                    f"parameter {name!r} has a sparse gradient; Asteria needs dense gradients "
                    "(use nn.Embedding(sparse=False))"
                )
            local = local_tensor(p)  # FSDP2: this rank's shard, preconditioned on its own
            if local.numel() == 0:
                continue
            key = self.state_key(name, p)
            state = self.state[p]
            plan = self.plan(key, local, group)
            tiles = plan.split(local_tensor(grad).to(state_dtype(p)))
            step = state["step"] + 1 if state else 1
            stepping.append(ParamStep(key, local, tiles, state, group, plan, step, position))
        return stepping

    def _first_bad_gradient(self, stepping: list[ParamStep]) -> str | None:
        """The name of the first parameter whose gradient holds NaN or Inf (None: all finite).

        One max-abs reduction per tensor of ``stacks`` (the tile groups' stacked gradients,
        when given: a handful of tensors) or of the tiles' gradients (``_foreach_norm`` with
        ord = inf propagates NaN and Inf), not one check per parameter; only a bad step looks
        for which parameter it was. Across FSDP2 ranks every rank holds other rows: all skip
        (or raise) together, or none does."""
        tensors = [g for e in stepping for g in e.grads]
        by_kind: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
        for tensor in tensors:
            by_kind.setdefault((tensor.dtype, tensor.device), []).append(tensor)
        flags = [
            torch.stack(torch._foreach_norm(group, math.inf)).isfinite().all()
            for group in by_kind.values()
        ]
        first = len(stepping)  # none
        finite = flags[0] if len(flags) == 1 else torch.stack(flags).all() if flags else None
        if finite is not None and not bool(finite):
            first = next(
                position
                for position, entry in enumerate(stepping)
                if not all(bool(torch.isfinite(g).all()) for g in entry.grads)
            )
        if not self._sharded():
            return stepping[first].name if first < len(stepping) else None
        # by position among all parameters: ranks whose shard of a parameter is empty skip it
        named = [name for name, _, _ in self.named_params()]
        position = stepping[first].position if first < len(stepping) else len(named)
        sharded = next(p for _, p, _ in self.named_params() if is_dtensor(p))
        flag = torch.tensor([position], device=local_tensor(sharded).device)
        torch.distributed.all_reduce(
            flag, op=torch.distributed.ReduceOp.MIN, group=self._process_group
        )
        agreed = int(flag.item())
        return named[agreed] if agreed < len(named) else None

    def _sharded(self) -> bool:
        """Whether any parameter is a DTensor (FSDP2): checked once per set of parameters."""
        if self._any_dtensor is None:
            self._any_dtensor = any(is_dtensor(p) for _, p, _ in self.named_params())
        return self._any_dtensor

    def _check_on_device(self, stepping: list[ParamStep], steps: list[GroupStep]) -> None:
        """The usual step's finite check, without reading anything on the host: each tile's
        max |gradient| (a NaN or Inf stays one) goes to the host on the side, and every update
        of the step is masked by the flag "all finite" (:class:`~.grouped.StepMask`), so a bad
        step changes nothing. The next step (or ``skipped_steps``, ``state_dict()``) reads the
        copy, by then long landed: a bad step is then counted (``"skip"``) or raised
        (``"raise"``), naming the parameter, and its step counts are taken back."""
        norms: list[torch.Tensor] = []
        names: list[str] = []
        for work in steps:
            dims = batched.tile_dims(work.grads)
            norms.append(torch.linalg.vector_norm(work.grads, ord=math.inf, dim=dims))
            names.extend(entry.name for entry, _ in work.owners)
        first = norms[0]
        if any(n.dtype != first.dtype or n.device != first.device for n in norms):
            # float64 holds every float's maximum exactly: no finite one turns into an Inf
            norms = [n.to(device=first.device, dtype=torch.float64) for n in norms]
        norms_all = torch.cat(norms)
        finite = torch.isfinite(norms_all).all()
        if self._sharded():  # every rank holds other rows: all skip (or raise) together
            # The same collective as a first step's host check (the MIN of the first bad
            # parameter's position, or the number of parameters), so that ranks meet whichever
            # path they take: a rank whose shards are all empty takes the first-step one.
            none = sum(1 for _ in self.named_params())
            positions = self._tile_positions(steps)
            bad_at = torch.where(torch.isfinite(norms_all), none, positions).min().reshape(1)
            torch.distributed.all_reduce(
                bad_at, op=torch.distributed.ReduceOp.MIN, group=self._process_group
            )
            finite = (bad_at == none).reshape(())
        record = torch.cat([finite.to(norms_all.dtype).reshape(1), norms_all])
        self._pending_check = _DeviceCheck(
            self.runtime.copy_to_host(record),
            names,
            [entry.state for entry in stepping],
            steps[0].step,
        )
        masks: dict[tuple[torch.dtype, torch.device], StepMask] = {}
        for work in steps:
            kind = (work.grads.dtype, work.grads.device)
            if kind not in masks:
                masks[kind] = StepMask(finite.to(device=kind[1], dtype=kind[0]))
            work.mask = masks[kind]
            work.grads.nan_to_num_(0.0, 0.0, 0.0)  # a masked step must not bring NaN in

    @staticmethod
    def _tile_positions(steps: list[GroupStep]) -> torch.Tensor:
        """Per tile of ``steps`` (in the order of their gradients' maxima), its parameter's
        position among all parameters, on the device (each group keeps its own)."""
        for work in steps:
            if work.group.positions is None:
                values = [entry.position for entry, _ in work.owners]
                work.group.positions = torch.tensor(values, device=work.grads.device)
        device = steps[0].grads.device
        return torch.cat([work.group.positions.to(device) for work in steps])  # type: ignore[union-attr]

    def _settle_checks(self, *, raise_now: bool) -> None:
        """Read the last usual step's finite check (see :meth:`_check_on_device`); a bad
        step's counts go back, and it is counted or its error kept to raise."""
        check, self._pending_check = self._pending_check, None
        if check is not None:
            if not check.copy.ready():
                self.finite_check_waits += 1  # the host waits for the device here (rare)
            check.copy.wait()
            values = check.copy.host.numpy()
            if values[0] == 0.0:  # not all finite
                for state in check.states:
                    state["step"] -= 1
                bad = [n for n, v in zip(check.names, values[1:], strict=True) if not v < math.inf]
                name = bad[0] if bad else "(one on another rank)"
                if self.nonfinite is NonFinitePolicy.RAISE:
                    self._pending_error = NonFiniteGradientError(
                        f"gradient of parameter {name!r} held NaN or Inf at step {check.step}; "
                        "that step was not applied (its weights and state are unchanged) and "
                        "neither is this one (lower the learning rate, check the loss, or pass "
                        "nonfinite='skip' to skip such steps)"
                    )
                else:
                    self._skipped_steps += 1
                    self._warn_once(
                        "skip", f"skipping steps with non-finite gradients (first: {name!r})"
                    )
        if raise_now and self._pending_error is not None:
            error, self._pending_error = self._pending_error, None
            raise error

    @property
    def skipped_steps(self) -> int:
        """Steps skipped for a non-finite gradient (``nonfinite="skip"``)."""
        self._settle_checks(raise_now=False)
        return self._skipped_steps

    @skipped_steps.setter
    def skipped_steps(self, value: int) -> None:
        self._skipped_steps = value

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._settle_checks(raise_now=True)
        with self.runtime.publishing():  # the step's snapshots leave the device in one copy
            stepped = self._step_all()
            with self._installs.window():  # native mode solves them now: installed together
                self.runtime.flush()
        if stepped and self.runtime.continuous:
            # the workers free now get the neediest blocks; a new step's overhead budget
            with self._installs.window():
                self.runtime.pull(self._put_into_use, step_end=True)
        return loss

    def _step_all(self) -> bool:
        """One step of every parameter with a gradient (inside the runtime's publishing);
        False when a first step's non-finite gradient skipped it."""
        stepping = self._stepping()
        steps: list[GroupStep] | None = None
        if stepping and all(entry.state for entry in stepping):
            # the usual step: checked on the device, its updates masked by the result
            steps = self._tile_groups.steps(stepping, self.storage_spec)
            self._check_on_device(stepping, steps)
        else:  # a first step: check each gradient on the host, then create the state
            bad = self._first_bad_gradient(stepping)
            if bad is not None:
                if self.nonfinite is NonFinitePolicy.RAISE:
                    raise NonFiniteGradientError(
                        f"gradient of parameter {bad!r} holds NaN or Inf; the step was not "
                        "applied and the weights are unchanged (lower the learning rate, check "
                        "the loss, or pass nonfinite='skip' to skip such steps)"
                    )
                self._skipped_steps += 1
                self._warn_once(
                    "skip", f"skipping steps with non-finite gradients (first: {bad!r})"
                )
                return False
        regular = []
        for entry in stepping:
            state = entry.state
            if not state:
                state["tiles"] = []
            state["step"] = entry.step
            if entry.step == 1 and not self._first_step(
                entry.name, entry.param, entry.grads, state, entry.group, entry.plan
            ):
                continue
            regular.append(entry)
        if steps is None and regular:
            steps = self._tile_groups.steps(regular, self.storage_spec)
        if steps:
            # replicated blocks: the results every replica holds go into use now, on all
            with self._installs.window():
                self.runtime.begin_step(
                    [tile for work in steps for tile in work.tiles if isinstance(tile, TileBlocks)],
                    max(work.step for work in steps),
                    self._put_into_use,
                )
            self._step_groups(steps)
        return True

    #: Which fields of this optimizer's tiles are stacked per group (subclasses).
    storage_spec: ClassVar[dict[type, StorageSpec]] = {}

    def _first_step(
        self,
        name: str,
        param: torch.Tensor,
        tiles: list[torch.Tensor],
        state: dict[str, Any],
        group: dict[str, Any],
        plan: BlockingPlan,
    ) -> bool:
        """A parameter's first step: create its tiles (``state["tiles"]``) from its gradient,
        already cut into ``tiles``; return whether it also takes a regular step now."""
        raise NotImplementedError  # abstract: each optimizer initializes its state

    def _step_groups(self, steps: list[GroupStep]) -> None:
        """One regular step of every tile group (tiles of one shape, see :mod:`.grouped`);
        each group's parameter updates go through :meth:`_apply_updates`."""
        raise NotImplementedError  # abstract: each optimizer defines its update

    def _apply_updates(
        self,
        updates: list[tuple[GroupStep, torch.Tensor, float, float]],
        *,
        decay_first: bool,
    ) -> None:
        """Add ``alpha * update`` to every parameter, with decoupled weight decay ``decay``
        (``p *= 1 - decay`` before the update when ``decay_first``, else ``p -= decay * p``
        after it), one ``_foreach`` operation per (alpha, decay) for all the groups' tiles. A
        parameter cut into several tiles, or reshaped into one, is assembled first. Half-
        precision parameters are updated in float32 and rounded once."""
        Bucket = tuple[float, float, bool, StepMask | None]
        buckets: dict[Bucket, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
        partial: dict[int, list[Any]] = {}
        for work, update, alpha, decay in updates:
            for (entry, index), row in zip(work.owners, update.unbind(0), strict=True):
                if entry.direct:
                    full = row
                else:
                    pieces = partial.setdefault(id(entry), [None] * len(entry.plan.tiles))
                    pieces[index] = row
                    if any(piece is None for piece in pieces):
                        continue
                    full = entry.plan.merge(pieces)
                exact = entry.param.dtype == full.dtype
                key = (alpha, decay, exact, work.mask)
                params, rows = buckets.setdefault(key, ([], []))
                params.append(entry.param)
                rows.append(full)
        for (alpha, decay, exact, mask), (params, rows) in buckets.items():
            if mask is not None:
                torch._foreach_mul_(rows, mask.keep)  # a step that does not count moves nothing
            work_on = params if exact else [p.to(rows[0].dtype) for p in params]
            if decay > 0 and decay_first:
                torch._foreach_mul_(work_on, 1 - decay if mask is None else 1 - mask.scaled(decay))
            torch._foreach_add_(work_on, rows, alpha=alpha)
            if decay > 0 and not decay_first:
                if mask is None:
                    torch._foreach_add_(work_on, work_on, alpha=-decay)
                else:
                    torch._foreach_mul_(work_on, 1 - mask.scaled(decay))
            if not exact:
                torch._foreach_copy_(params, work_on)

    # ------------------------------------------------------------------ the runtime
    @property
    def source(self) -> PreconditionerSource:
        """Where this optimizer's results come from (native, embedded engine, daemon)."""
        return self.runtime.source

    @property
    def mode(self) -> Mode:
        return self.runtime.mode

    @property
    def staleness(self) -> StalenessPolicy:
        return self.runtime.policy

    def _block_names(self, name: str, tile: int) -> list[str | None]:
        """Per-dim block names of one tile (None where the dim is not preconditioned)."""
        plan = self._plans[name].tiles[tile]
        return [
            block_name(name, tile, dim) if pre else None
            for dim, pre in enumerate(plan.preconditioned)
        ]

    def _zero_factors(self, blocks: list[str | None], grad: torch.Tensor) -> list[Any]:
        """A zero n×n factor for every preconditioned dim of a tile (None elsewhere)."""
        return [
            None if block is None else grad.new_zeros(size, size)
            for block, size in zip(blocks, grad.shape, strict=True)
        ]

    def _eigenbasis_request(
        self, tile: Any, dim: int, version: int, group: dict[str, Any]
    ) -> PreconditionerRequest:
        """A new basis for one factor: a QR refresh from the basis in use (eigh at first)."""
        self._installs.settle(tile, dim)  # the basis in use must be in place before it is read
        return PreconditionerRequest(
            block=tile.blocks[dim],
            version=version,
            kind=SolveKind.EIGENBASIS,
            matrix=tile.factors[dim],
            basis=tile.bases[dim],
            base_version=tile.versions[dim],
            deadline_step=self.runtime.deadline_step(version, group["precondition_frequency"]),
        )

    #: True when a block cannot be used before its first result (a SOAP / KL-Shampoo basis).
    needs_first_result = False
    #: True when the optimizer can run ``refresh="continuous"`` (its tiles go through
    #: ``_refresh_tile``).
    supports_continuous = False
    #: The dataclasses of this optimizer's per-tile state (checkpoints are rebuilt into them).
    tile_types: tuple[type, ...] = ()

    def _make_request(
        self, tile: Any, dim: int, version: int, group: dict[str, Any]
    ) -> PreconditionerRequest:
        """The snapshot request of one block from its current factor (subclasses)."""
        raise NotImplementedError  # abstract

    def _install(self, tile: Any, dim: int, result: PreconditionerResult) -> None:
        """Put a newer result into use (subclasses): once per installed version."""
        raise NotImplementedError  # abstract

    def _put_into_use(self, tile: Any, dim: int, result: PreconditionerResult) -> None:
        """The runtime's install: collected into the open batch where this optimizer batches
        its installs (:mod:`.installs`), else :meth:`_install` at once."""
        if self._installs.collecting and self._batches_installs():
            self._installs.add(tile, dim, result)
        else:
            self._install(tile, dim, result)

    def _batches_installs(self) -> bool:
        """Whether installs are batched (subclasses that implement the three methods below;
        never where ``_install`` was replaced, so that a replacement sees every install)."""
        return False

    def _note_install(self, tile: Any, dim: int, result: PreconditionerResult) -> Any:
        """Collecting an install: what it needs of the tile as it is now; moves the version."""
        raise NotImplementedError  # abstract: only where _batches_installs()

    def _apply_noted(self, item: Pending) -> None:
        """Apply one collected install on its own."""
        raise NotImplementedError  # abstract: only where _batches_installs()

    def _install_group(self, item: Pending) -> TileGroup | None:
        """The tile group whose storage an install writes, where it can be applied with the
        group's other installs along its dim (None: on its own)."""
        return None

    def _install_group_rows(self, group: TileGroup, dim: int, rows: list[Pending]) -> None:
        """Apply several installs into ``group`` along ``dim`` together (subclasses)."""
        raise NotImplementedError  # abstract: only where _install_group() names groups

    def _install_rows(self, items: list[Pending]) -> None:
        """Apply one round of collected installs (at most one per tile): those into one tile
        group along one dim together, the rest one at a time."""
        together: dict[tuple[int, int], tuple[TileGroup, list[Pending]]] = {}
        for item in items:
            group = self._install_group(item)
            if group is None:
                self._apply_noted(item)
            else:
                together.setdefault((id(group), item[1]), (group, []))[1].append(item)
        for (_, dim), (group, rows) in together.items():
            if len(rows) == 1:
                self._apply_noted(rows[0])
            else:
                self._install_group_rows(group, dim, rows)

    def _submit_tile(self, tile: TileBlocks, version: int, group: dict[str, Any]) -> None:
        """Snapshot every factor of the tile, then install whatever is ready already."""
        with self._installs.window():
            self.runtime.submit(
                tile,
                version,
                int(group["precondition_frequency"]),
                lambda dim, v: self._make_request(tile, dim, v, group),
                self._put_into_use,
            )

    def _refresh_tile(
        self, tile: TileBlocks, step: int, group: dict[str, Any], *, due: bool
    ) -> None:
        """The tile's factors now hold step ``step``: submit them when the amortized schedule
        says so (``due``), or offer them to the continuous schedule, which pulls the blocks
        that need it when a worker is free."""
        if self.runtime.continuous:
            self.runtime.offer(tile, step, lambda dim, v: self._make_request(tile, dim, v, group))
        elif due:
            self._submit_tile(tile, step, group)

    def _sync_tile(self, tile: TileBlocks, step: int, group: dict[str, Any]) -> None:
        """Install ready results and make every block of the tile meet the staleness budget."""
        with self._installs.window():
            self.runtime.sync(
                tile,
                step,
                int(group["precondition_frequency"]),
                lambda dim, v: self._make_request(tile, dim, v, group),
                self._put_into_use,
            )

    def _sync_tiles(self, tiles: list[Any], step: int, group: dict[str, Any]) -> None:
        """:meth:`_sync_tile` of every tile of one tile group (its list, kept from step to
        step): the runtime looks only at the tiles that changed since their last sync."""
        with self._installs.window():
            self.runtime.sync_tiles(
                tiles,
                step,
                int(group["precondition_frequency"]),
                lambda tile: lambda dim, v: self._make_request(tile, dim, v, group),
                self._put_into_use,
            )

    def _block_tiles(self) -> Iterator[tuple[int, TileBlocks]]:
        """(step, tile) for every tile with blocks."""
        for _, p, _ in self.named_params():
            state = self.state.get(p)
            if state:
                for tile in state["tiles"]:
                    if isinstance(tile, TileBlocks):
                        yield state["step"], tile

    # ------------------------------------------------------------------ hooks
    def pump(self) -> None:
        """Move transfers along and install every ready result (cheap; called by hooks)."""
        with self._installs.window():
            self.runtime.pump(lambda: (tile for _, tile in self._block_tiles()), self._put_into_use)

    def attach(self, model: torch.nn.Module) -> None:
        """Register hooks that pump results into place while the model computes, so ``step()``
        usually finds them installed. Optional: without it, ``step()`` pumps too. Before the
        first step it also names parameters that were passed without names."""
        self._adopt_names(model)
        self.runtime.attach(model, self.pump)

    def _adopt_names(self, model: torch.nn.Module) -> None:
        """Replace positional names (``param0``, ...) with ``model``'s names, before any state
        exists; after the first step the state stays keyed as it is."""
        if not self._namer.positional_ids:
            return
        names = model_names(model)
        if any(self.state.get(p) for _, p, _ in self.named_params()):
            if any(id(p) in names for p in self._positional_params()):
                self._warn_once(
                    "rename",
                    "attach(model) came after the first step: optimizer state stays keyed by "
                    "position ('param0', ...); attach before the first step to key it by name",
                )
            return
        for group in self.param_groups:
            group["param_names"] = [
                names.get(id(p), n) if id(p) in self._namer.positional_ids else n
                for n, p in zip(group["param_names"], group["params"], strict=True)
            ]
        self._namer.positional_ids -= set(names)
        self._plans.clear()
        all_names = [n for g in self.param_groups for n in g["param_names"]]
        if len(all_names) != len(set(all_names)):
            raise InvalidInputError("parameter names must be unique across param groups")

    def _positional_params(self) -> list[torch.Tensor]:
        return [p for _, p, _ in self.named_params() if id(p) in self._namer.positional_ids]

    def detach(self) -> None:
        self.runtime.detach()

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            logger.warning(message)

    # ------------------------------------------------------------------ status
    def preconditioner_status(self) -> list[dict[str, Any]]:
        """One dict per block: ``block``, ``version`` in use (-1: none yet), ``staleness_steps``
        (step - version), ``lag_steps`` (newest snapshot - version when the block was last used
        by a step: what the budget bounds; a snapshot taken at the end of that step is not
        counted until the next step uses the block), ``freshness``, ``failures``,
        ``last_solve_s`` and what the source knows besides."""
        return self.runtime.status_rows(self._block_tiles())

    def refresh_stats(self) -> dict[str, Any]:
        """Per block (``"blocks"``): installs, pulls, refreshes per 100 steps and the drift of
        the basis each install replaced (off-diagonal energy of QᵀLQ over ‖L‖², see
        :mod:`asteria_client.runtime.refresh`); and their means over blocks."""
        return self.runtime.refresh_stats()

    def runtime_stats(self) -> dict[str, Any]:
        """Barrier waits, timeouts, local fallbacks and the observed lag, for benchmarks."""
        return self.runtime.stats()

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """State keyed by parameter name (and tile inside), plus group hyperparameters.

        A sharded (FSDP2) parameter's state is keyed by its shard's global coordinates
        (``fc.weight@rows0:12``) and says where the shard lies (``"shard"``): every rank's
        entries are distinct, replicas' entries are equal, so ``torch.distributed.checkpoint``
        saves each once; see :mod:`asteria_client.optim.checkpoint` for loading."""
        self._settle_checks(raise_now=False)  # a bad last step's counts go back first
        state = {}
        for name, p, _ in self.named_params():
            if self.state.get(p):
                entry = _clone_tree(self.state[p])
                geometry = self.shard(name, p)
                if geometry is not None:
                    entry["shard"] = geometry.to_dict()
                state[self.state_key(name, p)] = entry
        groups = []
        for group in self.param_groups:
            saved = {k: v for k, v in group.items() if k != "params"}
            saved["large_dim_policy"] = group["large_dim_policy"].value
            groups.append(saved)
        return {
            "format": STATE_FORMAT,
            "state": state,
            "param_groups": groups,
            "skipped_steps": self.skipped_steps,
        }

    def checkpoint_entries(self, saved: Iterable[str]) -> set[str]:
        """Which of a checkpoint's state entries this rank needs: its own shard's when saved,
        else every saved shard of the parameter whose rows overlap its own (and entries of
        parameters it does not have, so that loading names them)."""
        by_param: dict[str, list[str]] = {}
        for key in saved:
            by_param.setdefault(param_of_key(key), []).append(key)
        wanted = set()
        for name, p, _ in self.named_params():
            keys = by_param.pop(name, [])
            key = self.state_key(name, p)
            if key in keys:
                wanted.add(key)
                continue
            mine = self.shard(name, p) or ShardGeometry.whole(tuple(p.shape))
            for other in keys:
                spans = parse_key(other.partition("@")[2]) if "@" in other else {}
                if spans is None or all(
                    max(start, mine.span(dim)[0]) < min(stop, mine.span(dim)[1])
                    for dim, (start, stop) in spans.items()
                ):
                    wanted.add(other)
        wanted.update(key for keys in by_param.values() for key in keys)
        return wanted

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if state_dict.get("format") != STATE_FORMAT:
            raise InvalidInputError(
                f"not an Asteria optimizer checkpoint (format={state_dict.get('format')!r}); "
                f"expected {STATE_FORMAT!r}"
            )
        saved_state = state_dict.get("state", {})
        saved_groups = state_dict["param_groups"]
        by_name = {n: g for g in saved_groups for n in g["param_names"]}
        known = {name for name, _, _ in self.named_params()}
        unknown = sorted(k for k in saved_state if param_of_key(k) not in known)
        if unknown:
            raise InvalidInputError(
                f"checkpoint holds state for parameters this optimizer does not have: "
                f"{unknown[:5]}{' ...' if len(unknown) > 5 else ''}"
            )
        for group in self.param_groups:
            source = by_name.get(group["param_names"][0]) if group["param_names"] else None
            if source is None:
                continue
            for key, value in source.items():
                if key in ("param_names", "params"):
                    continue
                group[key] = value
            group["large_dim_policy"] = parse_enum(
                LargeDimPolicy, group["large_dim_policy"], "large_dim_policy"
            )
        self._plans.clear()
        self._pending_check, self._pending_error = None, None  # of the state being replaced
        self.runtime.bases_replaced()  # the engine no longer holds the bases in use
        self.state.clear()
        self._tile_groups.clear()  # the old groups' stacks go with the state they held
        report = ReshardReport()
        resubmit: list[tuple[Any, int, dict[str, Any]]] = []
        for name, p, group in self.named_params():
            key = self.state_key(name, p)
            local = local_tensor(p)
            saved = saved_state.get(key)
            if saved is None:
                pieces = {k: v for k, v in saved_state.items() if param_of_key(k) == name}
                if pieces and local.numel():  # saved with another shard geometry
                    geometry = self.shard(name, p) or ShardGeometry.whole(tuple(p.shape))
                    restored, rebuilt = reshard_state(
                        self,
                        name,
                        key,
                        geometry,
                        local,
                        group,
                        _clone_tree(pieces, device=local.device),
                        report,
                    )
                    self.state[p] = restored
                    resubmit.extend((tile, restored["step"], group) for tile in rebuilt)
                continue
            tiles = saved.get("tiles", [])
            plan = self.plan(key, local, group)
            if len(tiles) not in (0, len(plan.tiles)):
                raise InvalidInputError(
                    f"checkpoint state of {key!r} has {len(tiles)} tiles but the parameter "
                    f"(shape {tuple(local.shape)}) is blocked into {len(plan.tiles)}; "
                    "max_preconditioner_dim or the parameter's shape changed"
                )
            restored = _clone_tree(saved, device=local.device)
            restored.pop("shard", None)
            restored["tiles"] = [self._tile_from_dict(name, t) for t in restored.get("tiles", [])]
            self.state[p] = restored
        self.skipped_steps = int(state_dict.get("skipped_steps", 0))
        if report.params:
            warnings.warn(report.message(), UserWarning, stacklevel=2)
        for tile, step, group in resubmit:  # rebuilt factors: their roots or bases, now
            if any(block is not None for block in getattr(tile, "blocks", ())):
                self._submit_tile(tile, step, group)

    # What resharding (:mod:`asteria_client.optim.reshard`) needs to know of an optimizer.
    #: The factors are means over the tile's other elements (KL-Shampoo), not sums.
    factors_are_means = False
    #: The tile fields shaped like the tile that :meth:`_moments_in_param_coords` returns.
    param_coordinate_moments: tuple[str, ...] = ("exp_avg", "exp_avg_sq")

    def _moments_in_param_coords(self, tile: Any) -> dict[str, torch.Tensor]:
        """The tile's moments in the parameter's coordinates (the default: as they are)."""
        return {name: getattr(tile, name) for name in self.param_coordinate_moments}

    def _diagonals(self, tile: Any) -> list[torch.Tensor | None]:
        """Per dim, a diagonal preconditioner kept for an unpreconditioned dim (None: none)."""
        return []

    def _tile_from_parts(
        self,
        key: str,
        index: int,
        moments: dict[str, torch.Tensor],
        factors: list[torch.Tensor | None],
        diagonals: list[torch.Tensor | None],
    ) -> Any:
        """A tile rebuilt from moments in the parameter's coordinates and factors, with no root
        or basis yet (subclasses)."""
        raise NotImplementedError  # abstract

    def _tile_from_dict(self, name: str, saved: dict[str, Any]) -> Any:
        """A checkpointed tile (a plain dict) as this optimizer's tile dataclass."""
        keys = set(saved)
        for tile_type in self.tile_types:
            if {f.name for f in dataclasses.fields(tile_type)} == keys:
                return tile_type(**saved)
        raise InvalidInputError(
            f"checkpoint state of {name!r} holds a tile with fields {sorted(keys)}, which is not "
            f"a tile of {type(self).__name__}; was it saved by another optimizer?"
        )

    def close(self) -> None:
        """Release the preconditioner source (worker processes, connections). Idempotent.

        Also done when the optimizer is garbage-collected, and at interpreter exit."""
        self._settle_checks(raise_now=False)
        if self._pending_error is not None:  # the last step was bad and no step came after
            logger.warning("%s", self._pending_error)
            self._pending_error = None
        self.runtime.close()

    def __enter__(self) -> AsteriaOptimizer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _clone_tree(tree: Any, device: torch.device | None = None) -> Any:
    """A deep copy of tensors in dicts, lists and tile dataclasses (which become dicts)."""
    if dataclasses.is_dataclass(tree) and not isinstance(tree, type):
        tree = {f.name: getattr(tree, f.name) for f in dataclasses.fields(tree)}
    if isinstance(tree, torch.Tensor):
        out = tree.detach().clone()
        return out.to(device) if device is not None else out
    if isinstance(tree, dict):
        return {k: _clone_tree(v, device) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_clone_tree(v, device) for v in tree]
    return tree
