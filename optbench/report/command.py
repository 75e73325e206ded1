"""``optbench report PATH...`` (review run outputs: noise-aware speedups, loss delta, memory, gates,
plots) and ``optbench compare A -- B`` (run both alternately, then report): their options and what
they print. The analysis is ``optbench.report.analysis``, the formats ``optbench.report.format``,
the A/B runner ``optbench.report.compare``, the options they share with validate
``optbench.report.options``; ``--help`` imports none of the analysis (nor torch).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from optbench.errors import ReportError
from optbench.exits import INTERRUPTED, OK, review_exit
from optbench.report.options import OneLineParser, add_gate_options, gates_from, repeats

if TYPE_CHECKING:
    from optbench.report.analysis import Report

FLAGS = ("--no-plots",)  # compare's options without a value


def build_parser() -> argparse.ArgumentParser:
    from optbench.usage import HelpFormatter, epilog

    parser = OneLineParser(
        prog="optbench report", formatter_class=HelpFormatter, epilog=epilog("report"),
        description="Review run outputs: every run below PATH against its baseline, with speedup and a "
                    "bootstrap confidence interval, loss delta, memory ratio, the phase table of a phase "
                    "sweep, and gates. Writes report.md, report.csv, report.json and PNG plots. Exit status: "
                    "0, 1 when a gate fails, 2 bad input.",
    )
    parser.add_argument("paths", nargs="+", metavar="PATH", help="run dir, sweep dir or outputs/")
    parser.add_argument("--baseline", action="append", metavar="KEY=VALUE",
                        help="the baseline run (an override; repeat to narrow). "
                             "Default: phase=0_baseline if present, else the first run")
    parser.add_argument("--candidate", action="append", metavar="KEY=VALUE",
                        help="what the gates judge (default: the last phase of a phase sweep, else every "
                             "run besides the baseline)")
    parser.add_argument("--out", metavar="DIR", help="where report.md/.csv/.json and plots go "
                                                     "(default: the reviewed dir)")
    add_gate_options(parser)
    return parser


def emit(report: Report, *, fmt: str, out_dir: Path, plots: bool) -> int:
    """Print the report, write its files, name each failing gate on stderr; the exit status."""
    from optbench.report.format import render, write_outputs

    written = write_outputs(report, out_dir, plots=plots)
    sys.stdout.write(render(report, fmt))
    sys.stdout.flush()
    print(f"optbench: report written to {out_dir} ({', '.join(p.name for p in written)})", file=sys.stderr)
    for result in report.gate_results:
        if not result.ok:
            print(f"optbench: gate failed: {result.message}", file=sys.stderr)
    return report.exit_code


def main(argv: list[str]) -> None:
    args = build_parser().parse_args(argv)
    from optbench.report.analysis import build_report

    report = build_report(args.paths, baseline=args.baseline, candidate=args.candidate, gates=gates_from(args))
    out_dir = Path(args.out) if args.out else report.root
    raise SystemExit(emit(report, fmt=args.format, out_dir=out_dir, plots=not args.no_plots))


def compare_parser() -> argparse.ArgumentParser:
    from optbench.usage import HelpFormatter, epilog

    parser = OneLineParser(prog="optbench compare", usage="optbench compare [A_OVERRIDES] -- [B_OVERRIDES] [options]",
                           formatter_class=HelpFormatter, epilog=epilog("compare"),
                           description="Run A and B alternately (A B, B A, ...) with the same seed and "
                                       "data, each as its own optbench train process, then report B vs A "
                                       "(optbench report's tables, plots and gates). Exit status: 0, 1 when a gate "
                                       "fails or a run did not complete, 2 bad input.")
    parser.add_argument("--repeats", type=repeats, default=3, metavar="N",
                        help="runs of each side (default 3), alternating A and B")
    parser.add_argument("--out", metavar="DIR",
                        help="where the runs and the report go (default outputs/compare/<date>/<time>)")
    add_gate_options(parser)
    return parser


def split_argv(argv: list[str], parser: argparse.ArgumentParser) -> tuple[argparse.Namespace, list[str], list[str]]:
    """``A... -- B...`` with options anywhere: tokens starting with ``--`` are options (with their
    value); a bare ``--`` separates A's overrides from B's."""
    if "-h" in argv or "--help" in argv:
        parser.print_help()
        raise SystemExit(OK)
    if "--" not in argv:
        raise ReportError("optbench compare: separate A's overrides from B's with ' -- ' "
                          "(e.g. optbench compare compile=none -- compile=default)")
    options, sides, side = [], ([], []), 0
    tokens = iter(argv)
    for token in tokens:
        if token == "--" and side == 0:
            side = 1
        elif token.startswith("--"):
            options.append(token)
            if "=" not in token and token not in FLAGS:
                options.append(next(tokens, ""))
        else:
            sides[side].append(token)
    return parser.parse_args(options), sides[0], sides[1]


def compare_main(argv: list[str]) -> None:
    """``optbench compare``: the runs, then the report of B against A; exit 1 when a gate fails or a
    run did not complete."""
    args, a_overrides, b_overrides = split_argv(argv, compare_parser())
    from optbench.report.analysis import build_report
    from optbench.report.compare import compare, default_out

    out = Path(args.out) if args.out else default_out()
    try:
        codes = compare(a_overrides, b_overrides, repeats=args.repeats, out=out)
    except KeyboardInterrupt:
        print(f"optbench: compare interrupted; the runs so far are in {out}", file=sys.stderr)
        raise SystemExit(INTERRUPTED) from None
    report = build_report([out], gates=gates_from(args))
    code = emit(report, fmt=args.format, out_dir=out, plots=not args.no_plots)
    raise SystemExit(review_exit(gates_ok=code == OK, runs=codes))
