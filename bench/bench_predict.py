"""make bench-predict: how close is the predicted step time to the measured one, on this CPU?

Every row is one ``optbench train`` run in its own process, as a user runs it: before its loop the
run traces its own step, benchmarks the step's ops here (``optbench.estimate.predict``) and records
``predicted.step_time_s`` in summary.json beside the measured median step (``throughput``). The
rows are the plan's phase-sweep configurations that run on a CPU, at tiny and small: fp32 (phase 0),
bf16, compile (phase 1), full and selective activation checkpointing (phase 2), loss_freq (phase 3),
the tuned data loader (phase 4), DDP over 2 gloo workers. The error is predicted / measured - 1 per
row; the goal is every row within +-10%.

The machine is shared, and the host under it slows the VM by up to 2x for seconds at a time
(docs/estimate-speed.md): a single run's error is mostly that noise. The rows run interleaved
(``--rounds`` passes over all rows, the order reversed every other pass), and the verdict is about
each row's median error, by one-sided sign tests over its rounds: PASS when, for every row, too
many rounds came out above -10% and too many below +10% for chance (p <= 0.05 each; with five
rounds: all five within the goal); FAIL when a row's rounds came out beyond one side of the goal
that often; else NO VERDICT (exit 3). A run during which other processes used more than 5% of the
CPUs (bench_overhead's accounting) is left out. Each run's drift (its bracketing machine probes,
its own loop's probes, its steps' median over their fastest) is printed beside it.

    python bench/bench_predict.py [--models tiny,small] [--rounds 5] [--rows fp32,bf16,...]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GOAL = 0.10
ROWS = {
    "fp32": ["phase=0_baseline"],
    "bf16": ["phase=0_baseline", "precision=bf16"],
    "compile": ["phase=1_compile"],
    "ac_full": ["phase=2_ac"],
    "ac_selective": ["phase=2_ac", "ac=selective"],
    "loss_freq": ["phase=3_loss_freq"],
    "dataloader": ["phase=4_dataloader"],
    "ddp": ["phase=0_baseline", "parallel=ddp", "parallel.nproc_per_node=2"],
}
STEPS = {"tiny": 14, "small": 8}  # 11 and 5 timed steps after 3 of warm-up


def _overhead_module():
    """bench_overhead's machine probe and CPU-share accounting (one drift guard for every bench)."""
    spec = importlib.util.spec_from_file_location("bench_overhead", ROOT / "bench" / "bench_overhead.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@dataclass
class Run:
    predicted: float
    measured: float
    steps: list[float]
    probes: tuple[float, float]
    moved: float
    others: float
    breakdown: dict = field(default_factory=dict)  # the prediction's seconds per part (summary.json)
    faults: float | None = None  # the run's page faults a timed step (throughput.page_faults_per_step)

    @property
    def drift(self) -> float:
        """How far the machine moved during the run: its probes, its own loop's probes, its steps'
        median over their fastest; unbounded when others used the CPUs meanwhile."""
        if busy(self):
            return math.inf
        spread = statistics.median(self.steps) / min(self.steps) - 1 if self.steps else 0.0
        return max(max(self.probes) / min(self.probes) - 1, abs(self.moved or 0.0), spread)


@dataclass
class Row:
    name: str
    model: str
    overrides: list[str]
    runs: list[Run] = field(default_factory=list)

    def median(self, attr: str) -> float:
        return statistics.median(getattr(run, attr) for run in self.runs)

    @property
    def errors(self) -> list[float]:
        """Each round's error (a prediction against its own run), rounds with others on the CPUs left out."""
        return [run.predicted / run.measured - 1 for run in self.runs if not busy(run)]

    @property
    def error(self) -> float:
        """The median of the rounds' errors, what the verdict tests; not the median prediction over
        the median measurement, which pairs different rounds."""
        errors = self.errors
        return statistics.median(errors) if errors else math.nan

    @property
    def drift(self) -> float:
        return max(run.drift for run in self.runs)


def run_row(row: Row, *, steps: int, overhead) -> Run:
    """One ``optbench train`` of the row, in its own process, bracketed by machine probes."""
    with tempfile.TemporaryDirectory(prefix="bench-predict-") as run_dir:
        command = [sys.executable, "-m", "optbench", "train", f"model={row.model}", *row.overrides,
                   f"train.steps={steps}", "measure.warmup_steps=3", "train.eval_batches=0", "log.progress=log",
                   f"hydra.run.dir={run_dir}"]
        before = overhead.run_probe()["flops"]

        def train() -> dict:
            done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
            if done.returncode:
                raise SystemExit(f"{' '.join(command)} failed ({done.returncode}): {done.stderr[-2000:]}")
            return json.loads((Path(run_dir) / "summary.json").read_text())

        summary = overhead.run_side(train)
        after = overhead.run_probe()["flops"]
    predicted = summary["predicted"]
    if not predicted or "error" in predicted:
        raise SystemExit(f"{row.model} {row.name}: no prediction recorded: {predicted}")
    throughput = summary["throughput"]
    return Run(predicted=predicted["step_time_s"], measured=throughput["step_time_s"]["median"],
               steps=throughput["step_times_s"], probes=(before, after),
               moved=summary["machine_speed"].get("moved") or 0.0, others=summary["others"],
               breakdown=predicted.get("breakdown_s") or {}, faults=throughput.get("page_faults_per_step"))


ALPHA = 0.05


def sign_p(wins: int, trials: int) -> float:
    """The chance of at least ``wins`` wins in ``trials`` tosses of a fair coin (one-sided)."""
    return sum(math.comb(trials, k) for k in range(wins, trials + 1)) / 2 ** trials


def busy(run: Run) -> bool:
    """Other processes used more than 5% of the CPUs during the run (or it could not tell)."""
    return math.isnan(run.others) or run.others > 0.05


def verdict(rows: list[Row]) -> tuple[str, int]:
    """Each row's rounds against the goal on both sides (see the module's docstring)."""
    lines, inside, outside = [], [], []
    for row in rows:
        errors = row.errors
        above, below, n = sum(e > -GOAL for e in errors), sum(e < GOAL for e in errors), len(errors)
        name = f"{row.model} {row.name}"
        within = sum(-GOAL < e < GOAL for e in errors)
        lines.append(f"  {name}: {within} of {n} rounds within +-{GOAL:.0%} "
                     f"(errors {', '.join(f'{e:+.1%}' for e in sorted(errors))})")
        if max(sign_p(above, n), sign_p(below, n)) <= ALPHA:
            inside.append(name)
        elif min(sign_p(n - above, n), sign_p(n - below, n)) <= ALPHA:
            outside.append(name)
    if outside:
        return "\n".join([*lines, f"FAIL: {', '.join(outside)}: too many rounds beyond one side of the "
                                    f"+-{GOAL:.0%} goal for chance (p <= {ALPHA})"]), 1
    if len(inside) == len(rows):
        return "\n".join([*lines, f"PASS: every row's rounds within +-{GOAL:.0%} too often for chance "
                                    f"(p <= {ALPHA} on each side)"]), 0
    undecided = [f"{r.model} {r.name}" for r in rows if f"{r.model} {r.name}" not in inside]
    return "\n".join([*lines, f"NO VERDICT: {', '.join(undecided)} could be within the goal or not (p > {ALPHA}; "
                                "five rounds are the fewest that can decide)"]), 3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="tiny,small")
    parser.add_argument("--rows", default=",".join(ROWS))
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    overhead = _overhead_module()
    rows = [Row(name, model, ROWS[name]) for model in args.models.split(",") for name in args.rows.split(",")]
    print(f"bench-predict: {len(rows)} rows x {args.rounds} rounds, interleaved; load average "
          f"{' / '.join(f'{x:.1f}' for x in os.getloadavg())} (1/5/15 min) on {os.cpu_count()} CPUs")
    for index in range(args.rounds):
        order = rows if index % 2 == 0 else rows[::-1]
        for row in order:
            run = run_row(row, steps=STEPS.get(row.model, 8), overhead=overhead)
            row.runs.append(run)
            print(f"  round {index} {row.model:<6} {row.name:<13} predicted {run.predicted:8.4f} s  measured "
                  f"{run.measured:8.4f} s  error {run.predicted / run.measured - 1:+6.1%}  drift "
                  f"{'others' if math.isinf(run.drift) else f'{run.drift:.1%}'}  load {os.getloadavg()[0]:.1f}"
                  f"  page faults/step {'?' if run.faults is None else f'{run.faults:,.0f}'}",
                  flush=True)
            if abs(run.predicted / run.measured - 1) > GOAL:  # what the prediction is made of, to find the part
                print("      predicted " + ", ".join(f"{k} {v:.4f} s" for k, v in run.breakdown.items()), flush=True)
    print(f"\n| model | config | predicted s (median of {args.rounds}) | measured s (median of {args.rounds}) | "
          "error (median of the rounds') | machine drift |")
    print("| --- | --- | ---: | ---: | ---: | ---: |")
    for row in rows:
        drift = "others on the CPUs" if math.isinf(row.drift) else f"{row.drift:.1%}"
        print(f"| {row.model} | {row.name} | {row.median('predicted'):.4f} | {row.median('measured'):.4f} | "
              f"{row.error:+.1%} | {drift} |")
    line, code = verdict(rows)
    print(line)
    raise SystemExit(code)


if __name__ == "__main__":
    main()
