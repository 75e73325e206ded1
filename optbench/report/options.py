"""The command-line options ``optbench report``, ``compare`` and ``validate`` share: a parser whose
usage mistake is one line (exit 2), the gates (``--min-speedup``, ``--max-loss-delta``,
``--max-memory-ratio``), ``--format``, ``--no-plots`` and ``--repeats``. Light on purpose: a
command's ``--help`` imports this, not the analysis."""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass

from optbench.errors import ReportError

FORMATS = ("table", "markdown", "csv", "json")  # what report and compare print


@dataclass
class Gates:
    min_speedup: float | None = None
    max_loss_delta: float | None = None
    max_memory_ratio: float | None = None

    def any(self) -> bool:
        return any(v is not None for v in (self.min_speedup, self.max_loss_delta, self.max_memory_ratio))

    def items(self) -> list[tuple[str, float]]:
        items = [("min-speedup", self.min_speedup), ("max-loss-delta", self.max_loss_delta),
                 ("max-memory-ratio", self.max_memory_ratio)]
        return [(name, value) for name, value in items if value is not None]


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


def repeats(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"'{text}' must be at least 1")
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
