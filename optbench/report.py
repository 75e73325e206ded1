"""``optbench report PATH...``: review run outputs — noise-aware speedups, loss delta, memory, gates.

Reads every ``summary.json`` (the contract in ``optbench.outputs.SUMMARY_FIELDS``),
``metrics.jsonl`` and ``.hydra/overrides.yaml`` below the given paths, then:

* groups runs by model and task (runs of different models or tasks are listed, never compared);
* within a group, a *variant* is one resolved config (``config_hash``); repeats of a variant
  (``optbench compare --repeats``) are pooled;
* compares every variant with the group's baseline: speedup = throughput ratio (tokens/s), with a
  seeded bootstrap confidence interval over the per-step times, and a verdict ("faster", "slower",
  "no significant difference"); loss delta; peak-memory ratio;
* for a phase sweep (overrides ``phase=<name>``) the plan's cumulative table;
* checks the plan's gates (``--min-speedup`` ``--max-loss-delta`` ``--max-memory-ratio``).

Bad input raises ``ReportError`` (a ``ConfigError``): one line, exit status 2.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import logging
import math
import os
import re
import sys
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from hydra.experimental.callback import Callback

from optbench.errors import ConfigError

log = logging.getLogger(__name__)

BOOTSTRAP_RESAMPLES = 2000
CONFIDENCE = 0.95
BOOTSTRAP_SEED = 0
MIN_TIMED_STEPS = 3  # fewer per variant and a verdict would be a guess
COMPARE_MANIFEST = "compare.json"
FORMATS = ("table", "markdown", "csv", "json")
REPORT_FILES = ("report.md", "report.csv", "report.json")


class ReportError(ConfigError):
    """Bad input to the report: printed as one line, exit status 2."""


# ------------------------------------------------------------------------------------ reading
def dig(tree: Any, dotted: str) -> Any:
    """``tree["a"]["b"]`` for ``"a.b"``; None where any level is missing (summaries of other
    versions may lack fields; later features add some)."""
    node = tree
    for key in dotted.split("."):
        if not isinstance(node, dict) or key not in node:
            return None
        node = node[key]
    return node


def num(value: Any) -> int | float | None:
    """A finite number, or None (non-finite values are stored as strings like "nan")."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return value if math.isfinite(value) else None


def natural_key(text: str) -> tuple:
    """"10_x" after "9_x": digit runs compare as numbers."""
    return tuple(int(part) if part.isdigit() else part for part in re.split(r"(\d+)", text))


def parse_override(text: str) -> tuple[str, str]:
    """``key=value`` (also ``+key=``, ``++key=``, ``~key``) -> (key, value)."""
    body = text.lstrip("+~")
    key, sep, value = body.partition("=")
    if text.startswith("~") and not sep:
        return key, "(deleted)"
    return key, value


@dataclass
class Run:
    dir: Path
    summary: dict[str, Any]
    metrics: list[dict[str, Any]]
    overrides: list[str]
    side: str | None = None  # "A" or "B" in an optbench compare dir

    @property
    def status(self) -> str:
        return str(self.summary.get("status"))

    @property
    def error(self) -> str | None:
        return self.summary.get("error")

    @property
    def completed(self) -> bool:
        return self.status == "completed"

    def override_map(self) -> dict[str, str]:
        return dict(parse_override(o) for o in self.overrides)

    def sort_key(self) -> tuple:
        return (str(self.summary.get("started_at") or ""), natural_key(str(self.dir)))


def _load_json(path: Path, what: str) -> Any:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ReportError(
            f"{path} is not valid JSON ({exc.msg}, line {exc.lineno}): the {what} is truncated or corrupt; "
            f"rerun that run or leave its directory out"
        ) from None
    except OSError as exc:
        raise ReportError(f"cannot read {path}: {exc.strerror}") from None


def _load_metrics(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return []  # a run that failed before training has none
    records = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            raise ReportError(
                f"{path} line {number} is not valid JSON: the file is truncated or corrupt; "
                f"rerun that run or leave its directory out"
            ) from None
        if isinstance(record, dict):
            records.append(record)
    return records


def _load_overrides(run_dir: Path, summary: dict[str, Any]) -> list[str]:
    """Hydra's own record (.hydra/overrides.yaml) when present, else the summary's copy."""
    path = run_dir / ".hydra" / "overrides.yaml"
    if path.is_file():
        import yaml

        try:
            loaded = yaml.safe_load(path.read_text())
        except yaml.YAMLError:
            raise ReportError(f"{path} is not valid YAML: truncated or corrupt") from None
        if isinstance(loaded, list):
            return [str(o) for o in loaded]
    overrides = summary.get("overrides")
    return [str(o) for o in overrides] if isinstance(overrides, list) else []


def load_run(run_dir: Path) -> Run:
    summary = _load_json(run_dir / "summary.json", "summary")
    if not isinstance(summary, dict) or "status" not in summary:
        raise ReportError(f"{run_dir / 'summary.json'} is not an optbench summary (it has no status)")
    return Run(run_dir, summary, _load_metrics(run_dir), _load_overrides(run_dir, summary))


def find_run_dirs(path: Path) -> list[Path]:
    if not path.exists():
        raise ReportError(f"{path} does not exist")
    if path.is_file():
        if path.name != "summary.json":
            raise ReportError(f"{path} is a file; give a run dir, a sweep dir or an outputs dir")
        return [path.parent]
    dirs = sorted({p.parent for p in path.rglob("summary.json")}, key=lambda p: natural_key(str(p)))
    if not dirs:
        raise ReportError(
            f"no runs under {path}: no summary.json found (give a run dir, a sweep dir or outputs/)"
        )
    return dirs


def _compare_sides(root: Path) -> dict[Path, str]:
    """Run dir -> "A"/"B" from the manifest that ``optbench compare`` leaves in its output dir."""
    manifest = root / COMPARE_MANIFEST
    if not manifest.is_file():
        return {}
    data = _load_json(manifest, "compare manifest")
    runs = data.get("runs") if isinstance(data, dict) else None
    return {(root / r["dir"]).resolve(): r["side"] for r in runs or [] if isinstance(r, dict)}


def load_runs(paths: list[Path]) -> list[Run]:
    seen: dict[Path, Run] = {}
    for path in paths:
        sides = _compare_sides(path) if path.is_dir() else {}
        for run_dir in find_run_dirs(path):
            key = run_dir.resolve()
            if key not in seen:
                seen[key] = load_run(run_dir)
                seen[key].side = sides.get(key)
    return sorted(seen.values(), key=Run.sort_key)


# ------------------------------------------------------------------------------------ numbers
def percentile(values: np.ndarray, q: float) -> float:
    return float(np.percentile(values, q))  # linear interpolation, as optbench.metrics.percentile


@dataclass
class Throughput:
    """Pooled timing of a variant's completed runs."""

    per_run: list[np.ndarray]  # timed step times of each run
    tokens_per_step: float  # effective: tokens/s x median step time as the summary reports them
    tokens_per_s: float
    median: float
    p10: float
    p90: float

    @property
    def timed_steps(self) -> int:
        return sum(len(x) for x in self.per_run)


def _tokens_per_step(summary: dict[str, Any]) -> float | None:
    """Tokens one step processes, as the summary counts them (job-wide if tokens/s is)."""
    tps, median = num(dig(summary, "throughput.tokens_per_s")), num(dig(summary, "throughput.step_time_s.median"))
    if tps is not None and median is not None:
        return tps * median
    return num(dig(summary, "throughput.tokens_per_step"))


def _step_times(summary: dict[str, Any]) -> np.ndarray | None:
    times = dig(summary, "throughput.step_times_s")
    if not isinstance(times, list):
        return None
    values = [num(t) for t in times]
    if not values or any(v is None or v <= 0 for v in values):
        return None
    return np.asarray(values, dtype=float)


def pooled_throughput(runs: list[Run]) -> Throughput | None:
    per_run, tokens = [], []
    for run in runs:
        times, tps = _step_times(run.summary), _tokens_per_step(run.summary)
        if times is not None and tps is not None:
            per_run.append(times)
            tokens.append(tps)
    if not per_run:
        return None
    pooled = np.concatenate(per_run)
    median = float(np.median(pooled))
    tokens_per_step = float(np.median(tokens))
    return Throughput(per_run, tokens_per_step, tokens_per_step / median, median,
                      percentile(pooled, 10), percentile(pooled, 90))


def bootstrap_tokens_per_s(tp: Throughput, *, seed_key: str) -> np.ndarray:
    """Bootstrap distribution of the variant's tokens/s (= tokens per step / median step time).

    Hierarchical when there are repeats: resample runs, then steps within each chosen run, so
    run-to-run noise widens the interval; with one run it is the plain bootstrap over steps.
    Seeded from the variant's identity: the same outputs give the same interval every time.
    """
    rng = np.random.default_rng([BOOTSTRAP_SEED, zlib.crc32(seed_key.encode())])
    runs = tp.per_run
    if len(runs) == 1:
        x = runs[0]
        medians = np.median(x[rng.integers(0, len(x), size=(BOOTSTRAP_RESAMPLES, len(x)))], axis=1)
    else:
        medians = np.empty(BOOTSTRAP_RESAMPLES)
        for b in range(BOOTSTRAP_RESAMPLES):
            chosen = rng.integers(0, len(runs), size=len(runs))
            pooled = np.concatenate([runs[r][rng.integers(0, len(runs[r]), size=len(runs[r]))] for r in chosen])
            medians[b] = np.median(pooled)
    return tp.tokens_per_step / medians


def verdict(low: float | None, high: float | None) -> str:
    """The confidence interval of the speedup decides; a ratio inside the noise is no win."""
    if low is None or high is None:
        return "no verdict"
    if low > 1.0:
        return "faster"
    if high < 1.0:
        return "slower"
    return "no significant difference"


# ----------------------------------------------------------------------------------- variants
@dataclass
class Variant:
    key: str
    runs: list[Run]
    label: str = ""
    is_baseline: bool = False
    throughput: Throughput | None = None
    boot: np.ndarray | None = None

    @property
    def completed(self) -> list[Run]:
        return [r for r in self.runs if r.completed]

    @property
    def first(self) -> Run:
        return self.runs[0]

    @property
    def status(self) -> str:
        done = len(self.completed)
        if done == len(self.runs):
            return "completed"
        if done == 0:
            return self.first_failure.status
        return f"completed {done}/{len(self.runs)}"

    @property
    def first_failure(self) -> Run:
        return next(r for r in self.runs if not r.completed)

    @property
    def reason(self) -> str | None:
        if len(self.completed) == len(self.runs):
            return None
        failed = self.first_failure
        return f"{failed.status}: {failed.error or 'no error recorded'}"

    def mean_of(self, dotted: str) -> float | None:
        values = [num(dig(r.summary, dotted)) for r in self.completed]
        if not values or any(v is None for v in values):
            return None
        return float(np.mean(values))

    def max_of(self, dotted: str) -> float | None:
        values = [num(dig(r.summary, dotted)) for r in self.completed]
        if not values or any(v is None for v in values):
            return None
        return max(values)

    def median_of(self, dotted: str) -> float | None:
        values = [num(dig(r.summary, dotted)) for r in self.completed]
        if not values or any(v is None for v in values):
            return None
        return float(np.median(values))

    def loss(self) -> tuple[float | None, str]:
        """Eval loss on the fixed held-out batches when every run has one, else the final train loss."""
        value = self.mean_of("loss.eval")
        return (value, "eval") if value is not None else (self.mean_of("loss.final"), "final")

    def peak_memory(self) -> float | None:
        return self.max_of("memory.peak_bytes")  # the largest of the repeats: what must fit

    def prepare(self) -> None:
        self.throughput = pooled_throughput(self.completed)
        if self.throughput is not None and self.throughput.timed_steps >= MIN_TIMED_STEPS:
            self.boot = bootstrap_tokens_per_s(self.throughput, seed_key=self.key)


def variant_key(run: Run) -> str:
    """Runs of one resolved config are repeats of one variant (A and B of a compare stay apart,
    even in an A/A test)."""
    side = f"{run.side} " if run.side else ""
    if run.summary.get("config_hash"):
        return f"{side}config {run.summary['config_hash']}"
    return f"{side}overrides " + " ".join(sorted(run.overrides))


def group_key(run: Run) -> tuple[str, str, str]:
    """(model name, task, exact model shape): runs are compared only within one group."""
    config = run.summary.get("config")
    model = dig(config, "model") if isinstance(dig(config, "model"), dict) else {}
    overrides = run.override_map()
    name = dig(run.summary, "model.name") or model.get("name") or overrides.get("model") or "?"
    task = run.summary.get("task") or dig(config, "task.name") or overrides.get("task") or "?"
    return str(name), str(task), json.dumps(model, sort_keys=True, default=str)


def _config_value(run: Run, key: str) -> str | None:
    value = dig(run.summary.get("config"), key)
    if isinstance(value, dict):
        value = value.get("name")
    return None if value is None else str(value)


def effective_value(variant: Variant, key: str) -> str:
    """The value of ``key`` for this variant: its override, else its resolved config, else "-"."""
    overrides = variant.first.override_map()
    if key in overrides:
        return overrides[key]
    return _config_value(variant.first, key) or "-"


def label_variants(variants: list[Variant]) -> None:
    """Label each variant by the overrides that differ between variants (not the whole config)."""
    keys: list[str] = []
    for variant in variants:
        for key in variant.first.override_map():
            if key not in keys:
                keys.append(key)
    differing = [k for k in keys if len({effective_value(v, k) for v in variants}) > 1]
    if len(variants) == 1:
        differing = keys
    for variant in variants:
        parts = [f"{k}={effective_value(variant, k)}" for k in differing]
        side = variant.first.side
        variant.label = " ".join(([side] if side else []) + parts) or "(defaults)"
    counts: dict[str, int] = {}
    for variant in variants:
        counts[variant.label] = counts.get(variant.label, 0) + 1
    for variant in variants:
        if counts[variant.label] > 1:  # same overrides, different resolved config (conf/ changed)
            variant.label += f" [{variant.key.split()[-1][:8]}]"


# -------------------------------------------------------------------------------- comparisons
@dataclass
class Comparison:
    speedup: float | None
    ci: tuple[float, float] | None
    verdict: str
    loss_delta: float | None
    loss_kind: str
    memory_ratio: float | None
    reference: str

    def to_dict(self) -> dict[str, Any]:
        return {
            "reference": self.reference, "speedup": self.speedup,
            "ci_low": self.ci[0] if self.ci else None, "ci_high": self.ci[1] if self.ci else None,
            "verdict": self.verdict, "loss_delta": self.loss_delta, "loss_kind": self.loss_kind,
            "memory_ratio": self.memory_ratio,
        }


def compare(candidate: Variant, reference: Variant) -> Comparison:
    speedup, ci, why = None, None, None
    cand_tp, ref_tp = candidate.throughput, reference.throughput
    if cand_tp is not None and ref_tp is not None:
        speedup = cand_tp.tokens_per_s / ref_tp.tokens_per_s
    if candidate.boot is not None and reference.boot is not None:
        ratios = candidate.boot / reference.boot
        tail = (1 - CONFIDENCE) / 2 * 100
        ci = (percentile(ratios, tail), percentile(ratios, 100 - tail))
    elif speedup is not None:
        why = f"too few timed steps (need {MIN_TIMED_STEPS} per variant)"
    cand_loss, cand_kind = candidate.loss()
    ref_loss, ref_kind = reference.loss()
    kind = "eval" if cand_kind == ref_kind == "eval" else "final"
    if kind == "final":
        cand_loss, ref_loss = candidate.mean_of("loss.final"), reference.mean_of("loss.final")
    loss_delta = cand_loss - ref_loss if cand_loss is not None and ref_loss is not None else None
    cand_mem, ref_mem = candidate.peak_memory(), reference.peak_memory()
    memory_ratio = cand_mem / ref_mem if cand_mem is not None and ref_mem else None
    return Comparison(speedup, ci, why or verdict(*(ci or (None, None))), loss_delta, kind, memory_ratio,
                      reference.label)


@dataclass
class PhaseRow:
    phase: str
    variant: Variant
    vs_baseline: Comparison | None
    vs_previous: Comparison | None
    previous: str | None

    def to_dict(self) -> dict[str, Any]:
        return {
            "phase": self.phase, "label": self.variant.label, "status": self.variant.status,
            "reason": self.variant.reason,
            "tokens_per_s": self.variant.throughput.tokens_per_s if self.variant.throughput else None,
            "peak_bytes": self.variant.peak_memory(),
            "vs_baseline": self.vs_baseline.to_dict() if self.vs_baseline else None,
            "previous": self.previous,
            "vs_previous": self.vs_previous.to_dict() if self.vs_previous else None,
        }


@dataclass
class Group:
    name: str
    task: str
    variants: list[Variant]
    label: str = ""
    baseline: Variant | None = None
    baseline_note: str | None = None
    comparisons: dict[str, Comparison] = field(default_factory=dict)  # variant key -> vs baseline
    phases: list[PhaseRow] = field(default_factory=list)

    @property
    def runs(self) -> list[Run]:
        return [r for v in self.variants for r in v.runs]

    def params(self) -> int | None:
        for run in self.runs:
            value = num(dig(run.summary, "model.params"))
            if value is not None:
                return int(value)
        return None


def phase_of(variant: Variant) -> str | None:
    return variant.first.override_map().get("phase")


def build_phase_table(group: Group) -> list[PhaseRow]:
    """The plan's cumulative table, when the group holds a phase sweep (one variant per phase)."""
    phased = [v for v in group.variants if phase_of(v) is not None]
    names = [phase_of(v) for v in phased]
    if len(phased) < 2 or len(set(names)) != len(names) or group.baseline is None:
        return []
    rows, previous = [], None
    for variant in sorted(phased, key=lambda v: natural_key(phase_of(v) or "")):
        vs_base = group.comparisons.get(variant.key)
        vs_prev = compare(variant, previous) if previous is not None and variant.completed else None
        rows.append(PhaseRow(phase_of(variant) or "", variant, vs_base, vs_prev,
                             phase_of(previous) if previous is not None else None))
        if variant.completed:
            previous = variant  # a blocked phase is skipped: the next one is compared with the last that ran
    return rows


# ----------------------------------------------------------------------------------- baseline
def parse_selector(items: list[str] | None, *, option: str) -> list[tuple[str, str]]:
    selector = []
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ReportError(f"{option} takes KEY=VALUE (an override, e.g. phase=0_baseline), got '{item}'")
        selector.append((key.lstrip("+"), value))
    return selector


def matches(variant: Variant, selector: list[tuple[str, str]]) -> bool:
    overrides = variant.first.override_map()
    for key, value in selector:
        actual = overrides[key] if key in overrides else _config_value(variant.first, key)
        if actual != value:
            return False
    return True


def _default_baseline(group: Group) -> tuple[Variant, str]:
    sided = [v for v in group.variants if v.first.side == "A"]
    if sided:
        return sided[0], "A of optbench compare"
    for variant in group.variants:
        if phase_of(variant) == "0_baseline":
            return variant, "phase=0_baseline"
    return group.variants[0], "the first run"


def choose_baselines(groups: list[Group], selector: list[tuple[str, str]]) -> None:
    if not selector:
        for group in groups:
            group.baseline, how = _default_baseline(group)
            group.baseline_note = f"baseline: {group.baseline.label} ({how})"
        return
    text = " ".join(f"{k}={v}" for k, v in selector)
    found = False
    for group in groups:
        chosen = [v for v in group.variants if matches(v, selector)]
        if len(chosen) > 1:
            raise ReportError(
                f"--baseline {text} matches {len(chosen)} variants of {group.label} "
                f"({'; '.join(v.label for v in chosen)}); add another --baseline KEY=VALUE to pick one"
            )
        if chosen:
            found = True
            group.baseline = chosen[0]
            group.baseline_note = f"baseline: {chosen[0].label} (--baseline {text})"
        else:
            group.baseline_note = f"no run matches --baseline {text}: listed, not compared"
    if not found:
        key = selector[0][0]
        values = sorted({effective_value(v, key) for g in groups for v in g.variants}, key=natural_key)
        raise ReportError(f"no run matches --baseline {text}; the runs have {key}=" + "|".join(values))


# ------------------------------------------------------------------------------------- report
@dataclass
class Gates:
    min_speedup: float | None = None
    max_loss_delta: float | None = None
    max_memory_ratio: float | None = None

    def any(self) -> bool:
        return any(v is not None for v in (self.min_speedup, self.max_loss_delta, self.max_memory_ratio))


@dataclass
class GateResult:
    gate: str
    threshold: float
    group: str
    candidate: str
    value: float | None
    ok: bool
    message: str

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class Report:
    paths: list[str]
    root: Path
    groups: list[Group]
    gates: Gates
    gate_results: list[GateResult]
    notes: list[str] = field(default_factory=list)

    @property
    def exit_code(self) -> int:
        return 1 if any(not g.ok for g in self.gate_results) else 0


def build_groups(runs: list[Run]) -> list[Group]:
    by_group: dict[tuple, dict[str, Variant]] = {}
    for run in runs:
        variants = by_group.setdefault(group_key(run), {})
        key = variant_key(run)
        variants.setdefault(key, Variant(key, [])).runs.append(run)
    groups = []
    for (name, task, _shape), variants in by_group.items():
        group = Group(name, task, list(variants.values()))
        label_variants(group.variants)
        for variant in group.variants:
            variant.prepare()
        groups.append(group)
    labels = [f"model={g.name} task={g.task}" for g in groups]
    for group, label in zip(groups, labels, strict=True):
        clash = labels.count(label) > 1  # same preset name, another shape (e.g. model.dim=...)
        params = group.params()
        group.label = label + (f" ({params:,} params)" if clash and params else "")
    return groups


def select_candidates(group: Group, selector: list[tuple[str, str]]) -> list[Variant]:
    """What the gates judge: --candidate's match; in a phase sweep the last phase (the plan's fully
    optimized config, completed or not); otherwise every variant but the baseline."""
    others = [v for v in group.variants if v is not group.baseline]
    if selector:
        return [v for v in others if matches(v, selector)]
    if group.phases:
        return [group.phases[-1].variant] if group.phases[-1].variant is not group.baseline else []
    return others


def check_gates(groups: list[Group], gates: Gates, selector: list[tuple[str, str]]) -> list[GateResult]:
    if not gates.any():
        return []
    results: list[GateResult] = []
    judged = 0
    for group in groups:
        if group.baseline is None:
            continue
        for candidate in select_candidates(group, selector):
            judged += 1
            results += _gate_candidate(group, candidate, gates)
    if judged == 0:
        what = f"--candidate {' '.join(f'{k}={v}' for k, v in selector)}" if selector else "a run besides the baseline"
        for name, threshold in _gate_items(gates):
            results.append(GateResult(name, threshold, "", "", None, False,
                                      f"{name} {threshold:g}: nothing to judge (no {what} with a baseline)"))
    return results


def _gate_items(gates: Gates) -> list[tuple[str, float]]:
    items = [("min-speedup", gates.min_speedup), ("max-loss-delta", gates.max_loss_delta),
             ("max-memory-ratio", gates.max_memory_ratio)]
    return [(name, value) for name, value in items if value is not None]


def _gate_candidate(group: Group, candidate: Variant, gates: Gates) -> list[GateResult]:
    baseline = group.baseline
    assert baseline is not None
    comparison = group.comparisons.get(candidate.key)
    results = []
    for name, threshold in _gate_items(gates):
        where = f"{candidate.label} vs {baseline.label}"
        if not candidate.completed or len(candidate.completed) < len(candidate.runs):
            message = f"{name} {threshold:g}: {where}: candidate did not complete ({candidate.reason})"
            results.append(GateResult(name, threshold, group.label, candidate.label, None, False, message))
            continue
        if not baseline.completed:
            message = f"{name} {threshold:g}: {where}: baseline did not complete ({baseline.reason})"
            results.append(GateResult(name, threshold, group.label, candidate.label, None, False, message))
            continue
        results.append(_gate_value(name, threshold, group, candidate, comparison, where))
    return results


def _gate_value(name: str, threshold: float, group: Group, candidate: Variant,
                comparison: Comparison | None, where: str) -> GateResult:
    assert comparison is not None
    if name == "min-speedup":
        value, ok = comparison.speedup, comparison.speedup is not None and comparison.speedup >= threshold
        shown = f"speedup {fmt_speedup(comparison)}"
        rule = f">= {threshold:g}x"
    elif name == "max-loss-delta":
        value = comparison.loss_delta
        ok = value is not None and abs(value) <= threshold
        shown = f"|{comparison.loss_kind} loss delta| {'n/a' if value is None else f'{abs(value):.6f}'}"
        rule = f"<= {threshold:g}"
    else:
        value = comparison.memory_ratio
        ok = value is not None and value <= threshold
        shown = f"peak memory ratio {'n/a (peak memory not measured)' if value is None else f'{value:.2f}x'}"
        rule = f"<= {threshold:g}x"
    message = f"{name} {threshold:g}: {where}: {shown}, needs {rule}"
    return GateResult(name, threshold, group.label, candidate.label, value, ok, message)


def build_report(
    paths: list[str | Path], *, baseline: list[str] | None = None, candidate: list[str] | None = None,
    gates: Gates | None = None,
) -> Report:
    resolved = [Path(p) for p in paths]
    if not resolved:
        raise ReportError("give at least one PATH (a run dir, a sweep dir or outputs/)")
    runs = load_runs(resolved)
    groups = build_groups(runs)
    choose_baselines(groups, parse_selector(baseline, option="--baseline"))
    for group in groups:
        if group.baseline is not None:
            group.baseline.is_baseline = True
            group.comparisons = {v.key: compare(v, group.baseline) for v in group.variants}
        group.phases = build_phase_table(group)
    gates = gates or Gates()
    results = check_gates(groups, gates, parse_selector(candidate, option="--candidate"))
    return Report([str(p) for p in paths], common_root(resolved), groups, gates, results)


def common_root(paths: list[Path]) -> Path:
    dirs = [(p.parent if p.is_file() else p).resolve() for p in paths]
    return Path(os.path.commonpath([str(d) for d in dirs]))


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
                 "compared": loss, "compared_kind": kind},
        "vs_baseline": comparison.to_dict() if comparison and not variant.is_baseline else None,
    }


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
    from optbench.outputs import human_bytes as _human

    return "-" if n is None else _human(n)


def fmt_speedup(c: Comparison | None) -> str:
    if c is None or c.speedup is None:
        return "-"
    if c.ci is None:
        return f"{c.speedup:.2f}x"
    return f"{c.speedup:.2f}x [{c.ci[0]:.2f}-{c.ci[1]:.2f}]"


def _f(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _peak_note(source: str | None, notes: list[str]) -> str:
    if not source:
        return ""
    if source not in notes:
        notes.append(source)
    return f"[{notes.index(source) + 1}]"


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
        return row + ["-"] * 10 + [variant.reason or ""]
    row += [
        _f(tp.tokens_per_s if tp else None, ",.0f"),
        f"{tp.median:.4f} [{tp.p10:.4f}-{tp.p90:.4f}]" if tp else "-",
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
    return head + ["tokens/s", "step time s median [p10-p90]", "MFU", "peak memory", "final loss",
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


def _group_tables(group: Group, notes: list[str], root: Path) -> list[tuple[str, list[str], list[list[str]]]]:
    with_runs = any(len(v.runs) > 1 for v in group.variants)
    tables = [("", variant_header(with_runs=with_runs),
               [variant_row(group, v, notes, with_runs=with_runs) for v in group.variants])]
    if group.phases:
        tables.append(("Phases (cumulative, the plan's table)", phase_header(), [phase_row(r) for r in group.phases]))
    if with_runs:
        rows = [run_row(r, v, root) for v in group.variants for r in v.runs]
        tables.append(("Runs", runs_header(), rows))
    return tables


def _group_title(group: Group) -> str:
    params = group.params()
    devices = sorted({str(r.summary.get("device")) for r in group.runs if r.summary.get("device")})
    parts = [group.label + (f", {params:,} params" if params and "params" not in group.label else "")]
    if len(devices) == 1:
        parts.append(devices[0])
    parts.append(group.baseline_note or "")
    return " | ".join(p for p in parts if p)


def _method_line() -> str:
    return (f"speedup = tokens/s ratio vs the baseline; [95% CI] from {BOOTSTRAP_RESAMPLES} seeded bootstrap "
            f"resamples of the per-step times (runs, then steps, when repeated); verdict 'faster'/'slower' only "
            f"when the interval excludes 1. loss delta = candidate - baseline (eval loss when both have one).")


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
    if report.gate_results:
        out += ["## Gates" if markdown else "== Gates", ""]
        out += [("- " if markdown else "  ") + ("ok      " if r.ok else "FAILED  ") + r.message
                for r in report.gate_results]
        out.append("")
    out += [("_" + _method_line() + "_") if markdown else _method_line()]
    if notes:
        out += [""] + [f"[{i}] MFU peak: {n}" for i, n in enumerate(notes, start=1)]
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
                from optbench.plots import PLOT_FILES

                text += "\n" + "\n".join(f"![{n}]({n})" for n in PLOT_FILES) + "\n"
            (out_dir / name).write_text(text if text.endswith("\n") else text + "\n")
            written.append(out_dir / name)
        if plots:
            from optbench.plots import write_plots

            written += write_plots(report, out_dir)
    except OSError as exc:
        raise ReportError(f"cannot write the report into {out_dir}: {exc.strerror}; choose another --out") from None
    return written


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
    parser = OneLineParser(prog="optbench report", description=__doc__.split("\n\n")[0],
                     formatter_class=argparse.RawDescriptionHelpFormatter)
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
class SweepReport(Callback):
    """Hydra callback (conf/train.yaml, ``hydra.callbacks.report``): at the end of every multirun
    sweep, write the report into the sweep dir and print its table.

    A report that cannot be made must never fail the sweep whose runs are already on disk: the
    reason is printed as one line with the command to retry, and the sweep's exit status stands.
    """

    def __init__(self) -> None:
        self.sweep_dir: Path | None = None

    def on_multirun_start(self, config: Any, **kwargs: Any) -> None:
        self.sweep_dir = Path(str(config.hydra.sweep.dir))

    def on_multirun_end(self, config: Any, **kwargs: Any) -> None:
        sweep_dir = self.sweep_dir or Path(str(config.hydra.sweep.dir))
        try:
            report = build_report([sweep_dir])
            write_outputs(report, sweep_dir)
            sys.stdout.write(render(report, "table"))
            print(f"optbench: sweep report written to {sweep_dir / 'report.md'}", flush=True)
        except Exception as exc:  # the sweep's runs stand; the report can be made again by hand
            print(f"optbench: sweep report not written ({type(exc).__name__}: {exc}); "
                  f"run `optbench report {sweep_dir}`", file=sys.stderr, flush=True)
