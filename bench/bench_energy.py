"""make bench-energy: plan 003's claims beside what its phases measure on this machine.

Every phase of ``conf/energy_phase/`` (``energy_phase=P model=energy_cpu data=energy_synthetic``) is
built once in this process, side by side, with training's own builders (task, model, parallelize,
materialize, optimizer, loader: ``optbench.training``), and trained with ``train_step``, the step
``optbench train`` runs. After ``--warmup`` steps of each phase (excluded), every round runs one
step of each phase, interleaved (A B C ... A B C ..., the order rotating from round to round, so no
phase is always first on a machine whose load changes). A step's throughput is its samples (batch x
accumulation) over its wall time, data loading included (the loader is a claim). A claim's factor is
taken round by round, between two phases measured in the same round; the table gives the median over
the rounds, a 95% bootstrap interval of that median and the min-max spread, beside the plan's claim.
The last row is the last phase against the baseline, beside the plan's 40x. Flow steps: the mean
steps a forward used (adaptive stopping's). No run directory is written; a sweep of the same phases
through ``optbench train -m`` and ``optbench report`` (``make sweep-energy``) gives the cosine cost.

    python bench/bench_energy.py [--rounds 30] [--warmup 2] [--phases 0_baseline,1_bridge,...] [OVERRIDE ...]

On a GPU give ``train.device=cuda`` (``bash bench/gpu_check.sh all`` does): each step is then timed
between two synchronizations, so the clock reads the device's work, not its kernel launches.

Prints the machine, the command and a markdown table (what bench/RESULTS.md holds). The machine is
shared and noisy: the interval and the spread say how much.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from optbench.config import compose, to_config  # noqa: E402
from optbench.distributed import detect_machine  # noqa: E402
from optbench.optim.optimizers import build_optimizer  # noqa: E402
from optbench.report.energy import ENERGY_CLAIMS, ENERGY_TOTAL, claim_between  # noqa: E402
from optbench.tasks import build_task  # noqa: E402
from optbench.training.build import build_model, build_scaler, build_train_loader, materialize  # noqa: E402
from optbench.training.parallelize import parallelize  # noqa: E402
from optbench.training.step import StepContext, train_step  # noqa: E402

PHASES = ["0_baseline", *ENERGY_CLAIMS]
BASE = ["model=energy_cpu", "data=energy_synthetic", "data.num_samples=2048", "train.device=cpu"]
RESAMPLES, SEED = 2000, 0


def _forever(loader) -> Iterator:
    while True:
        yield from loader


class Phase:
    """One phase built as ``optbench train energy_phase=NAME ...`` builds it; ``step()`` trains one step
    and returns (samples/s, the mean flow steps its forwards used)."""

    def __init__(self, name: str, extra: list[str]) -> None:
        self.name = name
        cfg = to_config(compose([f"energy_phase={name}", *BASE, *extra]))
        machine = detect_machine(cfg.train.device)  # train.device=cpu by default; cuda on a GPU
        self.task = build_task(cfg)
        model = build_model(cfg, self.task)
        parallelize(model, cfg=cfg, machine=machine)
        materialize(model, device=machine.device, seed=cfg.train.seed)
        optimizer = build_optimizer(model, cfg=cfg.optimizer, lr=cfg.train.lr)
        self.ctx = StepContext(model=model, task=self.task, cfg=cfg, device=machine.device, optimizer=optimizer,
                               scaler=build_scaler(cfg, device=machine.device))
        train_set, _ = self.task.build_datasets()
        self.batches = _forever(build_train_loader(train_set, cfg=cfg, machine=machine))
        self.samples = cfg.train.batch_size * cfg.train.grad_accum
        self.done = 0

    def step(self) -> tuple[float, float | None]:
        sync = torch.cuda.synchronize if self.ctx.device.type == "cuda" else (lambda: None)
        sync()  # the clock reads the device's work, not its launches
        started = time.perf_counter()
        train_step(self.ctx, self.batches, step=self.done)
        sync()
        elapsed = time.perf_counter() - started
        self.done += 1
        used = self.task.step_record().get("flow_steps")
        return self.samples / elapsed, statistics.mean(used) if used else None


def measure(phases: list[Phase], *, rounds: int, warmup: int) -> list[dict[str, tuple[float, float | None]]]:
    """The warm-up steps of every phase, then ``rounds`` rounds of one step each, interleaved."""
    for phase in phases:
        for _ in range(warmup):
            phase.step()
    out = []
    for r in range(rounds):
        shift = r % len(phases)
        out.append({p.name: p.step() for p in phases[shift:] + phases[:shift]})
        print(f"round {r + 1}/{rounds}: " + ", ".join(f"{p.name} {out[-1][p.name][0]:.1f}" for p in phases)
              + " samples/s", file=sys.stderr, flush=True)
    return out


def interval(ratios: list[float]) -> tuple[float, float, float, float, float]:
    """(median, 95% bootstrap interval of the median, min, max)."""
    values = np.asarray(ratios)
    rng = np.random.default_rng(SEED)
    medians = np.median(rng.choice(values, size=(RESAMPLES, len(values)), replace=True), axis=1)
    low, high = np.percentile(medians, [2.5, 97.5])
    return float(np.median(values)), float(low), float(high), float(values.min()), float(values.max())


def _factor_cell(rounds: list[dict], a: str, b: str) -> str:
    med, low, high, least, most = interval([r[a][0] / r[b][0] for r in rounds])
    return f"{med:.2f}x [{low:.2f}-{high:.2f}] ({least:.2f}-{most:.2f})"


def table(names: list[str], rounds: list[dict]) -> str:
    lines = ["| phase | plan 003 claims (over the phase before) | measured factor: median [95% interval] (min-max) | "
             "samples/s (median) | flow steps (mean) |", "| --- | --- | ---: | ---: | ---: |"]
    baseline = names[0] == PHASES[0]
    first = "the plan before: 0.5 samples/s" if baseline else "(the first phase measured: the factors below are over it)"
    for i, name in enumerate(names):
        claim = claim_between(names[i - 1], name) if i else None
        rate = statistics.median(r[name][0] for r in rounds)
        steps = [r[name][1] for r in rounds if r[name][1] is not None]
        lines.append(f"| {name} | {claim.text if claim else first} | "
                     f"{_factor_cell(rounds, name, names[i - 1]) if i else '1.00x'} | {rate:.2f} | "
                     f"{statistics.mean(steps) if steps else float('nan'):.1f} |")
    # the plan's 40x is over its baseline; phases from a later one compare with the claims between them
    total = ENERGY_TOTAL if baseline else claim_between(names[0], names[-1])
    lines.append(f"| {names[-1]} vs {names[0]} | {total.text if total else '-'} | "
                 f"{_factor_cell(rounds, names[-1], names[0])} | | |")
    return "\n".join(lines)


def machine_line(device: torch.device) -> str:
    load = os.getloadavg()
    gpu = f"{torch.cuda.get_device_name(device)}, " if device.type == "cuda" else ""
    return (f"machine: {gpu}{os.cpu_count()} CPUs, {torch.get_num_threads()} torch threads, torch {torch.__version__}; "
            f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} (1, 5, 15 min) at the start")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=30, help="interleaved rounds, one step of every phase each")
    parser.add_argument("--warmup", type=int, default=2, help="steps of every phase before the rounds (excluded)")
    parser.add_argument("--phases", default=",".join(PHASES))
    parser.add_argument("overrides", nargs="*", help="more overrides for every phase (e.g. model=energy_tiny)")
    args = parser.parse_args(argv)
    if args.rounds < 2:
        parser.error("--rounds must be at least 2 (an interval needs rounds)")
    started = time.perf_counter()
    phases = [Phase(name, args.overrides) for name in args.phases.split(",")]
    print(machine_line(phases[0].ctx.device), flush=True)
    rounds = measure(phases, rounds=args.rounds, warmup=args.warmup)
    print(table([p.name for p in phases], rounds))
    print(f"\n{args.rounds} interleaved rounds x {len(phases)} phases after {args.warmup} warm-up steps each, "
          f"{time.perf_counter() - started:.0f} s in all; {' '.join([*BASE, *args.overrides])}; load average at the "
          f"end {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
