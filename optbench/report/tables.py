"""The report as a person reads it: console tables that fit the terminal (drawn by rich), and the
same tables in report.md.

A cell holds a few words; what does not fit in a few words (why a run did not complete, why a
speedup gets no verdict, the peak behind an MFU, why a loss delta is not like for like) is a
numbered note under the tables, said once however many rows refer to it. The console shortens a long
variant label (the full one is in report.md and report.json); each variant carries its tag (#3, the
sweep's job number; A/B in a compare), the same in every table and plot.
"""

from __future__ import annotations

import io
import re
import shlex
import shutil
import textwrap
from dataclasses import dataclass, field
from typing import Any

from optbench import outputs
from optbench.report.drift import machine_speeds
from optbench.report.groups import Comparison, Group, PhaseRow
from optbench.report.runs import Run, num
from optbench.report.variants import LOSS, Variant

WHEN = re.compile(r" \(\d{4}-\d\d-\d\dT[^)]*cached in [^)]*\)")  # "(2026-11-26T16:34:34+0000, cached in ...)"
CONSOLE_LABEL = 40  # characters of a variant label on the console (report.md has it whole)
WRAPPED = frozenset({"variant", "verdict", "verdict vs previous", "run", "reason"})  # columns of words
NAMES = frozenset({"#", "phase", "lead", "channel"})  # never broken: as wide as their longest name
NO_WRAP_UP_TO = 24  # a column whose cells are all this short stays on one line (numbers, statuses)
MIN_WRAPPED = 24  # the least width a column of words is given before the table goes on below


def terminal_width() -> int:
    """Columns of the terminal (``COLUMNS`` overrides; 120 when the output is not a terminal)."""
    return max(60, shutil.get_terminal_size((120, 24)).columns)


@dataclass
class Notes:
    """Numbered notes, each text once."""

    items: list[str] = field(default_factory=list)

    def ref(self, text: str | None) -> str:
        if not text:
            return ""
        if text not in self.items:
            self.items.append(text)
        return f"[{self.items.index(text) + 1}]"


@dataclass
class Style:
    """Markdown (report.md) or the console (``width`` columns)."""

    markdown: bool
    width: int = 120
    notes: Notes = field(default_factory=Notes)

    def table(self, header: list[str], rows: list[list[str]]) -> str:
        return markdown_table(header, rows) if self.markdown else text_table(header, rows, width=self.width)

    def heading(self, level: int, text: str) -> str:
        if self.markdown:
            return "#" * level + " " + text
        return self.wrap(("", "== ", "-- ")[min(level, 3) - 1] + text)

    def wrap(self, text: str, indent: str = "") -> str:
        if self.markdown:
            return indent + text
        return "\n".join(textwrap.wrap(text, self.width, initial_indent=indent, subsequent_indent=indent + "  ",
                                       break_on_hyphens=False, break_long_words=False)) or text

    def label(self, variant: Variant) -> str:
        text = variant.label
        if not self.markdown and len(text) > CONSOLE_LABEL:
            text = text[:CONSOLE_LABEL - 1] + "…"
        return text

    def with_note(self, text: str, note: str | None) -> str:
        ref = self.notes.ref(note)
        return f"{text} {ref}".strip() if ref else text


# ------------------------------------------------------------------------------------- tables
def _drop_empty(header: list[str], rows: list[list[str]]) -> tuple[list[str], list[list[str]]]:
    keep = [i for i, name in enumerate(header) if name != "note" or any(r[i] for r in rows)]
    return [header[i] for i in keep], [[r[i] for i in keep] for r in rows]


def text_table(header: list[str], rows: list[list[str]], *, width: int) -> str:
    """A table at most ``width`` columns wide. Rich shares the width out and wraps long words;
    columns that do not fit beside each other even so go on into a second table below, which
    repeats the first column (the variant's tag, #3) so that its rows still say whose they are. A
    name (a phase, a channel) is never broken across lines: its column is as wide as the longest."""
    header, rows = _drop_empty(header, rows)
    wraps = [name not in NAMES and (name in WRAPPED or max((len(r[i]) for r in rows), default=0) > NO_WRAP_UP_TO)
             for i, name in enumerate(header)]
    natural = [max([len(name), *(len(r[i]) for r in rows)]) for i, name in enumerate(header)]
    least = [min(n, MIN_WRAPPED) if w else n for n, w in zip(natural, wraps, strict=True)]
    parts: list[list[int]] = [[0]]
    for index in range(1, len(header)):
        # each column: its cells, a space either side and rich's divider between columns
        if sum(least[i] + 3 for i in parts[-1]) + least[index] > width and len(parts[-1]) > 1:
            parts.append([0])
        parts[-1].append(index)
    return "\n\n".join(_rich_table([header[i] for i in part], [[r[i] for i in part] for r in rows],
                                    [least[i] if wraps[i] else None for i in part], width=width) for part in parts)


PLAIN_FROM = 200  # rows: a table this long is laid out by rich once, on a few rows, then written row by row


def _console(width: int) -> Any:
    from rich.console import Console

    return Console(file=io.StringIO(), width=width, color_system=None, force_terminal=False, soft_wrap=False,
                   emoji=False, highlight=False)


def _rich_table(header: list[str], rows: list[list[str]], wraps: list[int | None], *, width: int) -> str:
    """``wraps``: per column, the least width of a column of words (None: a column kept on one line)."""
    if len(rows) >= PLAIN_FROM:
        fast = _row_by_row(header, rows, wraps, width=width)
        if fast is not None:
            return fast
    return _rich_render(header, rows, wraps, width=width)


def _rich_render(header: list[str], rows: list[list[str]], wraps: list[int | None], *, width: int,
                 uncropped: bool = False) -> str:
    """``uncropped``: laid out in ``width`` as ever, but lines longer than that are kept whole."""
    from rich import box
    from rich.table import Table
    from rich.text import Text

    table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, padding=(0, 1), header_style=None)
    for name, least in zip(header, wraps, strict=True):
        natural = max([len(name), *(len(row[len(table.columns)]) for row in rows)])
        table.add_column(Text(name), overflow="fold", no_wrap=least is None,
                         min_width=natural if least is None else least)
    for row in rows:
        table.add_row(*(Text(cell) for cell in row))  # Text: a "[1]" in a cell is not markup
    console = _console(max(width, 10_000) if uncropped else width)
    console.print(table, width=width)
    return "\n".join(line.rstrip() for line in console.file.getvalue().splitlines()).strip("\n")


def _row_by_row(header: list[str], rows: list[list[str]], wraps: list[int | None], *, width: int) -> str | None:
    """``_rich_render``'s text without rich's per-cell rendering (10,000 rows of runs: a second, not a
    minute). Rich lays out a table by each column's longest cell and longest word: it lays out the
    rows that hold them, plus a row of "x" that shows where each column starts; then every row is
    written at those widths, a long cell wrapped by rich's own wrap. None (rich does it all) when a
    cell is not plain one-line ASCII, a header is empty, a one-line column would be cut or the table
    is wider than the console (rich crops what does not fit)."""
    from rich.text import Text

    if not all(cell.isascii() and cell.isprintable() for row in (header, *rows) for cell in row) or not all(header):
        return None
    picked = {max(range(len(rows)), key=lambda r, i=i, f=f: f(rows[r][i])) for i in range(len(header))
              for f in (len, lambda c: max(map(len, c.split(" "))))}
    laid = _rich_render(header, [rows[r] for r in sorted(picked)] + [["x"] * len(header)], wraps, width=width,
                        uncropped=True)
    lines = laid.splitlines()
    rule = next((n for n, line in enumerate(lines) if line and set(line) == {"\u2500"}), None)
    starts = [n for n, char in enumerate(lines[-1]) if char == "x"]
    if rule is None or len(starts) != len(header) or len(lines[rule]) > width:  # wider: rich crops what sticks out
        return None
    widths = [b - a - 3 for a, b in zip(starts, starts[1:], strict=False)] + [len(lines[rule]) - starts[-1]]
    console, out = _console(width), lines[:rule + 1]
    for row in rows:
        cells = []
        for cell, w, least in zip(row, widths, wraps, strict=True):
            if len(cell) > w and least is None:
                return None
            cells.append([cell] if len(cell) <= w else [str(t) for t in Text(cell).wrap(console, w, overflow="fold")])
        for depth in range(max(map(len, cells))):
            out.append("   ".join((c[depth] if depth < len(c) else "").ljust(w)
                                   for c, w in zip(cells, widths, strict=True)).rstrip())
    return "\n".join(out).strip("\n")


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    header, rows = _drop_empty(header, rows)

    def cell(text: str) -> str:
        return text.replace("|", "\\|")

    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


# ------------------------------------------------------------------------------------ cells
def human_bytes(n: float | None) -> str:
    return outputs.human_bytes(n, missing="-")


def _f(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def status_cell(variant: Variant, style: Style) -> str:
    return style.with_note(variant.status, variant.reason)


def mfu_cell(variant: Variant, style: Style) -> str:
    """The MFU of the pooled tokens/s, and a note naming its peak (and the threads it was measured
    with, on a CPU)."""
    mfu = variant.mfu()
    if mfu is None:
        return "-"
    peak, source = variant.peak()
    assert peak is not None
    world = variant.world_size()
    per = f" per rank x {world} ranks" if world > 1 else ""
    source = WHEN.sub("", str(source))  # when and where it was cached: report.json has it; the note, once
    return style.with_note(f"{mfu:.1%}", f"MFU against {peak / 1e9:,.0f} GFLOP/s{per}: {source}")


def speedup_cell(comparison: Comparison | None) -> str:
    """The speedup and its interval; in parentheses when the analysis gives it no verdict (a ratio
    the drift guard withholds is not a finding)."""
    if comparison is None or comparison.speedup is None:
        return "-"
    return comparison.speedup_text() if comparison.judged else f"({comparison.speedup:.2f}x)"


def verdict_cell(comparison: Comparison | None, style: Style) -> str:
    if comparison is None:
        return ""
    return style.with_note(comparison.verdict_short or comparison.verdict, comparison.verdict_note)


def loss_delta_cell(comparison: Comparison | None, style: Style) -> str:
    if comparison is None or comparison.loss_delta is None:
        return "-"
    return style.with_note(f"{comparison.loss_delta:+.5f}", comparison.loss_note)


def memory_cell(variant: Variant, style: Style) -> str:
    estimate = variant.max_of(lambda s: s.memory.estimate_bytes)
    text = human_bytes(variant.peak_memory())
    return text + (f" (est {human_bytes(estimate)})" if estimate and style.markdown else "")


def _loss_kind(group: Group) -> str:
    """"eval" when every completed variant has an eval loss (the one compared), else "final"."""
    done = [v for v in group.variants if v.completed]
    return "eval" if done and all(v.loss()[1] == "eval" for v in done) else "final"


# ------------------------------------------------------------------------------- predictions
def predicted(variant: Variant) -> tuple[float | None, float | None]:
    """The step time ``optbench train`` predicted before the loop (summary.json ``predicted``, the
    median over runs), and its error against the measured median: predicted / measured - 1."""
    value = variant.median_of(lambda s: s.predicted_step_time_s)
    tp = variant.throughput
    return value, None if value is None or tp is None else value / tp.median - 1


def prediction_line(groups: list[Group]) -> str | None:
    """The prediction's error over every variant that recorded one, what it is, and whether the
    machine let the prediction hold: on a shared machine whose own speed moved as much as the
    error, the error says more about the machine than about the prediction (as the speed verdicts)."""
    errors = [(abs(e), e, v) for g in groups for v in g.variants for e in [predicted(v)[1]] if e is not None]
    if not errors:
        return None
    errors.sort(key=lambda item: item[0])
    _, worst, variant = errors[-1]
    line = (f"predicted step time vs measured median over {len(errors)} variant(s): median |error| "
            f"{errors[len(errors) // 2][0]:.1%}, worst {worst:+.1%} ({variant.label}). Before its loop every optbench "
            f"train predicts its own step (on a CPU: each op of its traced step timed on this machine just "
            f"before the loop; on a GPU: the card's roofline), then measures it; error = predicted / measured - 1 "
            f"(docs/estimate-speed.md). ")
    speeds = machine_speeds([r.summary for r in variant.completed])
    if len(speeds) < 2:
        return line + "Its runs recorded no machine-speed probe, so how much the machine moved is not known."
    moved = max(speeds) / min(speeds) - 1
    if max(1 + worst, 1 / (1 + worst)) - 1 <= moved:  # a machine that much faster or slower explains it
        return line + (f"The machine's own speed (a matmul probe before and after each run) moved {moved:.0%} "
                       f"during that variant's runs, as much as the error: on a loaded machine the ops are timed "
                       f"at one moment and the steps run at another, so the prediction cannot hold there, and "
                       f"the error says more about the machine than about the prediction: a quieter machine tests it.")
    return line + (f"The machine's own speed (a matmul probe before and after each run) moved {moved:.0%} during "
                   f"that variant's runs, less than the error: the error is mostly the prediction's own (a load "
                   f"that came and went between the probes is not seen by them).")


# ------------------------------------------------------------------------- withheld verdicts
COMPARE_REPEATS = 3  # optbench compare's default


def _withheld_by_drift(comparison: Comparison | None) -> bool:
    return comparison is not None and comparison.verdict_short.startswith("no verdict: speed moved")


def verdict_advice(group: Group) -> tuple[str, str] | None:
    """What would give the speed verdicts the drift guard withheld in this group, and the command
    that compares its baseline with its candidate (the furthest withheld one: a phase sweep's
    furthest phase that ran). None when no verdict was withheld for the machine's drift."""
    withheld = [v for v in group.variants if _withheld_by_drift(group.comparisons.get(v.key))]
    withheld += [row.variant for row in group.phases if _withheld_by_drift(row.vs_previous)
                 and row.variant not in withheld]
    base = group.baseline
    if not withheld or base is None:
        return None
    candidate = ([row.variant for row in group.phases if row.variant in withheld] or withheld)[-1]
    speeds = machine_speeds([r.summary for r in group.runs])
    moved = f"{max(speeds) / min(speeds) - 1:.0%}" if len(speeds) > 1 else "more than the effect"
    text = (f"No speed verdict for {len(withheld)} variant(s): the machine's own speed (a matmul probe before and "
            f"after every run) moved up to {moved} during these runs, more than the effects claimed. A verdict "
            f"needs a machine that holds steadier than the effect: on a quieter machine (no other jobs; each "
            f"run's probes are summary.json's machine_speed), optbench compare runs the baseline and a "
            f"candidate alternately (A B, B A, ...), so that a slow drift favours neither, and --repeats pools "
            f"the noise between runs into the interval. The baseline ({base.tag}) against {candidate.tag}:")
    sides = [" ".join(shlex.quote(o) for o in v.first.overrides) for v in (base, candidate)]
    return text, f"optbench compare {sides[0]} -- {sides[1]} --repeats {COMPARE_REPEATS}"


def _has_predictions(group: Group) -> bool:
    return any(predicted(v)[0] is not None for v in group.variants)


# ------------------------------------------------------------------------------------- rows
def variant_header(group: Group, *, with_runs: bool) -> list[str]:
    head = ["#", "variant", "status"] + (["runs"] if with_runs else [])
    return head + ["tokens/s", "step s [p10-p90]", *(["predicted s (error)"] if _has_predictions(group) else []),
                   "MFU", "peak memory", f"{_loss_kind(group)} loss", "speedup [95% CI]", "verdict", "loss delta",
                   "memory ratio"]


def variant_columns(group: Group) -> tuple[str, bool]:
    """(the loss the table shows, whether it has a predictions column): one pass over the group,
    once per table (not once per row: 10,000 variants made that quadratic)."""
    return _loss_kind(group), _has_predictions(group)


def variant_row(group: Group, variant: Variant, style: Style, *, with_runs: bool,
                columns: tuple[str, bool] | None = None) -> list[str]:
    kind, forecast = columns or variant_columns(group)
    tp = variant.throughput
    comparison = None if variant.is_baseline else group.comparisons.get(variant.key)
    row = [variant.tag, style.label(variant), status_cell(variant, style)]
    if with_runs:
        row.append(f"{len(variant.completed)}/{len(variant.runs)}")
    if not variant.completed:
        return row + ["-"] * (10 if forecast else 9)
    value, error = predicted(variant)
    return row + [
        _f(tp.tokens_per_s if tp else None, ",.0f"),
        f"{tp.median:.3g} [{tp.p10:.3g}-{tp.p90:.3g}]" if tp else "-",
        *([("-" if value is None else f"{value:.3g}" + ("" if error is None else f" ({error:+.0%})"))]
          if forecast else []),
        mfu_cell(variant, style),
        memory_cell(variant, style),
        _f(variant.mean_of(LOSS[kind]), ".4f"),
        "baseline" if variant.is_baseline else speedup_cell(comparison),
        "" if variant.is_baseline else verdict_cell(comparison, style),
        "" if variant.is_baseline else loss_delta_cell(comparison, style),
        "" if comparison is None or comparison.memory_ratio is None else f"{comparison.memory_ratio:.2f}x",
    ]


def phase_header() -> list[str]:
    return ["#", "phase", "status", "tokens/s", "vs baseline", "vs previous", "verdict vs previous", "peak memory",
            "memory vs baseline", "loss delta"]


def phase_row(row: PhaseRow, style: Style) -> list[str]:
    variant = row.variant
    head = [variant.tag, row.phase, status_cell(variant, style)]
    if not variant.completed:
        return head + ["-"] * 7
    base, prev = row.vs_baseline, row.vs_previous
    return head + [
        _f(variant.throughput.tokens_per_s if variant.throughput else None, ",.0f"),
        "1.00x (baseline)" if variant.is_baseline else speedup_cell(base),
        "-" if prev is None else speedup_cell(prev),
        "" if prev is None else verdict_cell(prev, style),
        human_bytes(variant.peak_memory()),
        "-" if base is None or base.memory_ratio is None else f"{base.memory_ratio:.2f}x",
        "-" if base is None or variant.is_baseline else loss_delta_cell(base, style),
    ]


def runs_header() -> list[str]:
    return ["run", "#", "status", "tokens/s", "step s median", "final loss"]


def run_row(run: Run, variant: Variant, run_dir: str, style: Style) -> list[str]:
    tp = run.summary.throughput
    status = run.status if run.completed else style.with_note(run.status, run.error or "no error recorded")
    return [run_dir, variant.tag, status, _f(num(tp.tokens_per_s), ",.0f"),
            _f(num(tp.step_time_s.median), ".4g"), _f(num(run.summary.loss.final), ".4f")]
