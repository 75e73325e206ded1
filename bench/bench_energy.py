"""make bench-energy: plan 003's claims beside what its phases measure on this machine.

Each round trains every phase of ``conf/energy_phase/`` once (``optbench train energy_phase=P
model=energy_cpu data=energy_synthetic ...``, in this process, ``optbench.run.train.train``), in an
order that rotates from round to round (interleaved: no phase always first, so a machine that gets
busier half-way does not favour one). A run's throughput is its summary's samples/s at the median
timed step (one sample is one "token" of task=energy_flow). A phase's factor over the phase before is
taken round by round (both measured within the same round) and the table gives the median over the
rounds and their min-max spread, beside the plan's claim; the last row is the furthest phase against
the baseline beside the plan's 40x. The cosine delta is the change of the eval cosine similarity (the
quality the factor cost or bought), the flow steps the mean steps a forward used.

    python bench/bench_energy.py [--rounds 2] [--steps 4] [--phases 0_baseline,1_bridge,...] [OVERRIDE ...]

Prints a markdown table (what bench/RESULTS.md holds). Exit 0 when every phase completed in every
round, 1 otherwise. The machine is shared and noisy: the spread says how much.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from optbench.config import compose  # noqa: E402
from optbench.report.energy import ENERGY_CLAIMS, ENERGY_TOTAL, claim_between  # noqa: E402
from optbench.run.train import train  # noqa: E402

PHASES = ["0_baseline", *ENERGY_CLAIMS]
BASE = ["model=energy_cpu", "data=energy_synthetic", "data.num_samples=2048", "train.device=cpu",
        "train.eval_batches=1", "log.progress=log", "log.level=warning", "estimate.predict=false"]


def run_phase(phase: str, *, steps: int, extra: list[str], root: Path, tag: str) -> dict:
    overrides = [f"energy_phase={phase}", *BASE, f"train.steps={steps}", "measure.warmup_steps=1", *extra]
    result = train(compose(overrides), run_dir=root / f"{tag}_{phase}", overrides=overrides)
    summary = result.summary
    return {"status": result.status, "error": result.error,
            "samples_per_s": summary["throughput"]["tokens_per_s"],
            "cosine": (summary["loss"]["eval_metrics"] or {}).get("cosine"),
            "flow_steps": ((summary["applied"].get("task") or {}).get("flow_steps") or {}).get("mean"),
            "peak": summary["memory"]["peak_bytes"]}


def measure(phases: list[str], *, rounds: int, steps: int, extra: list[str]) -> list[list[dict]]:
    """``rounds`` x the phases, each round in a rotated order; returns [round][phase index]."""
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(rounds):
            order = phases[r % len(phases):] + phases[:r % len(phases)]
            measured = {}
            for phase in order:
                started = time.perf_counter()
                measured[phase] = run_phase(phase, steps=steps, extra=extra, root=Path(tmp), tag=f"r{r}")
                print(f"round {r + 1}/{rounds} {phase}: {measured[phase]['status']}, "
                      f"{measured[phase]['samples_per_s'] or 0:.2f} samples/s ({time.perf_counter() - started:.0f} s)",
                      file=sys.stderr, flush=True)
            out.append([measured[p] for p in phases])
    return out


def _factor(rounds: list[list[dict]], i: int, j: int) -> tuple[float, float, float] | None:
    ratios = [r[i]["samples_per_s"] / r[j]["samples_per_s"] for r in rounds
              if r[i]["status"] == r[j]["status"] == "completed"]
    return (statistics.median(ratios), min(ratios), max(ratios)) if ratios else None


def _mean(rounds: list[list[dict]], i: int, key: str) -> float | None:
    values = [r[i][key] for r in rounds if r[i][key] is not None]
    return statistics.mean(values) if values else None


def table(phases: list[str], rounds: list[list[dict]]) -> str:
    lines = ["| phase | plan 003 claims | measured factor, median [min-max over rounds] | samples/s (median) | "
             "cosine delta vs previous | flow steps (mean) |", "| --- | --- | ---: | ---: | ---: | ---: |"]

    def cell(factor: tuple[float, float, float] | None) -> str:
        return "-" if factor is None else f"{factor[0]:.2f}x [{factor[1]:.2f}-{factor[2]:.2f}]"

    def num(value: float | None, spec: str) -> str:
        return "-" if value is None else format(value, spec)

    for i, phase in enumerate(phases):
        claim = claim_between(phases[i - 1], phase) if i else None
        rate = statistics.median([r[i]["samples_per_s"] for r in rounds if r[i]["samples_per_s"]] or [0])
        cos, before = _mean(rounds, i, "cosine"), _mean(rounds, i - 1, "cosine") if i else None
        delta = cos - before if cos is not None and before is not None else None
        claimed = claim.text if claim else "the plan's before"
        factor = cell(_factor(rounds, i, i - 1)) if i else "1.00x"
        lines.append(f"| {phase} | {claimed} | {factor} | {rate:.2f} | {num(delta, '+.4f')} | "
                     f"{num(_mean(rounds, i, 'flow_steps'), '.1f')} |")
    lines.append(f"| {phases[-1]} vs {phases[0]} | {ENERGY_TOTAL.text} | {cell(_factor(rounds, len(phases) - 1, 0))} | "
                 "| | |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4, help="training steps per run (the first is warm-up)")
    parser.add_argument("--phases", default=",".join(PHASES))
    parser.add_argument("overrides", nargs="*", help="more overrides for every run (e.g. model=energy_tiny)")
    args = parser.parse_args(argv)
    phases = args.phases.split(",")
    started = time.perf_counter()
    rounds = measure(phases, rounds=args.rounds, steps=args.steps, extra=args.overrides)
    print(table(phases, rounds))
    print(f"\n{args.rounds} rounds x {len(phases)} phases, {args.steps} steps each (1 warm-up), "
          f"{time.perf_counter() - started:.0f} s; overrides: {' '.join(args.overrides) or '(none)'}")
    failed = [(phase, r[i]["error"]) for r in rounds for i, phase in enumerate(phases) if r[i]["status"] != "completed"]
    for phase, error in failed:
        print(f"{phase}: {error}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
