"""Does the planner's top pick win? ``optbench plan`` on this CPU (``estimate.gpu=none``: the per-op
benchmark), then its best five configurations run side by side, interleaved: each ``--rounds``
pass runs every one of them once (``optbench train`` in its own process, bracketed by
bench_overhead's machine probes). The goal: the top pick's measured tokens/s is at least every
other's (and it fits: it completes). A round during which the machine moved more than the gap
being judged is no evidence: NO VERDICT (exit 3) then; else PASS (0) or FAIL (1).

    python bench/bench_plan.py [--model tiny] [--global-batch 32] [--rounds 2] [--steps 10]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

from bench_predict import Row, _overhead_module, run_row  # noqa: E402


def plan(args: argparse.Namespace) -> list[dict]:
    command = [sys.executable, "-m", "optbench", "plan", f"model={args.model}", f"train.seq_len={args.seq_len}",
               "estimate.gpu=none", f"estimate.global_batch={args.global_batch}", "estimate.format=json",
               "estimate.top=5", *args.overrides]
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
    if done.returncode:
        raise SystemExit(f"{' '.join(command)} failed ({done.returncode}): {done.stderr[-2000:]}")
    return json.loads(done.stdout)["candidates"][:5]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--global-batch", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("overrides", nargs="*", help="more overrides for the plan and the runs")
    args = parser.parse_args()
    overhead = _overhead_module()
    ranked = plan(args)
    print(f"bench-plan: {args.model}, global batch {args.global_batch} x {args.seq_len}, top {len(ranked)} by the "
          f"plan; load {' / '.join(f'{x:.1f}' for x in os.getloadavg())}")
    rows = [Row(f"#{i + 1}", args.model, [*c["overrides"], f"train.seq_len={args.seq_len}", *args.overrides])
            for i, c in enumerate(ranked)]
    with tempfile.TemporaryDirectory():
        for index in range(args.rounds):
            for row in rows if index % 2 == 0 else rows[::-1]:
                row.runs.append(run_row(row, steps=args.steps, overhead=overhead))
                run = row.runs[-1]
                print(f"  round {index} {row.name} measured {run.measured:.4f} s predicted {run.predicted:.4f} s "
                      f"drift {'others' if math.isinf(run.drift) else f'{run.drift:.1%}'}", flush=True)
    print("\n| rank | overrides | predicted tokens/s | measured step s (median of rounds) | measured vs #1 |")
    print("| --- | --- | ---: | ---: | ---: |")
    best = rows[0].median("measured")
    for row, c in zip(rows, ranked, strict=True):
        print(f"| {row.name} | {' '.join(c['overrides'])} | {c['tokens_per_s']:,.0f} | {row.median('measured'):.4f} | "
              f"{best / row.median('measured'):.3f}x |")
    slower = [r for r in rows[1:] if r.median("measured") < best]
    drift = max(r.drift for r in rows)
    gap = min((abs(best / r.median("measured") - 1) for r in rows[1:]), default=0.0)
    if drift > gap:
        print(f"NO VERDICT: the machine moved {drift:.0%} (or others used the CPUs) during the rounds, more than the "
              f"{gap:.1%} between #1 and the closest")
        raise SystemExit(3)
    print("PASS: #1 is the fastest measured" if not slower else
          f"FAIL: {', '.join(r.name for r in slower)} ran faster than #1 (median step "
          f"{statistics.median(r.median('measured') for r in slower):.4f} s vs {best:.4f} s)")
    raise SystemExit(0 if not slower else 1)


if __name__ == "__main__":
    main()
