"""The analysis behind ``optbench report``: runs -> groups -> variants -> comparisons -> gates.

Reads every ``summary.json`` (the contract in ``optbench.outputs.SUMMARY_FIELDS``),
``metrics.jsonl`` and ``.hydra/overrides.yaml`` below the given paths, then:

* groups runs by model and task (runs of different models or tasks are listed, never compared);
* within a group, a *variant* is one resolved config (``config_hash``) on one device; repeats of a
  variant (``optbench compare --repeats``, or the same sweep run twice) are pooled;
* compares every variant with the group's baseline: speedup = throughput ratio (tokens/s), with a
  seeded bootstrap confidence interval over the per-step times, and a verdict ("faster", "slower",
  "no significant difference"); loss delta; peak-memory ratio;
* for a phase sweep (overrides ``phase=<name>``) the plan's cumulative table;
* checks the plan's gates (``--min-speedup`` ``--max-loss-delta`` ``--max-memory-ratio``).

Bad input raises ``ReportError`` (a ``ConfigError``): one line, exit status 2. A tree where some runs
are broken (a summary that does not parse) is still reported: the broken runs are listed with
status ``unreadable`` and why; a torn last line of a ``metrics.jsonl`` (a kill mid-write) is skipped
and noted. Only when no run can be read at all is the report refused.
"""

from __future__ import annotations

import json
import os
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from optbench import metrics
from optbench.drift import drift_reason
from optbench.errors import ReportError
from optbench.runs import (
    Run,
    dig,
    load_runs,
    natural_key,
    num,
)

BOOTSTRAP_RESAMPLES = 2000
CONFIDENCE = 0.95
BOOTSTRAP_SEED = 0
MIN_TIMED_STEPS = 10  # fewer, and the bootstrap of a median is overconfident (measured: 19% false "faster" at 4)


# ------------------------------------------------------------------------------------ numbers
def percentile(values: np.ndarray, q: float) -> float:
    return float(metrics.percentile([float(v) for v in np.asarray(values, dtype=float)], q))  # a float, not np


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


def block_resample(x: np.ndarray, *, rng: np.random.Generator, num: int) -> np.ndarray:
    """``num`` circular block-bootstrap resamples of the step-time series ``x`` (shape num x n).

    Blocks of ~n^(1/3) consecutive steps keep the autocorrelation of a shared machine whose load
    drifts during a run: slow phases are resampled as phases, which widens the interval, where an
    iid bootstrap of single steps would call a load change a speedup.
    """
    n = len(x)
    length = max(1, round(n ** (1 / 3)))
    blocks = -(-n // length)
    starts = rng.integers(0, n, size=(num, blocks))
    index = (starts[:, :, None] + np.arange(length)[None, None, :]).reshape(num, -1)[:, :n] % n
    return x[index]


def bootstrap_tokens_per_s(tp: Throughput, *, seed_key: str) -> np.ndarray:
    """Bootstrap distribution of the variant's tokens/s (= tokens per step / median step time).

    Hierarchical when there are repeats: resample runs, then blocks of steps within each chosen
    run, so run-to-run noise widens the interval. Seeded from the variant's identity: the same
    outputs give the same interval every time.
    """
    rng = np.random.default_rng([BOOTSTRAP_SEED, zlib.crc32(seed_key.encode())])
    runs, num = tp.per_run, BOOTSTRAP_RESAMPLES
    if len(runs) == 1:
        medians = np.median(block_resample(runs[0], rng=rng, num=num), axis=1)
    else:
        count = len(runs)
        resampled = [block_resample(x, rng=rng, num=num * count) for x in runs]
        chosen = rng.integers(0, count, size=(num, count))
        medians = np.array([
            np.median(np.concatenate([resampled[r][b * count + j] for j, r in enumerate(chosen[b])]))
            for b in range(num)
        ])
    return tp.tokens_per_step / medians


def speed_verdict(low: float | None, high: float | None) -> str:

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
    device = f" on {run.summary.get('device')}"
    mixed = f" {config_changed(run)}" if config_changed(run) else ""  # half one config: never pooled
    if run.summary.get("config_hash"):
        return f"{side}config {run.summary['config_hash']}{device}{mixed}"
    return f"{side}overrides {' '.join(sorted(run.overrides))}{device}{mixed}"


def config_changed(run: Run) -> str | None:
    """"(config changed at step N: key was -> now, ...)" for a run resumed under a changed config."""
    changes = dig(run.summary, "applied.checkpoint.config_changes")
    if not isinstance(changes, list) or not changes:
        return None
    what = ", ".join(f"{c.get('key')} {c.get('was')} -> {c.get('now')}" for c in changes if isinstance(c, dict))
    return f"(config changed at step {dig(run.summary, 'applied.checkpoint.resumed_step')}: {what})"


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
    if isinstance(value, dict):  # a group: its preset's name, or its first field (attention.kernel, compile.mode)
        value = value["name"] if "name" in value else next(iter(value.values()), None)
    return None if value is None or isinstance(value, (dict, list)) else str(value)


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
    if not differing and not any(v.first.side for v in variants):
        differing = keys  # one variant, or variants that differ only in the device: name them fully
    devices = {str(v.first.summary.get("device")) for v in variants if v.first.summary.get("device")}
    short = {d.split(" (")[0] for d in devices}
    for variant in variants:
        parts = [f"{k}={effective_value(variant, k)}" for k in differing]
        side = variant.first.side
        variant.label = " ".join(([side] if side else []) + parts) or "(defaults)"
        device = variant.first.summary.get("device")
        if len(devices) > 1 and device:  # the same config on two machines: two variants
            variant.label += f" on {device.split(' (')[0] if len(short) == len(devices) else device}"
        changed = config_changed(variant.first)
        if changed:  # resumed under another config: not the config its overrides name
            variant.label += f" {changed}"
    counts: dict[str, int] = {}
    for variant in variants:
        counts[variant.label] = counts.get(variant.label, 0) + 1
    for variant in variants:
        if counts[variant.label] > 1:  # same overrides, different resolved config (conf/ changed)
            variant.label += f" [{variant.first.summary.get('config_hash') or variant.first.dir.name}]"


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

    def speedup_text(self) -> str:
        if self.speedup is None:
            return "-"
        if self.ci is None:
            return f"{self.speedup:.2f}x"
        return f"{self.speedup:.2f}x [{self.ci[0]:.2f}-{self.ci[1]:.2f}]"

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
    why = why or drift_reason([r.summary for r in (*candidate.completed, *reference.completed)], speedup)
    cand_loss, cand_kind = candidate.loss()
    ref_loss, ref_kind = reference.loss()
    kind = "eval" if cand_kind == ref_kind == "eval" else "final"
    if kind == "final":
        cand_loss, ref_loss = candidate.mean_of("loss.final"), reference.mean_of("loss.final")
    loss_delta = cand_loss - ref_loss if cand_loss is not None and ref_loss is not None else None
    cand_mem, ref_mem = candidate.peak_memory(), reference.peak_memory()
    memory_ratio = cand_mem / ref_mem if cand_mem is not None and ref_mem else None
    return Comparison(speedup, ci, why or speed_verdict(*(ci or (None, None))), loss_delta, kind, memory_ratio,
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
    completed = [v for v in group.variants if v.completed]
    return (completed or group.variants)[0], "the first run" + (" that completed" if completed else "")


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
        raise unmatched("--baseline", selector, groups)


def unmatched(option: str, selector: list[tuple[str, str]], groups: list[Group]) -> ReportError:
    text = " ".join(f"{k}={v}" for k, v in selector)
    key = selector[0][0]
    values = sorted({effective_value(v, key) for g in groups for v in g.variants}, key=natural_key)
    return ReportError(f"no run matches {option} {text}; the runs have {key}=" + "|".join(values))


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
        why = (f"no run matches --candidate {' '.join(f'{k}={v}' for k, v in selector)} in a group with a baseline"
               if selector else "no run besides the baseline to compare with it")
        for name, threshold in _gate_items(gates):
            results.append(GateResult(name, threshold, "", "", None, False, f"{name} {threshold:g}: nothing to judge: {why}"))
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
        # noise-aware: the whole 95% interval must clear the bar, not just the point estimate
        value = comparison.speedup
        ok = comparison.ci is not None and comparison.ci[0] >= threshold
        shown = f"speedup {comparison.speedup_text()}"
        if comparison.ci is None and value is not None:
            shown += f" ({comparison.verdict}: no interval)"
        rule = f"the 95% interval >= {threshold:g}x"
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
    candidates = parse_selector(candidate, option="--candidate")
    if candidates and not any(matches(v, candidates) for g in groups for v in g.variants):
        raise unmatched("--candidate", candidates, groups)
    results = check_gates(groups, gates, candidates)
    notes = [note for run in runs for note in run.notes]  # unreadable runs are listed in their group
    return Report([str(p) for p in paths], common_root(resolved), groups, gates, results, notes)


def common_root(paths: list[Path]) -> Path:
    dirs = [(p.parent if p.is_file() else p).resolve() for p in paths]
    return Path(os.path.commonpath([str(d) for d in dirs]))
