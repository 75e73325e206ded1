"""``optbench validate``'s report: markdown, CSV, JSON and the phase plot, from the result dict
``optbench.validate.api.assemble`` builds."""

from __future__ import annotations

import csv
import io
from pathlib import Path
from typing import Any

from optbench.errors import ReportError
from optbench.report.tables import Style
from optbench.validate.claims import PLAN_HEADLINE, PROJECTED_WORLD_SIZES, claim_text


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 1:
        return f"{seconds * 1000:.3g} ms"
    if seconds < 120:
        return f"{seconds:.1f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


def _bytes(n: float | None) -> str:
    from optbench.report.format import human_bytes

    return human_bytes(n)


def _speedup(c: dict[str, Any] | None, style: Style) -> str:
    """A speedup, its interval and verdict; a ratio the analysis gives no verdict on in parentheses,
    its reason a note."""
    if not c or c.get("speedup") is None:
        return "-"
    verdict = style.with_note(c.get("verdict_short") or c["verdict"], c.get("verdict_note"))
    if not c.get("judged", True):
        return f"({c['speedup']:.2f}x) {verdict}"
    if c.get("ci_low") is None:
        return f"{c['speedup']:.2f}x ({verdict})"
    return f"{c['speedup']:.2f}x [{c['ci_low']:.2f}-{c['ci_high']:.2f}] {verdict}"


def _epoch(e: dict[str, Any] | None) -> str:
    if not e:
        return "-"
    if e.get("ci_low") is None:
        return _duration(e["seconds"])
    return f"{_duration(e['seconds'])} [{_duration(e['ci_low'])}-{_duration(e['ci_high'])}]"


def _head(result: dict[str, Any], style: Style) -> list[str]:
    base, cand = result["baseline"], result["candidate"]
    machine = result["machine"]
    versions = machine.get("versions") or {}
    item = "- " if style.markdown else "  "
    lines = [
        f"command: `{result['command']}`" if result["command"] else "",
        f"machine: {machine.get('device')}, world size {machine.get('world_size')}; torch {versions.get('torch')}"
        + (f", CUDA {versions['cuda']}" if versions.get("cuda") else ""),
        f"model {result['model']} ({result['params']:,} params), task {result['task']}"
        if result.get("params") else f"model {result['model']}, task {result['task']}",
        f"baseline: `{' '.join(base['overrides'])}`",
        f"candidate: `{' '.join(cand['overrides'])}`",
    ]
    out = [style.heading(1, f"Phase 9 validation: {result['verdict']}"), ""]
    out += [style.wrap(line, item) for line in lines if line]
    if result["verdict"] != "VALIDATED":
        title = "Not judged here:" if result["verdict"] == "NOT JUDGED HERE" else "Not validated:"
        out += ["", title] + [style.wrap(why, item) for why in result["why_not"]]
    return out


def render(result: dict[str, Any], style: Style) -> str:
    """The validation for a person: validate.md (``style`` markdown) or the console (its width)."""
    base, cand = result["baseline"], result["candidate"]
    lines = _head(result, style)
    judged = result["verdict"] != "NOT JUDGED HERE"
    lines += ["", style.heading(2, "Gates (the plan's phase 9)" + ("" if judged else ": measured, not judged")), ""]
    lines.append(style.table(["gate", "threshold", "value", "result", "detail"], [
        [g["gate"], f"{g['threshold']:g}", "-" if g["value"] is None else f"{g['value']:.4g}",
         ("pass" if g["ok"] else "FAIL") if judged else ("holds" if g["ok"] else "would fail"), g["message"]]
        for g in result["gates"]]))
    lines += ["", style.heading(2, "Baseline vs candidate"), "", _sides_table(result, style)]
    proj = cand["projection"][0] if cand["projection"] else base["projection"][0] if base["projection"] else None
    if proj:
        lines += ["", style.wrap(f"Projection: `optbench estimate`'s throughput model — tokens/s per GPU = MFU x "
                                 f"{proj['gpu'].upper()} dense datasheet peak for the dtype / FLOPs per token, linear "
                                 f"in the number of GPUs, no communication modeled; MFU {proj['mfu_source']}. It is "
                                 "not a measurement.")]
    elif base.get("projection_note") or cand.get("projection_note"):
        lines += ["", style.wrap("Projection to the plan's GPUs: " + (cand.get("projection_note") or
                                                                       base["projection_note"]))]
    lines += ["", style.heading(2, "Phases beside the plan's claims"), "",
              style.wrap(f"The plan claims {PLAN_HEADLINE}; its per-phase claims multiply to "
                         f"{claim_text(result['plan_claims_multiply_to'])}. A claim \"X% faster\" is read as a speedup "
                         "of 1+X."), ""]
    lines.append(style.table(
        ["phase", "here", "plan: vs previous phase", "measured vs previous run [95% CI]", "plan over that span",
         "measured vs baseline [95% CI]", "plan vs baseline", "tokens/s", "peak memory"],
        [[r["phase"], _here(r["here"], style), r["claim_vs_previous"] or "-",
          (f"{_speedup(r['vs_previous'], style)} (vs {r['previous']})" if r["vs_previous"] else "-"),
          claim_text(r["claim_span"]), _speedup(r["vs_baseline"], style), claim_text(r["claim_vs_baseline"]),
          _num(r["tokens_per_s"]), _bytes(r["peak_bytes"]) if r["peak_bytes"] else "-"] for r in result["phases"]]))
    lines += _tail(result, style)
    return "\n".join(lines)


def _here(here: str | None, style: Style) -> str:
    """What happened to a phase here: on the console a blocked phase's reasons are under Skipped."""
    if here and here.startswith("blocked: ") and not style.markdown:
        return "blocked (see Skipped)"
    return here or "-"


def _tail(result: dict[str, Any], style: Style) -> list[str]:
    item = "- " if style.markdown else "  "
    lines = []
    if result["skipped"]:
        lines += ["", style.heading(2, "Skipped: cannot run on this machine (compatibility check)"), ""]
        lines += [style.wrap(f"{s['phase']}: {'; '.join(s['reasons'])}", item) for s in result["skipped"]]
    if result["notes"]:
        lines += ["", style.heading(2, "Notes"), ""] + [style.wrap(note, item) for note in result["notes"]]
    if style.notes.items:
        lines += [""] + [style.wrap(f"[{i}] {note}", item) for i, note in enumerate(style.notes.items, start=1)]
    lines += ["", style.wrap("Statistics, per-run tables and plots: [report.md](report.md). Cumulative speedup per "
                             "phase beside the plan's: ![validate_phases.png](validate_phases.png)"), ""]
    return lines


def render_markdown(result: dict[str, Any]) -> str:
    return render(result, Style(markdown=True))


def render_text(result: dict[str, Any], *, width: int) -> str:
    return render(result, Style(markdown=False, width=width))


def _sides_table(result: dict[str, Any], style: Style) -> str:
    """Baseline and candidate side by side, the projections last and labelled as such."""
    base, cand = result["baseline"], result["candidate"]
    header = ["", "baseline", "candidate"]
    rows = [
        ["runs completed", f"{base['completed']}/{base['runs']}", f"{cand['completed']}/{cand['runs']}"],
        ["tokens/s", _num(base["tokens_per_s"]), _num(cand["tokens_per_s"])],
        ["step time median [p10-p90]", _step(base), _step(cand)],
        [f"epoch time [95% CI] ({_count(result['samples_per_epoch'])} samples)", _epoch(base["epoch"]),
         _epoch(cand["epoch"])],
        ["MFU (of the tokens/s above)", _mfu(base, style), _mfu(cand, style)],
        ["peak memory", _bytes(base["peak_bytes"]), _bytes(cand["peak_bytes"])],
        ["loss", _loss(base["loss"]), _loss(cand["loss"])],
        ["speedup [95% CI]", "1.00x", _speedup(result["comparison"], style)],
    ]
    for index, world in enumerate(PROJECTED_WORLD_SIZES):
        b = base["projection"][index] if len(base["projection"]) > index else None
        c = cand["projection"][index] if len(cand["projection"]) > index else None
        if b or c:
            label = f"PROJECTION, not measured: epoch on {world}x {(b or c or {}).get('gpu', '?').upper()}"
            rows.append([label, _proj(b), _proj(c)])
    return style.table(header, rows)


def _mfu(side: dict[str, Any], style: Style) -> str:
    if side["mfu"] is None:
        return "-"
    world = side.get("world_size") or 1
    per = f" per rank x {world} ranks" if world > 1 else ""
    return style.with_note(f"{side['mfu']:.1%}", f"MFU against {side['peak_flops'] / 1e9:,.0f} GFLOP/s{per}: "
                                                 f"{side['peak_source']}")


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:,.0f}"


def _count(value: int | None) -> str:
    return "?" if value is None else f"{value:,}"


def _step(side: dict[str, Any]) -> str:
    s = side["step_time_s"]
    return "-" if not s else f"{s['median']:.4f} s [{s['p10']:.4f}-{s['p90']:.4f}]"


def _loss(loss: dict[str, Any]) -> str:
    return "-" if loss["value"] is None else f"{loss['value']:.5f} ({loss['kind']})"


def _proj(p: dict[str, Any] | None) -> str:
    if not p:
        return "-"
    return f"{_duration(p['epoch_s'])} ({_num(p['tokens_per_s'])} tokens/s at {p['mfu']:.0%} MFU)"


CSV_FIELDS = ("phase", "here", "claim_vs_previous", "previous", "speedup_vs_previous", "ci_low_vs_previous",
              "ci_high_vs_previous", "claim_span_low", "claim_span_high", "speedup_vs_baseline", "ci_low_vs_baseline",
              "ci_high_vs_baseline", "claim_vs_baseline_low", "claim_vs_baseline_high", "tokens_per_s", "peak_bytes")


def render_csv(result: dict[str, Any]) -> str:
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=CSV_FIELDS)
    writer.writeheader()
    for r in result["phases"]:
        prev, base = r["vs_previous"] or {}, r["vs_baseline"] or {}
        span, total = r["claim_span"] or (None, None), r["claim_vs_baseline"] or (None, None)
        row = {"phase": r["phase"], "here": r["here"], "claim_vs_previous": r["claim_vs_previous"],
               "previous": r["previous"], "speedup_vs_previous": prev.get("speedup"),
               "ci_low_vs_previous": prev.get("ci_low"), "ci_high_vs_previous": prev.get("ci_high"),
               "claim_span_low": span[0], "claim_span_high": span[1], "speedup_vs_baseline": base.get("speedup"),
               "ci_low_vs_baseline": base.get("ci_low"), "ci_high_vs_baseline": base.get("ci_high"),
               "claim_vs_baseline_low": total[0], "claim_vs_baseline_high": total[1],
               "tokens_per_s": r["tokens_per_s"], "peak_bytes": r["peak_bytes"]}
        writer.writerow({k: "" if v is None else v for k, v in row.items()})
    return buffer.getvalue()


def plot_phases(result: dict[str, Any], path: Path) -> Path:
    """Measured cumulative speedup of each phase that ran (with its 95% interval) beside the plan's
    claimed range over the same baseline, and the speedup gate."""
    from matplotlib.figure import Figure

    from optbench.report.plots import _empty, _legend_below, _save

    rows = [r for r in result["phases"] if r["vs_baseline"] and r["vs_baseline"].get("speedup") is not None]
    fig = Figure(figsize=(8, 4.5))
    ax = fig.add_subplot()
    if not rows:
        _empty(ax, "no phase after the baseline completed")
        return _save(fig, path)
    xs = range(len(rows))
    seen: set[str] = set()

    def once(label: str) -> str | None:  # each kind of mark in the legend once, whichever row has it first
        return None if label in seen or seen.add(label) else label

    for x, r in zip(xs, rows, strict=True):
        c = r["vs_baseline"]
        if not c.get("judged", True):  # a ratio the drift guard withholds: drawn hollow, named so
            ax.plot([x], [c["speedup"]], "o", markerfacecolor="none", color="tab:blue",
                    label=once("measured, no verdict (the machine's speed moved)"))
        elif c.get("ci_low") is not None:
            ax.errorbar([x], [c["speedup"]], yerr=[[c["speedup"] - c["ci_low"]], [c["ci_high"] - c["speedup"]]],
                        fmt="o", color="tab:blue", capsize=4, label=once("measured (95% CI)"))
        else:
            ax.plot([x], [c["speedup"]], "o", color="tab:blue", label=once("measured (no interval)"))
        if r["claim_vs_baseline"]:
            low, high = r["claim_vs_baseline"]
            ax.bar([x], [high - low], bottom=[low], width=0.4, color="tab:orange", alpha=0.35,
                   label=once("the plan's claim"))
    gate = next((g["threshold"] for g in result["gates"] if g["gate"] == "min-speedup"), None)
    if gate is not None:
        ax.axhline(gate, color="tab:red", linestyle="--", linewidth=1, label=f"gate {gate:g}x")
    ax.axhline(1.0, color="gray", linewidth=0.8)
    ax.set_xticks(list(xs), [r["phase"] for r in rows], rotation=20, ha="right")
    ax.set_xlim(-0.7, len(rows) - 0.3)
    ax.set_ylabel("speedup vs the baseline (tokens/s ratio)")
    ax.set_title(f"cumulative speedup: {result['machine'].get('device')}", fontsize=9)
    _legend_below(ax)
    return _save(fig, path)


VALIDATE_FILES = ("validate.md", "validate.csv", "validate.json", "validate_phases.png")


def write_validation(result: dict[str, Any], out: Path, *, plots: bool) -> list[Path]:
    """validate.md/.csv/.json (and the plot) into ``out``, all or none (``optbench.files.files_together``:
    a full disk leaves an earlier validation whole)."""
    from optbench.files import files_together
    from optbench.outputs import write_json_atomic

    try:
        with files_together(out, "validate") as partial:
            (partial / "validate.md").write_text(render_markdown(result))
            (partial / "validate.csv").write_text(render_csv(result))
            write_json_atomic(partial / "validate.json", result)
            written = list(VALIDATE_FILES[:3])
            if plots:
                written.append(plot_phases(result, partial / "validate_phases.png").name)
    except OSError as exc:
        raise ReportError(f"cannot write the validation into {out}: {exc.strerror}; choose another --out") from None
    return [out / name for name in written]


# ---------------------------------------------------------------------------------------- main
