"""What ``optbench report`` prints and writes: a dict (report.json), text and markdown tables,
CSV, and the files (report.md, report.csv, report.json and the plots) in the output dir."""

from __future__ import annotations

import csv
import io
import json
import shlex
from pathlib import Path
from typing import Any

from optbench.errors import ReportError
from optbench.report.analysis import Group, Report
from optbench.report.energy import CLAIMS_HEADER, PLAN_003, claim_rows, claim_table
from optbench.report.options import FORMATS
from optbench.report.runs import Run, num
from optbench.report.stats import BOOTSTRAP_RESAMPLES, BOOTSTRAP_SEED, CONFIDENCE, MIN_TIMED_STEPS
from optbench.report.tables import (
    Style,
    human_bytes,
    markdown_table,
    phase_header,
    phase_row,
    predicted,
    prediction_line,
    run_row,
    runs_header,
    terminal_width,
    text_table,
    variant_columns,
    variant_header,
    variant_row,
    verdict_advice,
)
from optbench.report.variants import LOSS, Variant

__all__ = ["FORMATS", "REPORT_FILES", "human_bytes", "markdown_table", "render", "text_table", "write_outputs"]

REPORT_FILES = ("report.md", "report.csv", "report.json")


# ------------------------------------------------------------------------------------ dicts
def variant_dict(group: Group, variant: Variant, root: Path) -> dict[str, Any]:
    tp = variant.throughput
    first = variant.completed[0].summary if variant.completed else variant.first.summary
    loss, kind = variant.loss()
    comparison = group.comparisons.get(variant.key)
    peak, peak_source = variant.peak()
    return {
        "label": variant.label,
        "tag": variant.tag,
        "baseline": variant.is_baseline,
        "side": variant.first.side,
        "overrides": variant.first.overrides,
        "config_hash": variant.first.summary.config_hash,
        "status": variant.status,
        "reason": variant.reason,
        "num_runs": len(variant.runs),
        "num_completed": len(variant.completed),
        "runs": [_rel(r, root) for r in variant.runs],
        "params": num(first.model.params),
        "device": first.device,
        "world_size": first.world_size,
        "tokens_per_s": tp.tokens_per_s if tp else None,
        "tokens_per_step": tp.tokens_per_step if tp else None,
        "step_time_s": {"median": tp.median, "p10": tp.p10, "p90": tp.p90} if tp else None,
        "timed_steps": tp.timed_steps if tp else None,
        # of the pooled tokens/s above: tokens_per_s x flops_per_token / (peak_flops x world_size)
        "mfu": variant.mfu(),
        "flops_per_token": variant.flops_per_token(),
        "peak_flops": peak,
        "peak_source": peak_source,
        "memory": {
            "peak_bytes": variant.peak_memory(),
            "peak_source": first.memory.peak_source,
            "estimate_bytes": variant.max_of(lambda s: s.memory.estimate_bytes),
            "peak_rss_bytes": variant.max_of(lambda s: s.memory.peak_rss_bytes),
        },
        "loss": {"final": variant.mean_of(LOSS["final"]), "eval": variant.mean_of(LOSS["eval"]),
                 "compared": loss, "compared_kind": kind, "eval_metrics": first.loss.eval_metrics},
        "vs_baseline": comparison.to_dict() if comparison and not variant.is_baseline else None,
        "predicted": dict(zip(("step_time_s", "error"), predicted(variant), strict=True)),
    }


def _rel(run: Run, root: Path) -> str:
    try:
        return str((run.real or run.dir.resolve()).relative_to(root)) or "."
    except ValueError:
        return str(run.dir)


def report_dict(report: Report) -> dict[str, Any]:
    return {
        "paths": report.paths,
        "method": {
            "speedup": "candidate tokens/s / baseline tokens/s (median step times; time per token when "
                       "tokens per step differ)",
            "confidence": CONFIDENCE, "bootstrap_resamples": BOOTSTRAP_RESAMPLES, "seed": BOOTSTRAP_SEED,
            "min_timed_steps": MIN_TIMED_STEPS,
        },
        "groups": [
            {
                "label": g.label, "model": g.name, "task": g.task, "params": g.params(), "schedule": g.schedule,
                "baseline": g.baseline.label if g.baseline else None, "baseline_note": g.baseline_note,
                "apart": g.apart, "gates_judge": g.judged_note,
                "variants": [variant_dict(g, v, report.root) for v in g.variants],
                "phases": [row.to_dict() for row in g.phases],
                **({"plan_003_claims": claim_rows(g)} if claim_rows(g) else {}),
            }
            for g in report.groups
        ],
        "gates": [r.to_dict() for r in report.gate_results],
        "exit_code": report.exit_code,
    }


FORECAST_TITLE = ("Forecast scores (eval split; wRMSE: cos(latitude)-weighted RMSE in the channel's units; ACC: "
                  "anomaly correlation vs the training climatology; persistence and climatology on the same samples)")
FORECAST_METRICS = ("wrmse", "wrmse_persistence", "wrmse_climatology", "acc", "acc_persistence")


def forecast_header() -> list[str]:
    return ["variant", "lead", "channel", "wRMSE", "persistence", "climatology", "ACC", "ACC persistence"]


def forecast_rows(group: Group) -> list[list[str]]:
    """Per variant, lead and channel the climate task's scores (``wrmse/<lead>/<channel>`` ...),
    averaged over the variant's completed runs; none for runs without them."""
    rows = []
    for variant in group.variants:
        runs = [r.summary.loss.eval_metrics or {} for r in variant.completed]
        keys = [k.split("/", 2)[1:] for k in (runs[0] if runs else {}) if k.startswith("wrmse/")]
        for lead, channel in keys:
            cells = []
            for metric in FORECAST_METRICS:
                values = [m.get(f"{metric}/{lead}/{channel}") for m in runs]
                values = [v for v in values if isinstance(v, (int, float))]
                cells.append("-" if not values else f"{sum(values) / len(values):.4g}")
            rows.append([variant.label, lead, channel, *cells])
    return rows


FUSION_HEADER = ["variant", "params", "trainable", "loss true climate", "loss shuffled climate", "loss base alone",
                 "gap (shuffled - true) ± s.e."]


def _fusion_table(group: Group) -> list[tuple[str, list[str], list[list[str]]]]:
    """task=climate_text: the eval loss with the true, the shuffled and no climate, per variant."""
    rows = []
    for v in group.variants:
        m = v.first.summary.loss.eval_metrics or {}
        if "fusion/loss_gap" not in m:
            continue
        model = v.first.summary.model
        trainable = model.trainable_params
        rows.append([v.label, f"{model.params or 0:,}", "-" if trainable is None else f"{trainable:,}",
                     f"{m['fusion/loss_true']:.4f}", f"{m['fusion/loss_shuffled']:.4f}", f"{m['fusion/loss_base']:.4f}",
                     f"{m['fusion/loss_gap']:+.4f} ± {m['fusion/loss_gap_stderr']:.4f}"])
    return [("Climate-text fusion (eval loss, first run)", FUSION_HEADER, rows)] if rows else []


def _group_tables(group: Group, style: Style, root: Path) -> list[tuple[str, list[str], list[list[str]]]]:
    with_runs = any(len(v.runs) > 1 for v in group.variants)
    columns = variant_columns(group)
    tables = [("", variant_header(group, with_runs=with_runs),
               [variant_row(group, v, style, with_runs=with_runs, columns=columns) for v in group.variants])]
    forecast = forecast_rows(group)
    if forecast:
        tables.append((FORECAST_TITLE, forecast_header(), forecast))
    if group.phases:
        tables.append(("Phases (cumulative, the plan's table)", phase_header(),
                       [phase_row(r, style) for r in group.phases]))
    if claim_table(group):  # task=energy_flow's phases: plan 003's claims beside the measured factors
        tables.append((f"{PLAN_003}: the claims beside what was measured", CLAIMS_HEADER, claim_table(group)))
    if with_runs:
        rows = [run_row(r, v, _rel(r, root), style) for v in group.variants for r in v.runs]
        tables.append(("Runs", runs_header(), rows))
    tables += _fusion_table(group)
    return tables


def _group_title(group: Group) -> str:
    params = group.params()
    devices = sorted({str(r.summary.device) for r in group.runs if r.summary.device})
    parts = [group.label + (f", {params:,} params" if params and "params" not in group.label else "")]
    if len(devices) == 1:
        parts.append(devices[0])
    parts.append(group.baseline_note or "")
    return " | ".join(p for p in parts if p)


def _method_line() -> str:
    return (f"speedup = tokens/s ratio vs the baseline; [95% CI] from {BOOTSTRAP_RESAMPLES} seeded block-bootstrap "
            f"resamples of the per-step times (runs, then blocks of steps, when repeated); verdict 'faster' or "
            f"'slower' only when the interval excludes 1; a ratio in parentheses gets no verdict (the note says "
            f"why). With one run per variant the interval covers the noise within runs only: optbench compare "
            f"--repeats adds the noise between runs. vs previous: against the last phase above that ran. "
            f"MFU = tokens/s x FLOPs per token / the peak its note names. loss delta = candidate - baseline "
            f"(eval loss when both have one).")


def _shell_lines(command: str, width: int) -> str:
    """A command to copy, indented, in lines of at most ``width`` continued with a backslash (never
    broken inside an argument, unless one argument is wider than that)."""
    lines: list[str] = []
    for word in (shlex.quote(w) for w in shlex.split(command)):
        if lines and len(lines[-1]) + 1 + len(word) + 2 <= width:
            lines[-1] += " " + word
        else:
            lines.append(("    " if not lines else "      ") + word)
    return " \\\n".join(lines)


def render(report: Report, fmt: str, *, width: int | None = None) -> str:
    """The report as json, csv, markdown (report.md) or the console table (``width`` columns, the
    terminal's by default)."""
    if fmt == "json":
        return json.dumps(report_dict(report), indent=2)
    if fmt == "csv":
        return render_csv(report)
    style = Style(markdown=fmt == "markdown", width=width or terminal_width())
    out: list[str] = [style.heading(1, "optbench report"), ""]
    out.append(style.wrap("Reviewed: " + ", ".join(f"`{p}`" if style.markdown else p for p in report.paths)))
    out.append("")
    for group in report.groups:
        out += [style.heading(2, _group_title(group)), ""]
        out += [style.wrap(note) + "\n" for note in (group.apart, group.judged_note) if note]
        for title, header, rows in _group_tables(group, style, report.root):
            if title:
                out += [style.heading(3, title), ""]
            out += [style.table(header, rows), ""]
        advice = verdict_advice(group)
        if advice:
            text, command = advice
            out += [style.wrap(text), "", f"`{command}`" if style.markdown else _shell_lines(command, style.width), ""]
    line = prediction_line(report.groups)
    if line:
        out += [style.wrap(line), ""]
    if report.gate_results:
        out += [style.heading(2, "Gates"), ""]
        out += [style.wrap(("ok      " if r.ok else "FAILED  ") + r.message, "- " if style.markdown else "  ")
                for r in report.gate_results]
        out.append("")
    out.append(style.wrap(("_" + _method_line() + "_") if style.markdown else _method_line()))
    if style.notes.items:
        out += ["", "Notes:" if not style.markdown else "**Notes**", ""]
        out += [style.wrap(f"[{i}] {note}", "- " if style.markdown else "") for i, note in
                enumerate(style.notes.items, start=1)]
    if report.notes:  # what the reader skipped or could not read
        out += ["", "Read with care:"] + [style.wrap(n, "- " if style.markdown else "  ") for n in report.notes]
    return "\n".join(out).rstrip() + "\n"


CSV_COLUMNS = (
    "group", "variant", "baseline", "status", "reason", "num_runs", "num_completed", "params", "device",
    "world_size", "tokens_per_s", "step_time_median_s", "step_time_p10_s", "step_time_p90_s", "timed_steps",
    "mfu", "peak_flops", "peak_bytes", "estimate_bytes", "peak_rss_bytes", "loss_final", "loss_eval",
    "speedup", "speedup_ci_low", "speedup_ci_high", "verdict", "loss_delta", "loss_kind", "memory_ratio",
    "phase", "speedup_vs_previous", "previous_phase", "verdict_vs_previous", "overrides",
)


def csv_rows(report: Report) -> list[dict[str, Any]]:
    rows = []
    for group in report.groups:
        phases = {row.variant.key: row for row in group.phases}
        for variant in group.variants:
            d = variant_dict(group, variant, report.root)
            vs = d["vs_baseline"] or {}
            st = d["step_time_s"] or {}
            prow = phases.get(variant.key)
            prev = prow.vs_previous if prow else None
            rows.append({
                "group": group.label, "variant": d["label"], "baseline": d["baseline"], "status": d["status"],
                "reason": d["reason"], "num_runs": d["num_runs"], "num_completed": d["num_completed"],
                "params": d["params"], "device": d["device"], "world_size": d["world_size"],
                "tokens_per_s": d["tokens_per_s"], "step_time_median_s": st.get("median"),
                "step_time_p10_s": st.get("p10"), "step_time_p90_s": st.get("p90"),
                "timed_steps": d["timed_steps"], "mfu": d["mfu"], "peak_flops": d["peak_flops"],
                "peak_bytes": d["memory"]["peak_bytes"], "estimate_bytes": d["memory"]["estimate_bytes"],
                "peak_rss_bytes": d["memory"]["peak_rss_bytes"], "loss_final": d["loss"]["final"],
                "loss_eval": d["loss"]["eval"], "speedup": vs.get("speedup"), "speedup_ci_low": vs.get("ci_low"),
                "speedup_ci_high": vs.get("ci_high"), "verdict": vs.get("verdict"),
                "loss_delta": vs.get("loss_delta"), "loss_kind": vs.get("loss_kind"),
                "memory_ratio": vs.get("memory_ratio"), "phase": prow.phase if prow else None,
                "speedup_vs_previous": prev.speedup if prev else None,
                "previous_phase": prow.previous if prow else None,
                "verdict_vs_previous": prev.verdict if prev else None,
                "overrides": " ".join(d["overrides"]),
            })
    return rows


def render_csv(report: Report) -> str:
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=CSV_COLUMNS, lineterminator="\n")
    writer.writeheader()
    for row in csv_rows(report):
        writer.writerow({k: "" if v is None else v for k, v in row.items()})
    return buffer.getvalue()


def write_outputs(report: Report, out_dir: Path, *, plots: bool = True) -> list[Path]:
    """report.md, report.csv, report.json and the PNG plots into ``out_dir``, all or none
    (``optbench.files.files_together``: a full disk leaves the earlier report whole)."""
    from optbench.files import files_together

    try:
        with files_together(out_dir, "report") as partial:
            for name, fmt in zip(REPORT_FILES, ("markdown", "csv", "json"), strict=True):
                text = render(report, fmt)
                if name == "report.md" and plots:
                    from optbench.report.plots import PLOT_FILES

                    text += "\n" + "\n".join(f"![{n}]({n})" for n in PLOT_FILES) + "\n"
                (partial / name).write_text(text if text.endswith("\n") else text + "\n")
            written = list(REPORT_FILES)
            if plots:
                from optbench.report.plots import write_plots

                written += [path.name for path in write_plots(report, partial)]
    except OSError as exc:
        raise ReportError(f"cannot write the report into {out_dir}: {exc.strerror}; choose another --out") from None
    return [out_dir / name for name in written]
