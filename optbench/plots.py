"""The report's PNG plots, drawn with matplotlib's Agg canvas (no display, no pyplot global state).

* ``loss_curves.png``: the train loss of every run on one axis (eval losses as markers);
* ``throughput.png``: tokens/s per variant, with the p10-p90 spread of the step times as error bars;
* ``memory_vs_time.png``: peak memory against time per 1,000 tokens (the step time, normalized so
  that variants with other batch sizes compare fairly), with the Pareto front drawn.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from optbench.review import num

if TYPE_CHECKING:
    from optbench.review import Group, Report, Variant

PLOT_FILES = ("loss_curves.png", "throughput.png", "memory_vs_time.png")
COLORS = ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown", "tab:pink",
          "tab:gray", "tab:olive", "tab:cyan")


def _entries(report: Report) -> list[tuple[Group, Variant, str]]:
    many = len(report.groups) > 1
    return [(g, v, f"{g.name}: {v.label}" if many else v.label) for g in report.groups for v in g.variants]


def _save(fig: Figure, path: Path) -> Path:
    FigureCanvasAgg(fig)
    fig.tight_layout()
    fig.savefig(path, format="png", dpi=110)
    return path


def _empty(ax, text: str) -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, color="gray")


def plot_losses(report: Report, path: Path) -> Path:
    fig = Figure(figsize=(8, 5))
    ax = fig.add_subplot()
    drawn = 0
    for i, (_group, variant, label) in enumerate(_entries(report)):
        color = COLORS[i % len(COLORS)]
        for j, run in enumerate(variant.runs):
            train = [(r["step"], num(r.get("loss"))) for r in run.metrics if r.get("kind") == "train"]
            train = [(s, v) for s, v in train if v is not None and isinstance(s, int)]
            evals = [(r["step"], num(r.get("loss"))) for r in run.metrics if r.get("kind") == "eval"]
            evals = [(s, v) for s, v in evals if v is not None and isinstance(s, int)]
            if train:
                ax.plot(*zip(*train, strict=True), color=color, alpha=0.85, linewidth=1.2,
                        label=label if j == 0 else None)
                drawn += 1
            if evals:
                ax.plot(*zip(*evals, strict=True), linestyle="none", marker="o", color=color, markersize=5)
    if drawn:
        ax.legend(fontsize=7, loc="upper right")
    else:
        _empty(ax, "no run logged a train loss")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (line: train, dots: eval)")
    ax.set_title("Loss curves")
    ax.grid(alpha=0.3)
    return _save(fig, path)


def plot_throughput(report: Report, path: Path) -> Path:
    entries = _entries(report)
    fig = Figure(figsize=(8, 1.2 + 0.45 * max(1, len(entries))))
    ax = fig.add_subplot()
    labels, values, low, high, colors = [], [], [], [], []
    for i, (group, variant, label) in enumerate(entries):
        tp = variant.throughput
        labels.append(label if variant.completed else f"{label} ({variant.status})")
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
    positions = list(range(len(labels)))
    ax.barh(positions, values, xerr=[low, high], color=colors, capsize=3, alpha=0.85)
    right = max((v + h for v, h in zip(values, high, strict=True)), default=0.0)
    if right > 0:
        ax.set_xlim(0, right * 1.45)  # room for the speedup and verdict beside the bars
    ax.set_yticks(positions, labels, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("tokens/s (median step; bars: p10-p90 of the step times)")
    ax.set_title("Throughput")
    ax.grid(axis="x", alpha=0.3)
    return _save(fig, path)


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
    fig = Figure(figsize=(8, 5))
    ax = fig.add_subplot()
    points, labels, missing = [], [], []
    for _group, variant, label in _entries(report):
        tp, memory = variant.throughput, variant.peak_memory()
        if tp is None or memory is None:
            if variant.completed:
                missing.append(label)
            continue
        points.append((1000.0 * tp.median / tp.tokens_per_step * 1000.0, memory / 2**20))
        labels.append(label)
    for i, ((x, y), label) in enumerate(zip(points, labels, strict=True)):
        ax.scatter([x], [y], color=COLORS[i % len(COLORS)], zorder=3)
        ax.annotate(label, (x, y), fontsize=7, xytext=(4, 4), textcoords="offset points")
    front = pareto_front(points)
    if len(front) > 1:
        xs, ys = zip(*(points[i] for i in front), strict=True)
        ax.step(xs, ys, where="post", color="black", alpha=0.4, linestyle="--", label="Pareto front")
        ax.legend(fontsize=7)
    if not points:
        _empty(ax, "no completed run measured both time and peak memory")
    if missing:
        ax.set_title(f"Peak memory vs time (no peak memory: {', '.join(missing)})", fontsize=8)
    else:
        ax.set_title("Peak memory vs time (lower left is better)")
    ax.set_xlabel("step time per 1,000 tokens (ms)")
    ax.set_ylabel("peak memory (MiB)")
    ax.grid(alpha=0.3)
    return _save(fig, path)


def write_plots(report: Report, out_dir: Path) -> list[Path]:
    drawers = (plot_losses, plot_throughput, plot_memory_vs_time)
    return [draw(report, out_dir / name) for draw, name in zip(drawers, PLOT_FILES, strict=True)]
