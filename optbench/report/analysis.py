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

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from optbench.config.renames import upgrade_and_warn
from optbench.errors import ReportError
from optbench.report.drift import drift_reason
from optbench.report.runs import (
    Run,
    dig,
    load_runs,
    natural_key,
    num,
)
from optbench.report.stats import (
    CONFIDENCE,
    MIN_TIMED_STEPS,
    percentile,
    speed_verdict,
)
from optbench.report.variants import (
    Variant,
    config_value,
    effective_value,
    group_key,
    label_variants,
    variant_key,
)


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
    for item in upgrade_and_warn(items or []):  # an old name (checkpointing=none) as train reads it
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ReportError(f"{option} takes KEY=VALUE (an override, e.g. phase=0_baseline), got '{item}'")
        selector.append((key.lstrip("+"), value))
    return selector


def matches(variant: Variant, selector: list[tuple[str, str]]) -> bool:
    overrides = variant.first.override_map()
    for key, value in selector:
        actual = overrides[key] if key in overrides else config_value(variant.first, key)
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
