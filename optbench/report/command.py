"""``optbench report PATH...``: review run outputs — noise-aware speedups, loss delta, memory,
gates, plots — and the Hydra callback that writes that report at the end of every sweep.

The analysis lives in ``optbench.report.analysis``, the output formats in ``optbench.report.format``, the
plots in ``optbench.report.plots``.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback

from optbench.errors import ReportError
from optbench.report.analysis import Gates, Report, build_report
from optbench.report.format import FORMATS, render, write_outputs


# ---------------------------------------------------------------------------------------- CLI
class OneLineParser(argparse.ArgumentParser):
    """argparse, but a usage mistake is one line and exit 2 (via ReportError)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise ReportError(f"{self.prog}: {message}")


def threshold(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not a number") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"'{text}' must be a finite number >= 0")
    return value


def add_gate_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--min-speedup", type=threshold, metavar="X",
                        help="fail (exit 1) unless each candidate's speedup vs the baseline is >= X")
    parser.add_argument("--max-loss-delta", type=threshold, metavar="D",
                        help="fail unless |candidate loss - baseline loss| <= D")
    parser.add_argument("--max-memory-ratio", type=threshold, metavar="R",
                        help="fail unless candidate peak memory / baseline peak memory <= R")
    parser.add_argument("--format", choices=FORMATS, default="table", help="what to print (default: table)")
    parser.add_argument("--no-plots", action="store_true", help="skip the PNG plots")


def gates_from(args: argparse.Namespace) -> Gates:
    return Gates(args.min_speedup, args.max_loss_delta, args.max_memory_ratio)


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
    report = build_report(args.paths, baseline=args.baseline, candidate=args.candidate, gates=gates_from(args))
    out_dir = Path(args.out) if args.out else report.root
    raise SystemExit(emit(report, fmt=args.format, out_dir=out_dir, plots=not args.no_plots))


# ------------------------------------------------------------------------------ sweep callback
def _track_report(config: Any, sweep_dir: Path) -> None:
    """The report to the sweep's trackers (``log.trackers``: MLflow's parent run, W&B's group)."""
    from omegaconf import OmegaConf

    from optbench.tracking import log_sweep_report

    log_cfg = OmegaConf.to_object(config.log)
    if not set(log_cfg.trackers) - {"tensorboard"}:
        return
    try:
        log_sweep_report(log_cfg, sweep_dir, [sweep_dir / f"report.{ext}" for ext in ("md", "csv", "json")])
    except Exception as exc:  # the report is on disk; the trackers missed it
        print(f"optbench: sweep report not sent to {', '.join(log_cfg.trackers)} ({type(exc).__name__}: {exc})",
              file=sys.stderr, flush=True)


class SweepReport(Callback):
    """Hydra callback (conf/train.yaml, ``hydra.callbacks.report``): at the end of every multirun
    sweep, write the report into the sweep dir and print its table.

    A report that cannot be made must never fail the sweep whose runs are already on disk: the
    reason is printed as one line with the command to retry, and the sweep's exit status stands.
    """

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self.sweep_dir: Path | None = None

    def on_multirun_start(self, config: Any, **kwargs: Any) -> None:
        self.sweep_dir = Path(str(config.hydra.sweep.dir))

    def on_multirun_end(self, config: Any, **kwargs: Any) -> None:
        if not self.enabled:
            return
        sweep_dir = self.sweep_dir or Path(str(config.hydra.sweep.dir))
        try:
            report = build_report([sweep_dir])
            write_outputs(report, sweep_dir)
            sys.stdout.write(render(report, "table"))
            print(f"optbench: sweep report written to {sweep_dir / 'report.md'}", flush=True)
            _track_report(config, sweep_dir)
        except Exception as exc:  # the sweep's runs stand; the report can be made again by hand
            print(f"optbench: sweep report not written ({type(exc).__name__}: {exc}); "
                  f"run `optbench report {sweep_dir}`", file=sys.stderr, flush=True)
