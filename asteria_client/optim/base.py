"""What Shampoo, SOAP and KL-Shampoo share: named parameters, blocking, sources, state, safety.

Subclasses implement one method, :meth:`AsteriaOptimizer._step_param`, for one parameter with a
non-empty, finite gradient; everything around it lives here:

- parameters are known by name (``model.named_parameters()``), so state is keyed by parameter
  name and tile, not by position: a checkpoint loads into a model whose groups are ordered
  differently, or (later) into another world size;
- every gradient is checked for NaN/Inf *before* anything changes; a bad one raises
  :class:`NonFiniteGradientError` naming the parameter (or, with ``nonfinite="skip"``, the whole
  step is skipped and counted) — never a silent NaN in the weights;
- roots and bases come from a :class:`PreconditionerSource`; results are installed only when
  their version is newer than the one in use, and a failed computation leaves the last good
  result in place.
"""

from __future__ import annotations

import enum
import logging
import math
import os
import time
import warnings
import weakref
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from asteria_client.optim.blocking import BlockingPlan, LargeDimPolicy, plan_blocking
from asteria_client.optim.params import ParamNamer, model_names, named_param_groups
from asteria_client.runtime.source import (
    NativeSource,
    PreconditionerRequest,
    PreconditionerResult,
    PreconditionerSource,
    compute_locally,
)
from asteria_client.runtime.staleness import BarrierStats, StalenessPolicy, freshness
from asteria_server.engine import EngineConfig
from asteria_server.errors import (
    AsteriaError,
    InvalidInputError,
    NonFiniteGradientError,
    SolverError,
    UnsupportedParameterError,
)
from asteria_server.types import SolveKind

logger = logging.getLogger(__name__)

STATE_FORMAT = "asteria.optim/1"
#: A block whose solve is estimated above this many seconds is named in a construction warning.
COSTLY_SOLVE_S = 10.0
SUPPORTED_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


class Mode(enum.Enum):
    """Where roots and eigenbases are computed."""

    NATIVE = "native"  # synchronously, in step(), on the parameter's device
    EMBEDDED = "embedded"  # an engine in this process, solver worker processes
    DAEMON = "daemon"  # the node's asteria-server


class NonFinitePolicy(enum.Enum):
    """What ``step()`` does when a gradient holds NaN or Inf."""

    RAISE = "raise"
    SKIP = "skip"


def parse_enum(enum_type: type[enum.Enum], value: Any, field: str) -> Any:
    """Accept an enum member or its string value; name the field on failure."""
    if isinstance(value, enum_type):
        return value
    try:
        return enum_type(value)
    except ValueError:
        allowed = ", ".join(repr(m.value) for m in enum_type)
        raise InvalidInputError(f"{field}={value!r} is not one of {allowed}") from None


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


def resolve_mode(mode: Mode | str | None) -> Mode:
    """``None`` means: the daemon when ``ASTERIA_ADDRESS`` is set, else the embedded engine."""
    if mode is None:
        return Mode.DAEMON if os.environ.get("ASTERIA_ADDRESS") else Mode.EMBEDDED
    return parse_enum(Mode, mode, "mode")


def make_source(
    mode: Mode, engine_config: EngineConfig | None = None, *, address: str | None = None
) -> PreconditionerSource:
    """The source of ``mode``; the daemon's ``address`` defaults to ``ASTERIA_ADDRESS``."""
    if mode is Mode.NATIVE:
        return NativeSource()
    if mode is Mode.EMBEDDED:
        from asteria_client.runtime.embedded import EmbeddedSource

        return EmbeddedSource(engine_config)
    from asteria_client.config import resolve_address
    from asteria_client.transport.daemon import DaemonSource

    return DaemonSource(address=resolve_address(address))


def block_name(param_name: str, tile: int, dim: int) -> str:
    return f"{param_name}/tile{tile}/dim{dim}"


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
        engine_config: EngineConfig | None = None,
        source: PreconditionerSource | None = None,
        address: str | None = None,
        model: torch.nn.Module | None = None,
    ) -> None:
        self._namer = ParamNamer(model_names(model))
        self._positional_warned = 0  # positional names already warned about
        self._warned: set[str] = set()
        self.mode: Mode = resolve_mode(mode)
        self.staleness = StalenessPolicy(
            budget_intervals=staleness_budget, barrier_timeout_s=barrier_timeout_s
        )
        self.barrier_stats = BarrierStats()
        self._local_failures: dict[str, int] = {}
        self._local_errors: dict[str, str] = {}
        self._lag_at_use: dict[str, int] = {}
        self._pumped_epoch: int | None = None
        self._hooks: list[Any] = []
        self.nonfinite: NonFinitePolicy = parse_enum(NonFinitePolicy, nonfinite, "nonfinite")
        check_range("max_preconditioner_dim", defaults["max_preconditioner_dim"], 1, math.inf)
        check_range("precondition_frequency", defaults["precondition_frequency"], 1, math.inf)
        defaults["large_dim_policy"] = parse_enum(
            LargeDimPolicy, defaults["large_dim_policy"], "large_dim_policy"
        )
        if defaults.get("max_dim_ratio") is not None:
            check_range("max_dim_ratio", defaults["max_dim_ratio"], 0.0, math.inf)
        self._plans: dict[str, BlockingPlan] = {}
        super().__init__(named_param_groups(params, self._namer), defaults)
        self._source = (
            source if source is not None else make_source(self.mode, engine_config, address=address)
        )
        # Workers and connections go when the optimizer is collected, even without close():
        # the finalizer holds the source, never the optimizer.
        self._finalizer = weakref.finalize(self, self._source.close)
        self.skipped_steps = 0
        self._warn_costly_blocks()

    # ------------------------------------------------------------------ parameters and names
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(self._namer.named_group(param_group, "the param group"))
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

    def plan(self, name: str, param: torch.Tensor, group: dict[str, Any]) -> BlockingPlan:
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

    def _warn_costly_blocks(self) -> None:
        """Warn once, at construction, when a block's solve is estimated to take long."""
        seconds_per_n3 = self._source.seconds_per_n3()
        costly = []
        for name, p, group in self.named_params():
            plan = self.plan(name, p, group)
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
    def _first_bad_gradient(self) -> str | None:
        grads, names = [], []
        for name, p, _ in self.named_params():
            if p.grad is None or p.numel() == 0:
                continue
            if p.grad.is_sparse:
                raise UnsupportedParameterError(
                    f"parameter {name!r} has a sparse gradient; Asteria needs dense gradients "
                    "(use nn.Embedding(sparse=False))"
                )
            grads.append(p.grad)
            names.append(name)
        if not grads:
            return None
        finite = torch.stack([torch.isfinite(g).all() for g in grads])
        if bool(finite.all()):
            return None
        return names[int((~finite).nonzero()[0])]

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        bad = self._first_bad_gradient()
        if bad is not None:
            if self.nonfinite is NonFinitePolicy.RAISE:
                raise NonFiniteGradientError(
                    f"gradient of parameter {bad!r} holds NaN or Inf; the step was not applied "
                    "and the weights are unchanged (lower the learning rate, check the loss, or "
                    "pass nonfinite='skip' to skip such steps)"
                )
            self.skipped_steps += 1
            self._warn_once("skip", f"skipping steps with non-finite gradients (first: {bad!r})")
            return loss
        for name, p, group in self.named_params():
            if p.grad is None or p.numel() == 0:
                continue
            state = self.state[p]
            if not state:
                state["step"] = 0
                state["tiles"] = []
            state["step"] += 1
            plan = self.plan(name, p, group)
            tiles = plan.split(p.grad.to(state_dtype(p)))
            self._step_param(name, p, tiles, state, group, plan)
        return loss

    def _step_param(
        self,
        name: str,
        param: torch.Tensor,
        tiles: list[torch.Tensor],
        state: dict[str, Any],
        group: dict[str, Any],
        plan: BlockingPlan,
    ) -> None:
        """Update one parameter from its gradient, already cut into ``tiles`` in the state's
        dtype; ``state["step"]`` counts this call."""
        raise NotImplementedError  # abstract: each optimizer defines its update

    def _block_bookkeeping(self, name: str, tile: int) -> dict[str, list[Any]]:
        """Per-dim block names (None where unpreconditioned), versions in use, newest snapshot."""
        plan = self._plans[name].tiles[tile]
        blocks = [
            block_name(name, tile, dim) if pre else None
            for dim, pre in enumerate(plan.preconditioned)
        ]
        return {"blocks": blocks, "versions": [-1] * len(blocks), "submitted": [-1] * len(blocks)}

    def _eigenbasis_request(
        self, tile_state: dict[str, Any], dim: int, version: int, group: dict[str, Any]
    ) -> PreconditionerRequest:
        """A new basis for one factor: a QR refresh from the basis in use (eigh at first)."""
        return PreconditionerRequest(
            block=tile_state["blocks"][dim],
            version=version,
            kind=SolveKind.EIGENBASIS,
            matrix=tile_state["factors"][dim],
            basis=tile_state["bases"][dim],
            base_version=tile_state["versions"][dim],
            deadline_step=version
            + self.staleness.budget_intervals * group["precondition_frequency"],
        )

    # ------------------------------------------------------------------ results
    #: True when a block cannot be used before its first result (a SOAP / KL-Shampoo basis).
    needs_first_result = False

    def _needs_first(self) -> bool:
        """Whether a block must wait for its first result before the tile can step.

        Only at S = 0 (and in native mode): there the optimizer must equal native mode, which
        starts from the first eigenbasis. With a budget S >= 1 a SOAP / KL-Shampoo tile starts
        in the identity basis (plain Adam in the parameter's coordinates; the moments are
        rotated into the first basis when it arrives), and the budget bounds how long that may
        last, as for any other result: the first steps never stall on a solve.
        """
        return self.needs_first_result and (
            self._source.synchronous or self.staleness.budget_intervals == 0
        )

    def _make_request(
        self, tile_state: dict[str, Any], dim: int, version: int, group: dict[str, Any]
    ) -> PreconditionerRequest:
        """The snapshot request of one block from its current factor (subclasses)."""
        raise NotImplementedError  # abstract

    def _install(self, tile_state: dict[str, Any], dim: int, result: PreconditionerResult) -> None:
        """Put a newer result into use (subclasses): once per installed version."""
        raise NotImplementedError  # abstract

    def _submit_tile(self, tile_state: dict[str, Any], version: int, group: dict[str, Any]) -> None:
        """Snapshot every factor of the tile, then install whatever is ready already."""
        for dim, block in enumerate(tile_state["blocks"]):
            if block is None:
                continue
            request = self._make_request(tile_state, dim, version, group)
            tile_state["submitted"][dim] = version
            try:
                self._source.submit(request)
            except AsteriaError as exc:  # a source must not take training down
                self.barrier_stats.submit_errors += 1
                self._warn_once("submit", f"could not submit snapshots ({exc}); computing locally")
        self._install_ready(tile_state)

    def _install_ready(self, tile_state: dict[str, Any]) -> None:
        for dim, block in enumerate(tile_state["blocks"]):
            if block is None:
                continue
            result = self._take_newer(block, tile_state["versions"][dim])
            if result is not None:
                self._install(tile_state, dim, result)

    def _take_newer(self, block: str, installed_version: int) -> PreconditionerResult | None:
        """A ready result for ``block`` newer than ``installed_version``; older ones are dropped."""
        result = self._source.take(block)
        if result is None or result.version <= installed_version:
            return None
        return result

    def _sync_tile(self, tile_state: dict[str, Any], step: int, group: dict[str, Any]) -> None:
        """Install ready results, then make every block of the tile meet the staleness budget:
        wait (bounded) for a result in flight, else compute the block locally."""
        self._install_ready(tile_state)
        frequency = int(group["precondition_frequency"])
        for dim, block in enumerate(tile_state["blocks"]):
            if block is None:
                continue
            newest = tile_state["submitted"][dim]
            required = self.staleness.required_version(newest, frequency, self._needs_first())
            installed = tile_state["versions"][dim]
            if installed >= required:
                self._record_lag(block, max(0, newest - installed))
                continue
            result = None
            if not self._source.synchronous:
                # Returns at once when nothing >= required is computed, queued or running.
                start = time.perf_counter()
                result = self._source.wait(block, required, self.staleness.barrier_timeout_s)
                self.barrier_stats.record_wait(time.perf_counter() - start, result is not None)
            if result is None or result.version <= installed:
                result = self._compute_locally(tile_state, dim, step, group)
            if result is not None and result.version > tile_state["versions"][dim]:
                self._install(tile_state, dim, result)
            self._record_lag(block, max(0, newest - tile_state["versions"][dim]))

    def _record_lag(self, block: str, lag_steps: int) -> None:
        """The lag a block was *used* with: what the staleness budget bounds."""
        self._lag_at_use[block] = lag_steps
        self.barrier_stats.record_lag(lag_steps)

    def _compute_locally(
        self, tile_state: dict[str, Any], dim: int, step: int, group: dict[str, Any]
    ) -> PreconditionerResult | None:
        """The last-resort native computation of one block (the source was late or failed)."""
        block = tile_state["blocks"][dim]
        if not self._source.synchronous:
            self.barrier_stats.local_fallbacks += 1
            self._warn_once(
                "fallback",
                f"block {block}: no result within the staleness budget "
                f"(S={self.staleness.budget_intervals}, barrier {self.staleness.barrier_timeout_s}"
                " s); computing it locally. Further fallbacks are counted in "
                "preconditioner_status(), not logged.",
            )
        elif tile_state["versions"][dim] >= 0 or not self._needs_first():
            return None  # native: the failure was recorded at submit; keep the last good result
        try:
            return compute_locally(self._make_request(tile_state, dim, step, group))
        except SolverError as exc:
            self._local_failures[block] = self._local_failures.get(block, 0) + 1
            self._local_errors[block] = str(exc)
            return None

    # ------------------------------------------------------------------ hooks
    def pump(self) -> None:
        """Move transfers along and install every ready result (cheap; called by hooks)."""
        with torch.no_grad():
            self._source.pump()
            epoch = self._source.results_epoch()
            if epoch is not None and epoch == self._pumped_epoch:
                return  # nothing arrived since the last scan: hooks stay cheap
            self._pumped_epoch = epoch
            for _, p, _ in self.named_params():
                state = self.state.get(p)
                if state:
                    for tile_state in state["tiles"]:
                        if "blocks" in tile_state:
                            self._install_ready(tile_state)

    def attach(self, model: torch.nn.Module) -> None:
        """Register hooks that pump results into place while the model computes, so ``step()``
        usually finds them installed. Optional: without it, ``step()`` pumps too.

        Signals: a forward hook on the model and on each of its direct children, and the start
        of the backward pass. The latter is a gradient hook on the model's output, registered by
        the model's forward hook: it fires where a full backward pre-hook on the model would,
        without that hook's warning for models whose inputs need no gradient (token ids).
        """
        self.detach()
        self._adopt_names(model)
        # The hooks hold the optimizer weakly: a model must not keep a dropped optimizer (and
        # its worker processes) alive.
        optimizer = weakref.ref(self)

        def pump() -> None:
            opt = optimizer()
            if opt is not None:
                opt.pump()

        def on_forward(_module: torch.nn.Module, _inputs: Any, output: Any) -> None:
            pump()

        def on_model_forward(_module: torch.nn.Module, _inputs: Any, output: Any) -> None:
            pump()
            outputs = output if isinstance(output, tuple | list) else (output,)
            for tensor in outputs:
                if isinstance(tensor, torch.Tensor) and tensor.requires_grad:
                    tensor.register_hook(lambda grad: pump())
                    break

        self._hooks.append(model.register_forward_hook(on_model_forward))
        for child in model.children():
            self._hooks.append(child.register_forward_hook(on_forward))

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
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            logger.warning(message)

    # ------------------------------------------------------------------ status
    def _iter_blocks(self) -> Iterator[tuple[str, int, int, dict[str, Any]]]:
        """(block name, step, dim, tile state) for every preconditioned block with state."""
        for _, p, _ in self.named_params():
            state = self.state.get(p)
            if not state:
                continue
            for tile_state in state["tiles"]:
                for dim, block in enumerate(tile_state.get("blocks", [])):
                    if block is not None:
                        yield block, state["step"], dim, tile_state

    def preconditioner_status(self) -> list[dict[str, Any]]:
        """One dict per block: ``block``, ``version`` in use (-1: none yet), ``staleness_steps``
        (step - version), ``lag_steps`` (newest snapshot - version when the block was last used
        by a step: what the budget bounds; a snapshot taken at the end of that step is not
        counted until the next step uses the block), ``freshness``, ``failures``,
        ``last_solve_s`` and what the source knows besides."""
        records = self._source.records()
        rows = []
        for block, step, dim, tile_state in self._iter_blocks():
            version = int(tile_state["versions"][dim])
            newest = int(tile_state["submitted"][dim])
            record = records.get(block) or self._source.record(block)
            local_failures = self._local_failures.get(block, 0)
            row = {
                "block": block,
                "version": version,
                "staleness_steps": step - version if version >= 0 else step,
                "lag_steps": self._lag_at_use.get(block, 0),
                "freshness": freshness(version, newest).value,
                "submitted_version": newest,
                "failures": record.failures + local_failures,
                "consecutive_failures": record.consecutive_failures,
                "last_solve_s": record.last_solve_s,
                "last_error": self._local_errors.get(block) or record.last_error,
                "mode": self.mode.value,
                "budget_steps": self.staleness.budget_intervals * self._frequency_of(block),
            }
            row.update(record.extra)
            rows.append(row)
        return rows

    def runtime_stats(self) -> dict[str, Any]:
        """Barrier waits, timeouts, local fallbacks and the observed lag, for benchmarks."""
        stats = self.barrier_stats
        source_stats = getattr(self._source, "stats", None)
        return {
            "mode": self.mode.value,
            "staleness_budget": self.staleness.budget_intervals,
            "barrier_waits": stats.waits,
            "barrier_wait_s": stats.wait_s,
            "barrier_max_wait_s": stats.max_wait_s,
            "barrier_timeouts": stats.timeouts,
            "local_fallbacks": stats.local_fallbacks,
            "submit_errors": stats.submit_errors,
            "max_lag_steps": stats.max_lag_steps,
            "lag_histogram": dict(sorted(stats.lag_histogram.items())),
            "source": source_stats() if callable(source_stats) else {},
        }

    def _frequency_of(self, block: str) -> int:
        name = block.split("/tile", 1)[0]
        for group in self.param_groups:
            if name in group["param_names"]:
                return int(group["precondition_frequency"])
        return int(self.defaults["precondition_frequency"])

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """State keyed by parameter name (and tile inside), plus group hyperparameters."""
        state = {}
        for name, p, _ in self.named_params():
            if self.state.get(p):
                state[name] = _clone_tree(self.state[p])
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

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if state_dict.get("format") != STATE_FORMAT:
            raise InvalidInputError(
                f"not an Asteria optimizer checkpoint (format={state_dict.get('format')!r}); "
                f"expected {STATE_FORMAT!r}"
            )
        saved_groups = state_dict["param_groups"]
        by_name = {n: g for g in saved_groups for n in g["param_names"]}
        known = {name for name, _, _ in self.named_params()}
        unknown = sorted(set(state_dict["state"]) - known)
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
        self.state.clear()
        for name, p, group in self.named_params():
            saved = state_dict["state"].get(name)
            if saved is None:
                continue
            tiles = saved.get("tiles", [])
            plan = self.plan(name, p, group)
            if len(tiles) not in (0, len(plan.tiles)):
                raise InvalidInputError(
                    f"checkpoint state of {name!r} has {len(tiles)} tiles but the parameter "
                    f"(shape {tuple(p.shape)}) is blocked into {len(plan.tiles)}; "
                    "max_preconditioner_dim or the parameter's shape changed"
                )
            self.state[p] = _clone_tree(saved, device=p.device)
        self.skipped_steps = int(state_dict.get("skipped_steps", 0))

    def close(self) -> None:
        """Release the preconditioner source (worker processes, connections). Idempotent.

        Also done when the optimizer is garbage-collected, and at interpreter exit."""
        self.detach()
        self._finalizer()

    def __enter__(self) -> AsteriaOptimizer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _clone_tree(tree: Any, device: torch.device | None = None) -> Any:
    if isinstance(tree, torch.Tensor):
        out = tree.detach().clone()
        return out.to(device) if device is not None else out
    if isinstance(tree, dict):
        return {k: _clone_tree(v, device) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_clone_tree(v, device) for v in tree]
    return tree
