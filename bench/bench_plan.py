"""Does the planner's top pick win? ``optbench plan`` on this CPU (``estimate.gpu=none``: the per-op
benchmark), then its best five configurations run side by side, interleaved: each ``--rounds``
pass runs every one of them once, in the plan's order and then reversed (``optbench train`` in its
own process, bracketed by bench_overhead's machine probes). The goal: the top pick's measured step
is at most every other's (and it fits: it completes).

The verdict pairs runs of one round: the host's speed moves by up to 2x for seconds at a time
(invisible to the VM: no steal time), so no single run is evidence, but within a round two
configurations meet the same stretch of machine in turns. For each other configuration, a one-sided
sign test over the rounds: PASS when every one lost to #1 in enough rounds that a coin would do so
with chance <= 5% (each must be rejected at 5%; no correction is due when all of them must hold, the
intersection-union test); FAIL when one beat #1 that often; else NO VERDICT (exit 3). A round where
other processes used the CPUs during either run is left out of that pair. Five rounds are the fewest
that can reach 5% (a coin wins 5 of 5 with chance 1/32).

Two configurations whose steps are equal cannot be ordered by any number of rounds: each wins
about half of them. "At least as fast" is then shown the way a non-inferiority trial shows it, with
a margin stated in advance (``--margin``, 5%): a pair that #1 did not win outright is decided for
#1 when the other's step came out above ``1 - margin`` times #1's in too many rounds for chance
(the same sign test). Five percent is half the prediction's own goal (+-10%): a planner cannot be
asked to order steps closer than that, and a user would not choose between them. ``--margin 0``
asks for the strict test alone. The FAIL test stays strict: another configuration faster in too
many rounds fails the pick however small its lead.

    python bench/bench_plan.py [--model tiny] [--global-batch 16] [--rounds 5] [--steps 40] [--margin 0.05]
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
MARGIN = 0.05  # the non-inferiority margin: another's step above (1 - MARGIN) of #1's (docstring)
sys.path.insert(0, str(ROOT / "bench"))

from bench_predict import ALPHA, Row, _overhead_module, busy, run_row, sign_p  # noqa: E402


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
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=40)  # 37 timed, about 6 s: a slow stretch of the host is seconds long
    parser.add_argument("--margin", type=float, default=MARGIN, help="non-inferiority margin (0: strict)")
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
    line, code = verdict(rows, margin=args.margin)
    print(line)
    raise SystemExit(code)


def verdict(rows: list[Row], *, margin: float = MARGIN) -> tuple[str, int]:
    """#1 against each other row, round by round (see the module's docstring)."""
    first, lines, won, within, lost = rows[0], [], [], [], []
    for row in rows[1:]:
        pairs = [(a.measured, b.measured) for a, b in zip(first.runs, row.runs, strict=True)
                 if not (busy(a) or busy(b))]
        wins = sum(a < b for a, b in pairs)
        close = sum(b > (1 - margin) * a for a, b in pairs)
        p_win, p_loss = sign_p(wins, len(pairs)), sign_p(len(pairs) - wins, len(pairs))
        p_close = sign_p(close, len(pairs))
        lines.append(f"  #1 vs {row.name}: #1 faster in {wins} of {len(pairs)} rounds (a coin: p = {p_win:.3f})"
                     + (f", its step above {1 - margin:.0%} of #1's in {close} (p = {p_close:.3f})" if margin else "")
                     + f"; its step over #1's, median "
                     f"{statistics.median(b / a for a, b in pairs) if pairs else math.nan:.3f}")
        if p_loss <= ALPHA:
            lost.append(row.name)
        elif p_win <= ALPHA:
            won.append(row.name)
        elif margin and p_close <= ALPHA:
            within.append(row.name)
    if lost:
        return "\n".join([*lines, f"FAIL: {', '.join(lost)} ran faster than #1 in too many rounds for chance "
                                    f"(p <= {ALPHA})"]), 1
    if len(won) + len(within) == len(rows) - 1:
        how = "ran faster than each of the others" if not within else (
            (f"ran faster than {', '.join(won)}, and " if won else "") +
            f"was not slower than {', '.join(within)} by more than the margin (their steps above {1 - margin:.0%} "
            "of #1's)")
        return "\n".join([*lines, f"PASS: #1 {how} in too many rounds for chance (each p <= {ALPHA})"]), 0
    undecided = [r.name for r in rows[1:] if r.name not in won + within]
    return "\n".join([*lines, f"NO VERDICT: against {', '.join(undecided)} the rounds could be a coin's "
                                f"(p > {ALPHA}; five rounds are the fewest that can decide)"]), 3


if __name__ == "__main__":
    main()
