"""The report's PNG plots, drawn with matplotlib's Agg canvas (no display, no pyplot global state).

* ``loss_curves.png``: the train loss of every run (eval losses as dots), one panel per group
  (model and task: losses of different tasks are on different scales and never share an axis).
  Curves that are identical are drawn once and labelled as identical (five variants with the same
  losses would otherwise show one line and five legend entries); others differ in line style too;
* ``throughput.png``: tokens/s per variant, with the p10-p90 spread of the step times as error bars;
* ``memory_vs_time.png``: peak memory against time per 1,000 tokens (the step time, normalized so
  that variants with other batch sizes compare fairly), with the Pareto front drawn; points carry a
  number, the legend below says which variant each number is (labels beside points overlap).

Legends sit below the axes, never over the curves; long variant names are wrapped, and every figure
is saved with a tight bounding box so nothing is clipped.
"""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import TYPE_CHECKING

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from optbench.report.runs import num

if TYPE_CHECKING:
    from optbench.report.analysis import Group, Report
    from optbench.report.runs import Run
    from optbench.report.variants import Variant

PLOT_FILES = ("loss_curves.png", "throughput.png", "memory_vs_time.png")
COLORS = ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown", "tab:pink",
          "tab:gray", "tab:olive", "tab:cyan")
LINESTYLES = ("-", "--", "-.", ":")
MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")
WRAP = 60  # characters per line of a label


def _entries(report: Report) -> list[tuple[Group, Variant, str]]:
    many = len(report.groups) > 1
    return [(g, v, f"{g.name}/{g.task}: {v.label}" if many else v.label) for g in report.groups for v in g.variants]


def _wrap(text: str, width: int = WRAP) -> str:
    return "\n".join(textwrap.wrap(text, width, break_long_words=True, break_on_hyphens=False)) or text


def _save(fig: Figure, path: Path) -> Path:
    FigureCanvasAgg(fig)
    fig.savefig(path, format="png", dpi=110, bbox_inches="tight")  # legends below the axes stay in
    return path


def _empty(ax, text: str) -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, color="gray")


def _legend_below(ax, handles=None, labels=None, *, ncol: int = 1) -> None:
    kwargs = {} if handles is None else {"handles": handles, "labels": labels}
    ax.legend(**kwargs, fontsize=7, loc="upper left", bbox_to_anchor=(0.0, -0.14), ncol=ncol, frameon=False)


# ---------------------------------------------------------------------------------------- loss
def _curves(run: Run) -> tuple[list[tuple[int, float]], list[tuple[int, float]]]:
    def points(kind: str) -> list[tuple[int, float]]:
        found = [(r.get("step"), num(r.get("loss"))) for r in run.metrics if r.get("kind") == kind]
        return [(s, v) for s, v in found if v is not None and isinstance(s, int)]

    return points("train"), points("eval")


def identical_curves(curves: list[tuple[str, list[tuple[int, float]]]]) -> list[list[int]]:
    """Indices of ``(label, points)`` grouped by identical points (first appearance order)."""
    groups: list[list[int]] = []
    seen: dict[tuple, int] = {}
    for index, (_label, points) in enumerate(curves):
        key = tuple(points)
        if key in seen:
            groups[seen[key]].append(index)
        else:
            seen[key] = len(groups)
            groups.append([index])
    return groups


def plot_losses(report: Report, path: Path) -> Path:
    groups = [g for g in report.groups if g.variants] or report.groups
    many = len(groups) > 1
    fig = Figure(figsize=(9, 1.0 + 4.2 * max(1, len(groups))))
    color_of = {id(v): COLORS[i % len(COLORS)] for i, (_g, v, _l) in enumerate(_entries(report))}
    for panel, group in enumerate(groups or [None]):
        ax = fig.add_subplot(max(1, len(groups)), 1, panel + 1)
        if group is None:
            _empty(ax, "no runs")
            continue
        curves: list[tuple[str, list[tuple[int, float]]]] = []
        meta: list[tuple[Variant, list[tuple[int, float]]]] = []
        for variant in group.variants:
            for j, run in enumerate(variant.runs):
                train, evals = _curves(run)
                if train:
                    label = variant.label + (f" (repeat {j + 1})" if len(variant.runs) > 1 else "")
                    curves.append((label, train))
                    meta.append((variant, evals))
        for style, members in enumerate(identical_curves(curves)):
            first = members[0]
            variant, evals = meta[first]
            color = color_of[id(variant)]
            label = _wrap(curves[first][0], 100)
            if len(members) > 1:  # one line drawn for all: say so
                label = f"{len(members)} identical curves:\n" + "\n".join(
                    _wrap(f"= {curves[i][0]}", 100) for i in members)
            xs, ys = zip(*curves[first][1], strict=True)
            ax.plot(xs, ys, color=color, alpha=0.9, linewidth=1.3, linestyle=LINESTYLES[style % len(LINESTYLES)],
                    marker=MARKERS[style % len(MARKERS)], markevery=max(1, len(xs) // 8), markersize=4,
                    label=label)
            for i in members:
                if meta[i][1]:
                    ax.plot(*zip(*meta[i][1], strict=True), linestyle="none", marker="o", color=color, markersize=5)
        if curves:
            _legend_below(ax)
        else:
            _empty(ax, "no run logged a train loss")
        ax.set_xlabel("step")
        ax.set_ylabel("loss (line: train, dots: eval)")
        ax.set_title(f"Loss curves: {group.label}" if many else "Loss curves", fontsize=10)
        ax.grid(alpha=0.3)
    fig.subplots_adjust(hspace=0.9)
    return _save(fig, path)


# ---------------------------------------------------------------------------------- throughput
def plot_throughput(report: Report, path: Path) -> Path:
    entries = _entries(report)
    labels = [_wrap(label if v.completed else f"{label} ({v.status})", 45) for _g, v, label in entries]
    lines = sum(label.count("\n") + 1 for label in labels)
    fig = Figure(figsize=(10, 1.4 + 0.22 * max(4, lines) + 0.2 * len(entries)))
    ax = fig.add_subplot()
    values, low, high, colors = [], [], [], []
    for i, (group, variant, _label) in enumerate(entries):
        tp = variant.throughput
        colors.append(COLORS[i % len(COLORS)])
        if tp is None:
            values.append(0.0)
            low.append(0.0)
            high.append(0.0)
            continue
        values.append(tp.tokens_per_s)
        low.append(tp.tokens_per_s - tp.tokens_per_step / tp.p90)  # the slow steps (p90 time)
        high.append(tp.tokens_per_step / tp.p10 - tp.tokens_per_s)  # the fast steps (p10 time)
        comparison = group.comparisons.get(variant.key)
        if comparison is not None and comparison.speedup is not None and not variant.is_baseline:
            ax.text(tp.tokens_per_s + high[-1], i, f"  {comparison.speedup:.2f}x ({comparison.verdict})",
                    va="center", fontsize=7)
        elif variant.is_baseline:
            ax.text(tp.tokens_per_s + high[-1], i, "  baseline", va="center", fontsize=7)
    positions = list(range(len(labels)))
    ax.barh(positions, values, xerr=[low, high], color=colors, capsize=3, alpha=0.85)
    right = max((v + h for v, h in zip(values, high, strict=True)), default=0.0)
    if right > 0:
        ax.set_xlim(0, right * 1.6)  # room for the speedup and verdict beside the bars
    ax.set_yticks(positions, labels, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("tokens/s (median step; bars: p10-p90 of the step times)")
    ax.set_title("Throughput")
    ax.grid(axis="x", alpha=0.3)
    return _save(fig, path)


# ------------------------------------------------------------------------------ memory vs time
def pareto_front(points: list[tuple[float, float]]) -> list[int]:
    """Indices of the points no other point beats in both coordinates (lower is better in both)."""
    front = []
    for i, (x, y) in enumerate(points):
        dominated = any(
            (ox <= x and oy <= y) and (ox < x or oy < y) for j, (ox, oy) in enumerate(points) if j != i
        )
        if not dominated:
            front.append(i)
    return sorted(front, key=lambda i: points[i])


def plot_memory_vs_time(report: Report, path: Path) -> Path:
    points, labels, colors, missing = [], [], [], []
    for i, (_group, variant, label) in enumerate(_entries(report)):
        tp, memory = variant.throughput, variant.peak_memory()
        if tp is None or memory is None:
            if variant.completed:
                missing.append(label)
            continue
        points.append((1000.0 * tp.median / tp.tokens_per_step * 1000.0, memory / 2**20))
        labels.append(label)
        colors.append(COLORS[i % len(COLORS)])
    fig = Figure(figsize=(9, 5 + 0.18 * sum(_wrap(x, 100).count("\n") + 1 for x in labels)))
    ax = fig.add_subplot()
    handles = []
    for number, ((x, y), color) in enumerate(zip(points, colors, strict=True), start=1):
        handles.append(ax.scatter([x], [y], color=color, zorder=3, s=36))
        # numbers, not names, beside the points: names of neighbouring points overlap
        ax.annotate(str(number), (x, y), fontsize=8, xytext=(5, 3 + 8 * ((number - 1) % 3)),
                    textcoords="offset points", color=color, fontweight="bold")
    legend_labels = [_wrap(f"{n}  {label}", 100) for n, label in enumerate(labels, start=1)]
    front = pareto_front(points)
    if len(front) > 1:
        xs, ys = zip(*(points[i] for i in front), strict=True)
        (line,) = ax.step(xs, ys, where="post", color="black", alpha=0.4, linestyle="--")
        handles.append(line)
        legend_labels.append("Pareto front")
    if points:
        _legend_below(ax, handles, legend_labels)
    else:
        _empty(ax, "no completed run measured both time and peak memory")
    if missing:
        ax.set_title(_wrap(f"Peak memory vs time (no peak memory: {', '.join(missing)})", 100), fontsize=8)
    else:
        ax.set_title("Peak memory vs time (lower left is better)")
    ax.set_xlabel("step time per 1,000 tokens (ms)")
    ax.set_ylabel("peak memory (MiB)")
    ax.grid(alpha=0.3)
    return _save(fig, path)


def write_plots(report: Report, out_dir: Path) -> list[Path]:
    drawers = (plot_losses, plot_throughput, plot_memory_vs_time)
    return [draw(report, out_dir / name) for draw, name in zip(drawers, PLOT_FILES, strict=True)]
