"""`asteria bench step`: what one ``optimizer.step()`` costs the host when the tensors are small.

On a GPU the optimizer step of a model with hundreds of weight matrices is bound by kernel
launches and Python, not by flops: each dispatched operation is a launch. This benchmark measures
exactly that part on the CPU, where it can be measured anywhere: the `asteria train` GPT at a
small width (``--width``, 8 by default, so that the arithmetic is negligible: at 32 the
rotations already cost SOAP measurable flops) and several depths
(``--layers``), one fixed gradient, and the host time of ``step()`` for AdamW (``foreach=True``),
Asteria's SOAP, Shampoo and KL-Shampoo, and HeavyBall's SOAP (eager, when installed); on
request also ``soap-compiled`` (``SOAP(compile=True)``: inductor, minutes to compile on a CPU). The
second-order optimizers run natively with a refresh interval longer than the run, so every timed
step is one that refreshes nothing (the steps a GPU run spends most of its time in).

The optimizers are timed in interleaved rounds (each round times ``--steps-per-round`` steps of
every optimizer, in a rotating order) on one torch thread, and each figure is the median over
rounds of the per-step time, with the ratio to AdamW taken within each round: a shared, noisy
machine slows all of a round alike. It also counts the operations each step dispatches (a
``TorchDispatchMode``), at d 128 by default (``--count-width``), the model the grouped-math
issue counted on.

Target (issue: grouped optimizer math): Asteria SOAP's host time per step <= 2x AdamW foreach's.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from asteria_client.bench import output
from asteria_client.tables import NAME_THEN_NUMBERS, markdown_table, text_table

SOAP_VS_ADAMW_TARGET = 2.0
ASTERIA = ("soap", "shampoo", "kl-shampoo", "soap-compiled")
#: A refresh interval no run reaches: every timed step refreshes nothing.
NEVER = 1_000_000


class DispatchCounter(TorchDispatchMode):
    """Counts the operations that reach the dispatcher (views and in-place ops included).

    The garbage collector is run before and held off while counting, so that no finalizer it
    happens to run inside the counted region (of anything earlier code left behind) is
    counted: where a collection falls depends on what every thread allocated before, so its
    operations would make the count vary from run to run."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0
        self._gc_was_enabled = False

    def __enter__(self) -> DispatchCounter:
        gc.collect()
        self._gc_was_enabled = gc.isenabled()
        gc.disable()
        return super().__enter__()

    def __exit__(self, *exc: object) -> None:
        try:
            super().__exit__(*exc)
        finally:
            if self._gc_was_enabled:
                gc.enable()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


def gpt(layers: int, width: int, *, vocab: int = 65, context: int = 64) -> Any:
    """The `asteria train` GPT at ``layers`` x ``width`` (4 heads when they divide it)."""
    from asteria_client.train.model import GPT, GPTConfig

    torch.manual_seed(0)
    heads = 4 if width % 4 == 0 else 1
    config = GPTConfig(
        vocab_size=vocab, block_size=context, n_layer=layers, n_head=heads, n_embd=width
    )
    return GPT(config)


def make_optimizer(name: str, model: torch.nn.Module) -> torch.optim.Optimizer:
    """AdamW (foreach), an Asteria optimizer natively with no refresh in reach, or a peer."""
    from asteria_client.train.optimizers import split_for_weight_decay

    decay, no_decay = split_for_weight_decay(model)
    if name == "adamw":
        groups = [{"params": [p for _, p in decay]}, {"params": [p for _, p in no_decay]}]
        return torch.optim.AdamW(groups, lr=1e-3, foreach=True)
    if name in ASTERIA:
        from asteria_client import SOAP, KLShampoo, Shampoo

        cls = {"soap": SOAP, "shampoo": Shampoo, "kl-shampoo": KLShampoo}[name.split("-c")[0]]
        named = [{"params": decay}, {"params": no_decay, "weight_decay": 0.0}]
        extra = {"compile": True} if name.endswith("-compiled") else {}
        return cls(named, mode="native", precondition_frequency=NEVER, **extra)
    spec = _peer(name)
    factory = spec.factory({**spec.keywords(), "precondition_frequency": NEVER})
    optimizer: torch.optim.Optimizer = factory(model)
    return optimizer


def _peer(name: str) -> Any:
    from asteria_client.bench.peers_table import PEERS

    for spec in PEERS:
        if spec.name == name:
            return spec
    raise ValueError(f"unknown optimizer {name!r}")


def available(names: list[str]) -> tuple[list[str], dict[str, str]]:
    """The optimizers that can run here, and why the others cannot."""
    runnable, skipped = [], {}
    for name in names:
        if name == "adamw" or name in ASTERIA:
            runnable.append(name)
            continue
        reason = _peer(name).unavailable_reason()
        if reason is None:
            runnable.append(name)
        else:
            skipped[name] = reason
    return runnable, skipped


def _with_gradient(model: Any, seed: int = 1) -> None:
    """One forward and backward on a fixed batch: every timed step reuses this gradient."""
    context = model.config.block_size
    generator = torch.Generator().manual_seed(seed)
    batch = torch.randint(0, model.config.vocab_size, (4, context), generator=generator)
    model.zero_grad()
    model.loss(batch, batch).backward()


def count_dispatches(name: str, layers: int, width: int) -> int:
    """Operations dispatched by one step that refreshes nothing (after two that initialize)."""
    model = gpt(layers, width)
    gradient = _FixedGradient(model)
    optimizer = make_optimizer(name, model)
    try:
        for _ in range(2):
            gradient.restore()
            optimizer.step()
        gradient.restore()
        counter = DispatchCounter()
        with counter:
            optimizer.step()
        return counter.count
    finally:
        _close(optimizer)


def _close(optimizer: Any) -> None:
    close = getattr(optimizer, "close", None)
    if callable(close):
        close()


class _FixedGradient:
    """A model's gradient, kept: optimizers that consume their gradients (HeavyBall sets
    ``p.grad = None`` in its step) get it back before each step, outside the timed region."""

    def __init__(self, model: Any) -> None:
        _with_gradient(model)
        self.pairs = [(p, p.grad) for p in model.parameters() if p.grad is not None]

    def restore(self) -> None:
        if self.pairs and self.pairs[0][0].grad is None:
            for param, grad in self.pairs:
                param.grad = grad


def time_steps(
    names: list[str],
    layers: int,
    width: int,
    *,
    rounds: int,
    steps_per_round: int,
    progress: Callable[[str], None],
) -> dict[str, list[float]]:
    """Seconds per step of each optimizer, one entry per round (interleaved rounds)."""
    runs: dict[str, tuple[_FixedGradient, torch.optim.Optimizer]] = {}
    try:
        for name in names:
            model = gpt(layers, width)
            gradient = _FixedGradient(model)
            optimizer = make_optimizer(name, model)
            for _ in range(3):  # initialization and warm-up
                gradient.restore()
                optimizer.step()
            runs[name] = (gradient, optimizer)
        times: dict[str, list[float]] = {name: [] for name in names}
        for r in range(rounds):
            order = names[r % len(names) :] + names[: r % len(names)]
            for name in order:
                gradient, optimizer = runs[name]
                spent = 0.0
                for _ in range(steps_per_round):
                    gradient.restore()
                    start = time.perf_counter()
                    optimizer.step()
                    spent += time.perf_counter() - start
                times[name].append(spent / steps_per_round)
            if (r + 1) % max(1, rounds // 4) == 0:
                progress(f"  layers={layers}: round {r + 1}/{rounds}")
        return times
    finally:
        for _, optimizer in runs.values():
            _close(optimizer)


def run_step_bench(
    *,
    names: list[str],
    layers: list[int],
    width: int,
    count_width: int,
    rounds: int,
    steps_per_round: int,
    progress: Callable[[str], None] = print,
) -> dict[str, Any]:
    runnable, skipped = available(names)
    if "adamw" not in runnable:
        raise ValueError("the benchmark compares with adamw: keep it in --optimizers")
    for name, reason in skipped.items():
        progress(f"skipping {name}: {reason}")
    torch.set_num_threads(1)
    rows: list[dict[str, Any]] = []
    for depth in layers:
        model = gpt(depth, width)
        num_params = sum(1 for _ in model.parameters())
        listed = ", ".join(runnable)
        progress(f"layers={depth} (width {width}, {num_params} parameters): timing {listed}")
        times = time_steps(
            runnable,
            depth,
            width,
            rounds=rounds,
            steps_per_round=steps_per_round,
            progress=progress,
        )
        progress(f"layers={depth}: counting dispatched operations at width {count_width}")
        for name in runnable:
            ratios = [t / a for t, a in zip(times[name], times["adamw"], strict=True)]
            rows.append(
                {
                    "optimizer": name,
                    "layers": depth,
                    "parameters": num_params,
                    "host_ms_per_step": 1e3 * statistics.median(times[name]),
                    "vs_adamw": statistics.median(ratios),
                    "dispatches": count_dispatches(name, depth, count_width),
                }
            )
    adamw_counts = {r["layers"]: r["dispatches"] for r in rows if r["optimizer"] == "adamw"}
    for row in rows:
        row["dispatches_vs_adamw"] = row["dispatches"] / adamw_counts[row["layers"]]
    soap = [r["vs_adamw"] for r in rows if r["optimizer"] == "soap"]
    return {
        "benchmark": "step",
        "config": {
            "optimizers": runnable,
            "layers": layers,
            "width": width,
            "count_width": count_width,
            "rounds": rounds,
            "steps_per_round": steps_per_round,
            "torch_threads": 1,
            "flush_denormal": False,
        },
        "skipped": skipped,
        "rows": rows,
        "targets": {
            "soap_host_time_vs_adamw": {
                "target": SOAP_VS_ADAMW_TARGET,
                "worst": max(soap) if soap else None,
                "met": bool(soap) and max(soap) <= SOAP_VS_ADAMW_TARGET,
            }
        },
    }


_COLUMNS = [
    "optimizer",
    "layers",
    "params",
    "host ms/step",
    "vs AdamW",
    "dispatches",
    "dispatches vs AdamW",
]


def _table_rows(report: dict[str, Any]) -> list[list[str]]:
    return [
        [
            r["optimizer"],
            str(r["layers"]),
            str(r["parameters"]),
            f"{r['host_ms_per_step']:.3f}",
            f"{r['vs_adamw']:.2f}x",
            str(r["dispatches"]),
            f"{r['dispatches_vs_adamw']:.2f}x",
        ]
        for r in report["rows"]
    ]


def _footer(report: dict[str, Any], bullet: str = "") -> str:
    cfg, target = report["config"], report["targets"]["soap_host_time_vs_adamw"]
    verdict = "met" if target["met"] else "NOT met"
    worst = "n/a" if target["worst"] is None else f"{target['worst']:.2f}x"
    lines = [
        f"host time: width {cfg['width']}, median of {cfg['rounds']} interleaved rounds of "
        f"{cfg['steps_per_round']} steps, 1 torch thread; dispatches: width "
        f"{cfg['count_width']}, one step that refreshes nothing",
        f"target SOAP host time <= {SOAP_VS_ADAMW_TARGET}x AdamW foreach: worst {worst}, {verdict}",
    ]
    lines += [f"skipped {name}: {reason}" for name, reason in report["skipped"].items()]
    return "\n".join(bullet + line for line in lines)


def format_report(report: dict[str, Any]) -> str:
    lines = text_table([_COLUMNS, *_table_rows(report)], align=NAME_THEN_NUMBERS)
    return "\n".join([*lines, _footer(report)])


def format_markdown(report: dict[str, Any]) -> str:
    lines = markdown_table(_COLUMNS, _table_rows(report), align=NAME_THEN_NUMBERS)
    return "\n".join([*lines, "", _footer(report, bullet="- ")])


def report_section(data: dict[str, Any]) -> str:
    """Markdown for ``asteria bench report``: the table, the target, the figure."""
    figures = "".join(f"\n\n![{Path(f).stem}]({f})" for f in data.get("figures", []))
    return format_markdown(data) + figures


def write_figure(report: dict[str, Any], path: Path) -> Path:
    fig, ax = output.new_figure()
    names = report["config"]["optimizers"]
    for name in names:
        rows = [r for r in report["rows"] if r["optimizer"] == name]
        ax.plot([r["layers"] for r in rows], [r["vs_adamw"] for r in rows], "o-", label=name)
    ax.axhline(SOAP_VS_ADAMW_TARGET, color="grey", linestyle="--", label="SOAP target")
    ax.set_xlabel("transformer layers")
    ax.set_ylabel("host time per step / AdamW foreach")
    ax.set_title(f"optimizer.step() host time, width {report['config']['width']}")
    ax.legend()
    return output.save_figure(fig, path)


def _int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}"
        ) from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def register(subparsers: Any) -> Any:
    parser = subparsers.add_parser(
        "step",
        help="host time and dispatched operations of one optimizer.step() (small tensors)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--quick", action="store_true", help="fewer rounds (about 1 minute)")
    parser.add_argument(
        "--layers", type=_int_list, default=[2, 4, 8], help="model depths (default 2,4,8)"
    )
    parser.add_argument(
        "--width", type=int, default=8, help="model width for timing (default 8: all overhead)"
    )
    parser.add_argument("--count-width", type=int, default=128, help="model width for counts")
    parser.add_argument("--rounds", type=int, help="interleaved timing rounds (default 20)")
    parser.add_argument("--steps-per-round", type=int, default=10)
    parser.add_argument(
        "--optimizers",
        default="adamw,soap,shampoo,kl-shampoo,heavyball-soap",
        help="comma-separated (default: adamw,soap,shampoo,kl-shampoo,heavyball-soap)",
    )
    parser.add_argument("--markdown", action="store_true", help="print a markdown table")
    parser.add_argument("--json", type=Path, metavar="PATH", help="write the full report here")
    return run_command


def run_command(args: argparse.Namespace) -> int:
    for name in ("width", "count_width", "steps_per_round"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
    rounds = args.rounds if args.rounds is not None else (6 if args.quick else 20)
    if rounds < 1:
        raise ValueError("--rounds must be >= 1")
    report = run_step_bench(
        names=[n.strip() for n in args.optimizers.split(",") if n.strip()],
        layers=args.layers,
        width=args.width,
        count_width=args.count_width,
        rounds=rounds,
        steps_per_round=args.steps_per_round,
    )
    report["quick"] = bool(args.quick)
    text = format_markdown(report) if args.markdown else format_report(report)
    output.publish(
        report,
        text,
        args.json,
        lambda r, path: [write_figure(r, output.figure_path(path, "ratio"))],
    )
    return 0
