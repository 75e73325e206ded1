"""The report's PNG plots, drawn with matplotlib's Agg canvas (no display, no pyplot global state).

* ``loss_curves.png``: the train loss of every run (eval losses as dots), one panel per group
  (model and task: losses of different tasks are on different scales and never share an axis).
  Curves that would hide each other (identical, or closer than the panel can show: compile's
  1e-6 rounding differences) are drawn once, and the legend says which they are and how far apart;
  the others differ in line style too;
* ``throughput.png``: tokens/s per variant, with the p10-p90 spread of the step times as error bars,
  the speedup and its verdict beside each bar, and, in the row of a variant that did not run, why;
* ``memory_vs_time.png``: peak memory against time per 1,000 tokens (the step time, normalized so
  that variants with other batch sizes compare fairly), with the Pareto front drawn; each point
  carries the variant's tag (#3: the sweep's job number, as every table gives it), the legend
  below names it.

Every text stays inside its axes (the tests check it), legends sit below the axes, long names are
wrapped, and every figure is saved with a tight bounding box so nothing is clipped.
"""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import TYPE_CHECKING

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from optbench.outputs import reason_gist

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
RESOLUTION = 1 / 400  # of a panel's loss range: curves closer than this cannot be told apart on it
MAX_PLOTTED = 60  # variants per figure (curves per panel): a figure of thousands is unreadable and
# takes minutes; the ones left out are named in its title, the tables list every one


def _named(variant: Variant) -> str:
    """"#3 phase=3_loss_freq"; a compare's sides are already named by their tag ("A ac=none")."""
    return variant.label if variant.label.startswith(f"{variant.tag} ") else f"{variant.tag} {variant.label}"


def _entries(report: Report) -> list[tuple[Group, Variant, str]]:
    """The variants a figure shows: the first ``MAX_PLOTTED`` (``_left_out`` says how many more)."""
    many = len(report.groups) > 1
    return [(g, v, f"{g.name}/{g.task}: {_named(v)}" if many else _named(v))
            for g in report.groups for v in g.variants][:MAX_PLOTTED]


def _left_out(shown: int, total: int, what: str = "variants") -> str:
    """" (the first 60 of 10,000 variants; the tables list all)", or "" when all are shown."""
    return f" (the first {shown:,} of {total:,} {what}; the tables list all)" if total > shown else ""


def _variant_count(report: Report) -> int:
    return sum(len(g.variants) for g in report.groups)


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
    train, evals = run.curves
    return list(train), list(evals)


def _distance(a: list[tuple[int, float]], b: list[tuple[int, float]]) -> float | None:
    """The largest loss difference of two curves over the same steps; None when their steps differ."""
    if [s for s, _ in a] != [s for s, _ in b]:
        return None
    return max((abs(x - y) for (_, x), (_, y) in zip(a, b, strict=True)), default=0.0)


def identical_curves(curves: list[tuple[str, list[tuple[int, float]]]], *, tolerance: float = 0.0) -> list[list[int]]:
    """Indices of ``(label, points)`` grouped by curves no further apart than ``tolerance`` from
    the first of their group (first appearance order); 0: only identical ones."""
    groups: list[list[int]] = []
    for index, (_label, points) in enumerate(curves):
        for members in groups:
            distance = _distance(curves[members[0]][1], points)
            if distance is not None and distance <= tolerance:
                members.append(index)
                break
        else:
            groups.append([index])
    return groups


def _same_label(curves: list[tuple[str, list[tuple[int, float]]]], members: list[int]) -> str:
    """The legend entry of curves drawn as one: identical, or how close."""
    spread = max(_distance(curves[members[0]][1], curves[i][1]) or 0.0 for i in members)
    head = (f"{len(members)} identical curves:" if spread == 0 else
            f"{len(members)} curves within {spread:.1g} of each other (drawn as one):")
    return head + "\n" + "\n".join(_wrap(f"= {curves[i][0]}", 100) for i in members)


def _panel_curves(group: Group) -> tuple[list[tuple[str, list[tuple[int, float]]]], list[tuple[Variant, list]]]:
    """(label, train points) and (variant, eval points) of the group's runs: the first ``MAX_PLOTTED``."""
    curves: list[tuple[str, list[tuple[int, float]]]] = []
    meta: list[tuple[Variant, list[tuple[int, float]]]] = []
    for variant in group.variants:
        for j, run in enumerate(variant.runs):
            train, evals = _curves(run) if len(curves) < MAX_PLOTTED else ([], [])
            if train:
                label = _named(variant) + (f" (repeat {j + 1})" if len(variant.runs) > 1 else "")
                curves.append((label, train))
                meta.append((variant, evals))
    return curves, meta


def _draw_losses(ax, group: Group, color_of: dict[int, str]) -> None:
    curves, meta = _panel_curves(group)
    if not curves:
        _empty(ax, "no run logged a train loss")
        return
    values = [v for _label, points in curves for _s, v in points]
    tolerance = (max(values) - min(values)) * RESOLUTION
    for style, members in enumerate(identical_curves(curves, tolerance=tolerance)):
        first = members[0]
        variant, _evals = meta[first]
        color = color_of[id(variant)]
        label = _wrap(curves[first][0], 100) if len(members) == 1 else _same_label(curves, members)
        xs, ys = zip(*curves[first][1], strict=True)
        ax.plot(xs, ys, color=color, alpha=0.9, linewidth=1.3, linestyle=LINESTYLES[style % len(LINESTYLES)],
                marker=MARKERS[style % len(MARKERS)], markevery=max(1, len(xs) // 8), markersize=4, label=label)
        for i in members:
            if meta[i][1]:
                ax.plot(*zip(*meta[i][1], strict=True), linestyle="none", marker="o", color=color, markersize=5)
    _legend_below(ax)


def losses_figure(report: Report) -> Figure:
    groups = [g for g in report.groups if g.variants] or report.groups
    many = len(groups) > 1
    fig = Figure(figsize=(9, 1.0 + 4.2 * max(1, len(groups))))
    color_of = {id(v): COLORS[i % len(COLORS)] for i, v in enumerate(v for g in groups for v in g.variants)}
    for panel, group in enumerate(groups or [None]):
        ax = fig.add_subplot(max(1, len(groups)), 1, panel + 1)
        if group is None:
            _empty(ax, "no runs")
            continue
        _draw_losses(ax, group, color_of)
        ax.set_xlabel("step")
        ax.set_ylabel("loss (line: train, dots: eval)")
        runs = sum(len(v.runs) for v in group.variants)
        title = (f"Loss curves: {group.label}" if many else "Loss curves") + _left_out(MAX_PLOTTED, runs, "runs")
        ax.set_title(_wrap(title, 100), fontsize=10)
        ax.grid(alpha=0.3)
    fig.subplots_adjust(hspace=0.9)
    return fig


def plot_losses(report: Report, path: Path) -> Path:
    return _save(losses_figure(report), path)


# ---------------------------------------------------------------------------------- throughput
BAR_SHARE = 0.55  # of the axes' width: the bars and their spread; the words beside them get the rest


def _bar_text(group: Group, variant: Variant) -> str:
    """What is said beside a variant's bar: baseline, its speedup and verdict (a withheld ratio in
    parentheses), or, for a variant that did not run, why."""
    if not variant.completed:
        return _wrap(reason_gist(variant.reason or variant.status), 75)
    if variant.is_baseline:
        return "baseline"
    comparison = group.comparisons.get(variant.key)
    if comparison is None or comparison.speedup is None:
        return ""
    ratio = f"{comparison.speedup:.2f}x" if comparison.judged else f"({comparison.speedup:.2f}x)"
    return _wrap(f"{ratio} {comparison.verdict_short or comparison.verdict}", 45)


def throughput_figure(report: Report) -> Figure:
    entries = _entries(report)
    labels = [_wrap(label, 45) for _g, _v, label in entries]
    texts = [_bar_text(g, v) for g, v, _label in entries]
    lines = sum(max(a.count("\n"), b.count("\n")) + 1 for a, b in zip(labels, texts, strict=True))
    fig = Figure(figsize=(10, 1.4 + 0.22 * max(4, lines) + 0.2 * len(entries)))
    ax = fig.add_subplot()
    values, low, high = [], [], []
    for _group, variant, _label in entries:
        tp = variant.throughput
        values.append(tp.tokens_per_s if tp else 0.0)
        low.append(tp.tokens_per_s - tp.tokens_per_step / tp.p90 if tp else 0.0)  # the slow steps (p90 time)
        high.append(tp.tokens_per_step / tp.p10 - tp.tokens_per_s if tp else 0.0)  # the fast steps (p10 time)
    positions = list(range(len(entries)))
    ax.barh(positions, values, xerr=[low, high], color=[COLORS[i % len(COLORS)] for i in positions], capsize=3,
            alpha=0.85)
    right = max((v + h for v, h in zip(values, high, strict=True)), default=0.0)
    ax.set_xlim(0, (right or 1.0) / BAR_SHARE)
    for i, ((_group, variant, _label), text) in enumerate(zip(entries, texts, strict=True)):
        if text:  # beside the longest bar's reach, inside the axes; a blocked row from the left
            x = 0.01 if not variant.completed else BAR_SHARE + 0.01
            ax.text(x, i, text, transform=ax.get_yaxis_transform(), va="center", fontsize=7,
                    color="black" if variant.completed else "dimgray", clip_on=True)
    ax.set_yticks(positions, labels, fontsize=7)
    ax.set_ylim(len(entries) - 0.5, -0.5)
    ax.set_xlabel("tokens/s (median step; bars: p10-p90 of the step times)")
    ax.set_title("Throughput" + _left_out(len(entries), _variant_count(report)))
    ax.grid(axis="x", alpha=0.3)
    return fig


def plot_throughput(report: Report, path: Path) -> Path:
    return _save(throughput_figure(report), path)


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


def memory_figure(report: Report) -> Figure:
    points, labels, tags, colors, missing = [], [], [], [], []
    for i, (_group, variant, label) in enumerate(_entries(report)):
        tp, memory = variant.throughput, variant.peak_memory()
        if tp is None or memory is None:
            if variant.completed:
                missing.append(label)
            continue
        points.append((1000.0 * tp.median / tp.tokens_per_step * 1000.0, memory / 2**20))
        labels.append(label)
        tags.append(variant.tag)
        colors.append(COLORS[i % len(COLORS)])
    fig = Figure(figsize=(9, 5 + 0.18 * sum(_wrap(x, 100).count("\n") + 1 for x in labels)))
    ax = fig.add_subplot()
    handles = []
    for index, ((x, y), color, tag) in enumerate(zip(points, colors, tags, strict=True)):
        handles.append(ax.scatter([x], [y], color=color, zorder=3, s=36))
        # tags, not names, beside the points: names of neighbouring points overlap
        ax.annotate(tag, (x, y), fontsize=8, xytext=(5, 3 + 8 * (index % 3)), textcoords="offset points",
                    color=color, fontweight="bold", annotation_clip=True)
    ax.margins(x=0.12, y=0.18)  # room for the tags of the points at the edges, inside the axes
    legend_labels = [_wrap(label, 100) for label in labels]
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
    more = _left_out(MAX_PLOTTED, _variant_count(report))
    if missing:
        ax.set_title(_wrap(f"Peak memory vs time (no peak memory: {', '.join(missing)}){more}", 100), fontsize=8)
    else:
        ax.set_title(_wrap(f"Peak memory vs time (lower left is better){more}", 100))
    ax.set_xlabel("step time per 1,000 tokens (ms)")
    ax.set_ylabel("peak memory (MiB)")
    ax.grid(alpha=0.3)
    return fig


def plot_memory_vs_time(report: Report, path: Path) -> Path:
    return _save(memory_figure(report), path)


FIGURES = (losses_figure, throughput_figure, memory_figure)


def write_plots(report: Report, out_dir: Path) -> list[Path]:
    return [_save(draw(report), out_dir / name) for draw, name in zip(FIGURES, PLOT_FILES, strict=True)]
