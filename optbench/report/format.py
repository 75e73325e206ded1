"""What ``optbench report`` prints and writes: a dict (report.json), text and markdown tables,
CSV, and the files (report.md, report.csv, report.json and the plots) in the output dir."""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path
from typing import Any

from optbench import outputs
from optbench.errors import ReportError
from optbench.report.analysis import Comparison, Group, PhaseRow, Report
from optbench.report.runs import Run, dig, num
from optbench.report.stats import BOOTSTRAP_RESAMPLES, BOOTSTRAP_SEED, CONFIDENCE, MIN_TIMED_STEPS
from optbench.report.variants import Variant

FORMATS = ("table", "markdown", "csv", "json")
REPORT_FILES = ("report.md", "report.csv", "report.json")


# ------------------------------------------------------------------------------------ dicts
def variant_dict(group: Group, variant: Variant, root: Path) -> dict[str, Any]:
    tp = variant.throughput
    first = variant.completed[0].summary if variant.completed else variant.first.summary
    loss, kind = variant.loss()
    comparison = group.comparisons.get(variant.key)
    return {
        "label": variant.label,
        "baseline": variant.is_baseline,
        "side": variant.first.side,
        "overrides": variant.first.overrides,
        "config_hash": variant.first.summary.get("config_hash"),
        "status": variant.status,
        "reason": variant.reason,
        "num_runs": len(variant.runs),
        "num_completed": len(variant.completed),
        "runs": [_rel(r.dir, root) for r in variant.runs],
        "params": num(dig(first, "model.params")),
        "device": first.get("device"),
        "world_size": first.get("world_size"),
        "tokens_per_s": tp.tokens_per_s if tp else None,
        "tokens_per_step": tp.tokens_per_step if tp else None,
        "step_time_s": {"median": tp.median, "p10": tp.p10, "p90": tp.p90} if tp else None,
        "timed_steps": tp.timed_steps if tp else None,
        "mfu": variant.median_of("throughput.mfu"),
        "peak_flops": num(dig(first, "throughput.peak_flops")),
        "peak_source": dig(first, "throughput.peak_source"),
        "memory": {
            "peak_bytes": variant.peak_memory(),
            "peak_source": dig(first, "memory.peak_source"),
            "estimate_bytes": variant.max_of("memory.estimate_bytes"),
            "peak_rss_bytes": variant.max_of("memory.peak_rss_bytes"),
        },
        "loss": {"final": variant.mean_of("loss.final"), "eval": variant.mean_of("loss.eval"),
                 "compared": loss, "compared_kind": kind, "eval_metrics": dig(first, "loss.eval_metrics")},
        "vs_baseline": comparison.to_dict() if comparison and not variant.is_baseline else None,
        "predicted": dict(zip(("step_time_s", "error"), predicted(variant), strict=True)),
    }


def predicted(variant: Variant) -> tuple[float | None, float | None]:
    """The step time ``optbench train`` predicted before the loop (summary.json ``predicted``, the
    median over runs), and its error against the measured median: predicted / measured - 1."""
    value = variant.median_of("predicted.step_time_s")
    tp = variant.throughput
    return value, None if value is None or tp is None else value / tp.median - 1


def prediction_line(report: Report) -> str | None:
    """The prediction's error over every variant of the report that recorded one."""
    errors = [(abs(e), e, v.label) for g in report.groups for v in g.variants
              for e in [predicted(v)[1]] if e is not None]
    if not errors:
        return None
    errors.sort()
    worst = errors[-1]
    return (f"predicted step time vs measured median over {len(errors)} variant(s): median |error| "
            f"{errors[len(errors) // 2][0]:.1%}, worst {worst[1]:+.1%} ({worst[2]})")


def _rel(path: Path, root: Path) -> str:
    try:
        return str(path.resolve().relative_to(root)) or "."
    except ValueError:
        return str(path)


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
                "label": g.label, "model": g.name, "task": g.task, "params": g.params(),
                "baseline": g.baseline.label if g.baseline else None, "baseline_note": g.baseline_note,
                "variants": [variant_dict(g, v, report.root) for v in g.variants],
                "phases": [row.to_dict() for row in g.phases],
            }
            for g in report.groups
        ],
        "gates": [r.to_dict() for r in report.gate_results],
        "exit_code": report.exit_code,
    }


# ---------------------------------------------------------------------------------- rendering
def human_bytes(n: float | None) -> str:
    return outputs.human_bytes(n, missing="-")


def fmt_speedup(c: Comparison | None) -> str:
    return "-" if c is None else c.speedup_text()


def _f(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _peak_note(source: str | None, notes: list[str]) -> str:
    """" [n]": the footnote that names the peak behind an MFU figure."""
    if not source:
        return ""
    if source not in notes:
        notes.append(source)
    return f" [{notes.index(source) + 1}]"


def variant_row(group: Group, variant: Variant, notes: list[str], *, with_runs: bool) -> list[str]:
    tp = variant.throughput
    first = variant.completed[0].summary if variant.completed else variant.first.summary
    mfu = variant.median_of("throughput.mfu")
    peak = num(dig(first, "throughput.peak_flops"))
    mfu_text = "-" if mfu is None else (
        f"{mfu:.1%} of {peak / 1e9:,.0f} GFLOP/s" if peak else f"{mfu:.1%}"
    ) + _peak_note(dig(first, "throughput.peak_source"), notes)
    estimate = variant.max_of("memory.estimate_bytes")
    memory = human_bytes(variant.peak_memory()) + (f" (est {human_bytes(estimate)})" if estimate else "")
    comparison = None if variant.is_baseline else group.comparisons.get(variant.key)
    row = [variant.label, variant.status]
    if with_runs:
        row.append(f"{len(variant.completed)}/{len(variant.runs)}")
    if not variant.completed:
        return row + ["-"] * 11 + [variant.reason or ""]
    value, error = predicted(variant)
    row += [
        _f(tp.tokens_per_s if tp else None, ",.0f"),
        f"{tp.median:.4f} [{tp.p10:.4f}-{tp.p90:.4f}]" if tp else "-",
        "-" if value is None else f"{value:.4f}" + ("" if error is None else f" ({error:+.0%})"),
        mfu_text,
        memory,
        _f(variant.mean_of("loss.final"), ".4f"),
        _f(variant.mean_of("loss.eval"), ".4f"),
        "baseline" if variant.is_baseline else fmt_speedup(comparison),
        "" if variant.is_baseline or comparison is None else comparison.verdict,
        "" if comparison is None else _f(comparison.loss_delta, "+.5f"),
        "" if comparison is None else (_f(comparison.memory_ratio, ".2f") + "x" if comparison.memory_ratio else "-"),
        variant.reason or "",
    ]
    return row


def variant_header(*, with_runs: bool) -> list[str]:
    head = ["variant", "status"] + (["runs"] if with_runs else [])
    return head + ["tokens/s", "step time s median [p10-p90]", "predicted s (error)", "MFU", "peak memory", "final loss",
                   "eval loss", "speedup [95% CI]", "verdict", "loss delta", "memory ratio", "note"]


def phase_header() -> list[str]:
    return ["phase", "status", "tokens/s", "speedup vs baseline", "vs previous phase", "verdict vs previous",
            "peak memory", "memory vs baseline", "loss delta", "note"]


def phase_row(row: PhaseRow) -> list[str]:
    variant = row.variant
    if not variant.completed:
        return [row.phase, variant.status] + ["-"] * 7 + [variant.reason or ""]
    base, prev = row.vs_baseline, row.vs_previous
    prev_text = "-" if prev is None else f"{fmt_speedup(prev)} vs {row.previous}"
    return [
        row.phase, variant.status,
        _f(variant.throughput.tokens_per_s if variant.throughput else None, ",.0f"),
        "1.00x (baseline)" if variant.is_baseline else fmt_speedup(base),
        prev_text,
        "" if prev is None else prev.verdict,
        human_bytes(variant.peak_memory()),
        "-" if base is None or base.memory_ratio is None else f"{base.memory_ratio:.2f}x",
        "-" if base is None or variant.is_baseline else _f(base.loss_delta, "+.5f"),
        variant.reason or "",
    ]


def runs_header() -> list[str]:
    return ["run", "variant", "status", "tokens/s", "step time s median", "final loss", "note"]


def run_row(run: Run, variant: Variant, root: Path) -> list[str]:
    s = run.summary
    return [_rel(run.dir, root), variant.label, run.status, _f(num(dig(s, "throughput.tokens_per_s")), ",.0f"),
            _f(num(dig(s, "throughput.step_time_s.median")), ".4f"), _f(num(dig(s, "loss.final")), ".4f"),
            "" if run.completed else (run.error or "")]


def _drop_empty(header: list[str], rows: list[list[str]]) -> tuple[list[str], list[list[str]]]:
    keep = [i for i, name in enumerate(header) if name != "note" or any(r[i] for r in rows)]
    return [header[i] for i in keep], [[r[i] for i in keep] for r in rows]


def text_table(header: list[str], rows: list[list[str]]) -> str:
    header, rows = _drop_empty(header, rows)
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows, strict=True)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(header, widths, strict=True)).rstrip()]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    return "\n".join(lines)


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    header, rows = _drop_empty(header, rows)

    def cell(text: str) -> str:
        return text.replace("|", "\\|")

    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


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
        runs = [dig(r.summary, "loss.eval_metrics") or {} for r in variant.completed]
        keys = [k.split("/", 2)[1:] for k in (runs[0] if runs else {}) if k.startswith("wrmse/")]
        for lead, channel in keys:
            cells = []
            for metric in FORECAST_METRICS:
                values = [m.get(f"{metric}/{lead}/{channel}") for m in runs]
                values = [v for v in values if isinstance(v, (int, float))]
                cells.append("-" if not values else f"{sum(values) / len(values):.4g}")
            rows.append([variant.label, lead, channel, *cells])
    return rows


def _group_tables(group: Group, notes: list[str], root: Path) -> list[tuple[str, list[str], list[list[str]]]]:
    with_runs = any(len(v.runs) > 1 for v in group.variants)
    tables = [("", variant_header(with_runs=with_runs),
               [variant_row(group, v, notes, with_runs=with_runs) for v in group.variants])]
    forecast = forecast_rows(group)
    if forecast:
        tables.append((FORECAST_TITLE, forecast_header(), forecast))
    if group.phases:
        tables.append(("Phases (cumulative, the plan's table)", phase_header(), [phase_row(r) for r in group.phases]))
    if with_runs:
        rows = [run_row(r, v, root) for v in group.variants for r in v.runs]
        tables.append(("Runs", runs_header(), rows))
    tables += _fusion_table(group)
    return tables


FUSION_HEADER = ["variant", "params", "trainable", "loss true climate", "loss shuffled climate", "loss base alone",
                 "gap (shuffled - true) ± s.e."]


def _fusion_table(group: Group) -> list[tuple[str, list[str], list[list[str]]]]:
    """task=climate_text: the eval loss with the true, the shuffled and no climate, per variant."""
    rows = []
    for v in group.variants:
        m = dig(v.first.summary, "loss.eval_metrics") or {}
        if "fusion/loss_gap" not in m:
            continue
        model = v.first.summary.get("model") or {}
        trainable = model.get("trainable_params")
        rows.append([v.label, f"{model.get('params') or 0:,}", "-" if trainable is None else f"{trainable:,}",
                     f"{m['fusion/loss_true']:.4f}", f"{m['fusion/loss_shuffled']:.4f}", f"{m['fusion/loss_base']:.4f}",
                     f"{m['fusion/loss_gap']:+.4f} ± {m['fusion/loss_gap_stderr']:.4f}"])
    return [("Climate-text fusion (eval loss, first run)", FUSION_HEADER, rows)] if rows else []


def _group_title(group: Group) -> str:
    params = group.params()
    devices = sorted({str(r.summary.get("device")) for r in group.runs if r.summary.get("device")})
    parts = [group.label + (f", {params:,} params" if params and "params" not in group.label else "")]
    if len(devices) == 1:
        parts.append(devices[0])
    parts.append(group.baseline_note or "")
    return " | ".join(p for p in parts if p)


def _method_line() -> str:
    return (f"speedup = tokens/s ratio vs the baseline; [95% CI] from {BOOTSTRAP_RESAMPLES} seeded block-bootstrap "
            f"resamples of the per-step times (runs, then blocks of steps, when repeated); verdict 'faster' or "
            f"'slower' only when the interval excludes 1. With one run per variant the interval covers the noise "
            f"within runs only: optbench compare --repeats adds the noise between runs. "
            f"loss delta = candidate - baseline (eval loss when both have one).")


def render(report: Report, fmt: str) -> str:
    if fmt == "json":
        return json.dumps(report_dict(report), indent=2)
    if fmt == "csv":
        return render_csv(report)
    markdown = fmt == "markdown"
    table = markdown_table if markdown else text_table
    notes: list[str] = []
    out: list[str] = ["# optbench report" if markdown else "optbench report", ""]
    out.append("Reviewed: " + ", ".join(f"`{p}`" if markdown else p for p in report.paths))
    out.append("")
    for group in report.groups:
        out += [("## " if markdown else "== ") + _group_title(group), ""]
        for title, header, rows in _group_tables(group, notes, report.root):
            if title:
                out += [("### " if markdown else "-- ") + title, ""]
            out += [table(header, rows), ""]
    line = prediction_line(report)
    if line:
        out += [line, ""]
    if report.gate_results:
        out += ["## Gates" if markdown else "== Gates", ""]
        out += [("- " if markdown else "  ") + ("ok      " if r.ok else "FAILED  ") + r.message
                for r in report.gate_results]
        out.append("")
    out += [("_" + _method_line() + "_") if markdown else _method_line()]
    if notes:
        out += [""] + [f"[{i}] MFU peak: {n}" for i, n in enumerate(notes, start=1)]
    if report.notes:  # what the reader skipped or could not read
        out += ["", "Read with care:"] + [("- " if markdown else "  ") + n for n in report.notes]
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
    """report.md, report.csv, report.json and the PNG plots into ``out_dir``."""
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        written = []
        for name, fmt in zip(REPORT_FILES, ("markdown", "csv", "json"), strict=True):
            text = render(report, fmt)
            if name == "report.md" and plots:
                from optbench.report.plots import PLOT_FILES

                text += "\n" + "\n".join(f"![{n}]({n})" for n in PLOT_FILES) + "\n"
            (out_dir / name).write_text(text if text.endswith("\n") else text + "\n")
            written.append(out_dir / name)
        if plots:
            from optbench.report.plots import write_plots

            written += write_plots(report, out_dir)
    except OSError as exc:
        raise ReportError(f"cannot write the report into {out_dir}: {exc.strerror}; choose another --out") from None
    return written
