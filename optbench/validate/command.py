"""``optbench validate``: the plan's phase 9 as one command — the baseline snapshot against the fully
optimized configuration that runs on this machine, with the plan's gates.

What it does, and which module does it:

* compose both sides (and every phase, to know which ones this machine can run) and check them with
  ``optbench.training.preflight``'s rules before anything trains; the default candidate is the furthest phase in
  the plan's order that runs here, and every phase that cannot is named with the rule's reason;
* run baseline and candidate (``--all-phases``: also the runnable phases in between) interleaved in
  counterbalanced order, each as its own ``optbench train`` process (``optbench.report.compare``'s runner),
  into one output directory;
* review them with ``optbench.report.analysis`` (pooled repeats, block-bootstrap confidence intervals, loss
  delta, memory ratio, the cumulative phase table) and judge the plan's gates with review's gate
  logic: speedup >= 3.0 with the whole 95% interval, loss delta <= 0.001, memory ratio <= 50/15;
* add what the plan reports and review does not: epoch time per side (samples per epoch from the
  dataset), the projected epoch time on the plan's 2 and 4 GPUs from ``optbench estimate``'s
  throughput model (labelled a projection), and each phase beside the plan's claimed speedup;
* write ``validate.md``/``.csv``/``.json`` and ``validate_phases.png`` next to review's
  ``report.*`` and plots.

Exit status: 0 VALIDATED (every gate holds), 1 NOT VALIDATED (a gate fails or a run did not
complete), 2 bad input (one line, before anything runs), 3 NOT JUDGED HERE: the plan's last phase
cannot run on this machine (a CPU blocks phases 5-8), so the furthest phase that runs is measured
against the plan's gates and reported, but the plan is not judged (``make validate`` treats 3 as done).

The work is ``optbench.validate.api`` (and ``setup``); this module parses the options and prints.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from optbench.exits import INTERRUPTED, VERDICTS
from optbench.report.options import Gates, OneLineParser, add_gate_options, repeats
from optbench.validate.claims import PLAN_GATES


# ------------------------------------------------------------------------------ the command line
def build_parser() -> argparse.ArgumentParser:
    from optbench.config.estimate import ESTIMATE_GPUS
    from optbench.usage import HelpFormatter, epilog

    parser = OneLineParser(
        prog="optbench validate", formatter_class=HelpFormatter,
        usage="optbench validate [OVERRIDES] [candidate=PHASE|candidate=KEY=VALUE ...] [baseline=...] [options]",
        description="The plan's phase 9: the baseline (phase=0_baseline) against the furthest phase that runs "
                    "here (or candidate=...), interleaved with repeats, judged by the plan's gates. OVERRIDES "
                    "apply to both sides.",
    )
    parser.add_argument("overrides", nargs="*", metavar="OVERRIDE",
                        help="train overrides for both sides; candidate=... and baseline=... for one side")
    parser.add_argument("--repeats", type=repeats, default=3, metavar="N", help="runs of each side (default 3)")
    parser.add_argument("--out", metavar="DIR",
                        help="where the runs and the report go (default outputs/validate/<date>/<time>)")
    parser.add_argument("--all-phases", action="store_true",
                        help="also run every runnable phase between the baseline and the candidate (the full "
                             "cumulative table; costs a run per phase per repeat)")
    parser.add_argument("--project-gpu", choices=sorted(g for g in ESTIMATE_GPUS if g != "none"), default="h100",
                        help="the GPU of the 2- and 4-GPU projection (default h100)")
    parser.add_argument("--project-mfu", type=_fraction, metavar="F",
                        help="MFU the projection assumes (default: the MFU measured on a known GPU, else "
                             "estimate.mfu's 0.4)")
    add_gate_options(parser)
    parser.epilog = (f"gates default to the plan's: --min-speedup {PLAN_GATES.min_speedup:g} --max-loss-delta "
                     f"{PLAN_GATES.max_loss_delta:g} --max-memory-ratio {PLAN_GATES.max_memory_ratio:g}\n"
                     "exit status:\n  0 VALIDATED\n  1 NOT VALIDATED (a gate failed, a run did not complete)\n  2 bad input\n"
                     "  3 NOT JUDGED HERE (the plan's last phase cannot run here: measured, not judged)\n\n"
                     + epilog("validate"))
    return parser


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not a number") from None
    if not (math.isfinite(value) and 0 < value <= 1):
        raise argparse.ArgumentTypeError(f"'{text}' must be in (0, 1]")
    return value


def gates_from(args: argparse.Namespace) -> Gates:
    """The plan's gates, each replaced by its option when given."""
    return Gates(
        PLAN_GATES.min_speedup if args.min_speedup is None else args.min_speedup,
        PLAN_GATES.max_loss_delta if args.max_loss_delta is None else args.max_loss_delta,
        PLAN_GATES.max_memory_ratio if args.max_memory_ratio is None else args.max_memory_ratio,
    )


def main(argv: list[str]) -> None:
    args = build_parser().parse_intermixed_args(argv)
    from optbench.report.analysis import build_report
    from optbench.report.compare import prepare_out
    from optbench.report.format import write_outputs
    from optbench.report.tables import terminal_width
    from optbench.validate.api import assemble, default_out, gist, run_sides
    from optbench.validate.format import (
        VALIDATE_FILES,
        render_csv,
        render_markdown,
        render_text,
        write_validation,
    )
    from optbench.validate.setup import prepare

    gates = gates_from(args)
    setup = prepare(args.overrides, all_phases=args.all_phases)
    candidate = setup.candidate
    blocked = [s for s in setup.states if not s.runnable]
    print(f"optbench validate: baseline {' '.join(setup.baseline.overrides)}", flush=True)
    print(f"                   candidate {' '.join(candidate.overrides)}", flush=True)
    for state in blocked:  # the whole reasons are in validate.md
        print(f"  skipped {state.name}: {'; '.join(gist(r) for r in state.reasons)}", flush=True)
    for note in setup.notes:
        print(f"  note: {note}", flush=True)
    out = Path(args.out) if args.out else default_out()
    prepare_out(out, writes=VALIDATE_FILES)
    try:
        codes = run_sides(setup, out, args.repeats)
    except KeyboardInterrupt:
        print(f"optbench: validate interrupted; the runs so far are in {out}", file=sys.stderr)
        raise SystemExit(INTERRUPTED) from None
    selector = [f"phase={candidate.phase}"] if candidate.phase and candidate.phase != setup.baseline.phase else None
    report = build_report([out], candidate=selector, gates=gates)
    written = write_outputs(report, out, plots=not args.no_plots)
    command = " ".join(["optbench validate", *argv])
    result = assemble(report, setup, args=args, codes=codes, command=command)
    written += write_validation(result, out, plots=not args.no_plots)
    text = {"json": json.dumps(result, indent=2, default=str) + "\n", "csv": render_csv(result),
            "markdown": render_markdown(result) + "\n"}.get(args.format) or render_text(result, width=terminal_width())
    sys.stdout.write(text)
    sys.stdout.flush()
    print(f"optbench: validation written to {out} ({', '.join(p.name for p in written)})", file=sys.stderr)
    for why in result["why_not"]:
        print(f"optbench: {why}", file=sys.stderr)
    code = VERDICTS[result["verdict"]]
    print(f"optbench: {result['verdict']}: {candidate.overrides[0]} vs {setup.baseline.overrides[0]} (exit {code})",
          file=sys.stderr)
    raise SystemExit(code)
