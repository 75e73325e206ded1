"""The analysis behind ``optbench report``: runs -> groups -> variants -> comparisons -> gates.

Reads every ``summary.json`` (the typed record ``optbench.summary.RunSummary``),
``metrics.jsonl`` and ``.hydra/overrides.yaml`` below the given paths, then:

* groups runs by model, task and schedule (train.steps, seq_len): runs of different models, tasks or
  lengths are listed, never compared;
* within a group, a *variant* is one resolved config (``config_hash``) on one device; repeats of a
  variant (``optbench compare --repeats``, or the same sweep run twice) are pooled;
* compares every variant with the group's baseline: speedup = throughput ratio (tokens/s), with a
  seeded bootstrap confidence interval over the per-step times, and a verdict ("faster", "slower",
  "no significant difference"; none when the machine's speed moved more than the effect or too few
  steps were timed); loss delta (noted when the batch differs); peak-memory ratio;
* for a phase sweep (overrides ``phase=<name>``) the plan's cumulative table;
* checks the plan's gates (``--min-speedup`` ``--max-loss-delta`` ``--max-memory-ratio``,
  ``optbench.report.gates``) on the furthest phase that ran.

Bad input raises ``ReportError`` (a ``ConfigError``): one line, exit status 2. A tree where some runs
are broken (a summary that does not parse) is still reported: the broken runs are listed with
status ``unreadable`` and why; a torn last line of a ``metrics.jsonl`` (a kill mid-write) is skipped
and noted. Only when no run can be read at all is the report refused.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from optbench.errors import ReportError
from optbench.exits import review_exit
from optbench.report.drift import DRIFT_NOTE, drift_moved, drift_reason
from optbench.report.gates import GateResult, Gates, check_gates, furthest_phase
from optbench.report.groups import Comparison, Group, PhaseRow
from optbench.report.runs import (
    Run,
    load_runs,
    natural_key,
)
from optbench.report.stats import (
    CONFIDENCE,
    MIN_TIMED_STEPS,
    percentile,
    speed_verdict,
)
from optbench.report.variants import (
    LOSS,
    Variant,
    align_ceilings,
    effective_value,
    group_key,
    label_variants,
    matches,
    parse_selector,
    tag_variants,
    variant_key,
)

__all__ = ["Comparison", "GateResult", "Gates", "Group", "PhaseRow", "Report", "build_report", "compare"]


# -------------------------------------------------------------------------------- comparisons
def compare(candidate: Variant, reference: Variant) -> Comparison:
    speedup, ci = None, None
    cand_tp, ref_tp = candidate.throughput, reference.throughput
    if cand_tp is not None and ref_tp is not None:
        speedup = cand_tp.tokens_per_s / ref_tp.tokens_per_s
    if candidate.boot is not None and reference.boot is not None:
        ratios = candidate.boot / reference.boot
        tail = (1 - CONFIDENCE) / 2 * 100
        ci = (percentile(ratios, tail), percentile(ratios, 100 - tail))
    verdict, short, note = _verdict(candidate, reference, speedup, ci)
    cand_loss, cand_kind = candidate.loss()
    ref_loss, ref_kind = reference.loss()
    kind = "eval" if cand_kind == ref_kind == "eval" else "final"
    if kind == "final":
        cand_loss, ref_loss = candidate.mean_of(LOSS["final"]), reference.mean_of(LOSS["final"])
    loss_delta = cand_loss - ref_loss if cand_loss is not None and ref_loss is not None else None
    cand_mem, ref_mem = candidate.peak_memory(), reference.peak_memory()
    memory_ratio = cand_mem / ref_mem if cand_mem is not None and ref_mem else None
    return Comparison(speedup, ci, verdict, loss_delta, kind, memory_ratio, reference.label,
                      loss_note(candidate, reference) if loss_delta is not None else None, short, note)


def _verdict(candidate: Variant, reference: Variant, speedup: float | None,
             ci: tuple[float, float] | None) -> tuple[str, str, str | None]:
    """(the verdict in full, in a few words for a table cell, the note that explains the short one)."""
    if ci is None and speedup is not None:
        why = f"too few timed steps (need {MIN_TIMED_STEPS} per variant)"
        return why, "no verdict: too few steps", f"no speed verdict with {why}: no interval"
    summaries = [r.summary for r in (*candidate.completed, *reference.completed)]
    moved = drift_moved(summaries, speedup)
    if moved is not None:
        return drift_reason(summaries, speedup) or "", f"no verdict: speed moved {moved:.0%}", DRIFT_NOTE
    verdict = speed_verdict(*(ci or (None, None)))
    return verdict, verdict, None


def loss_note(candidate: Variant, reference: Variant) -> str | None:
    """Why a loss delta is not like for like: the runs trained on batches of other sizes (a phase
    that spends freed memory on a larger batch, as the plan's phase 2 does). Runs of another
    number of steps or sequence length are never compared (another group)."""
    cand, ref = candidate.tokens_per_update(), reference.tokens_per_update()
    if cand is None or ref is None or cand == ref:
        return None
    return f"another batch: {cand:,} vs {ref:,} tokens per optimizer step"


def phase_of(variant: Variant) -> str | None:
    """The variant's phase: ``phase=`` (plans 001's) or ``energy_phase=`` (plan 003's, task=energy_flow)."""
    overrides = variant.first.override_map()
    return overrides.get("phase") or overrides.get("energy_phase")


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
            group.baseline_note = f"baseline: {group.baseline.label}" + (f" ({how})" if how != group.baseline.label else "")
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
class Report:
    paths: list[str]
    root: Path
    groups: list[Group]
    gates: Gates
    gate_results: list[GateResult]
    notes: list[str] = field(default_factory=list)

    @property
    def exit_code(self) -> int:
        return review_exit(gates_ok=all(g.ok for g in self.gate_results))


def build_groups(runs: list[Run]) -> list[Group]:
    by_group: dict[tuple, dict[str, Variant]] = {}
    for run in runs:
        variants = by_group.setdefault(group_key(run), {})
        key = variant_key(run)
        variants.setdefault(key, Variant(key, [])).runs.append(run)
    groups = []
    for (name, task, _shape, schedule), variants in by_group.items():
        group = Group(name, task, list(variants.values()), schedule=schedule)
        label_variants(group.variants)
        align_ceilings(group.variants)
        for variant in group.variants:
            variant.prepare()
        groups.append(group)
    labels = [f"model={g.name} task={g.task}" for g in groups]
    for group, label in zip(groups, labels, strict=True):
        same = [g for g, other in zip(groups, labels, strict=True) if other == label]
        params = group.params()
        group.label = label
        if params and len([g for g in same if g.schedule == group.schedule]) > 1:  # another shape (model.dim=...)
            group.label += f" ({params:,} params)"
        if len({g.schedule for g in same}) > 1:
            group.label += f", {group.schedule}"
            group.apart = ("runs of another number of steps or sequence length are reported apart, never compared: "
                           "their losses differ by the training, not by the config")
    return groups


def build_report(
    paths: list[str | Path], *, baseline: list[str] | None = None, candidate: list[str] | None = None,
    gates: Gates | None = None,
) -> Report:
    resolved = [Path(p) for p in paths]
    if not resolved:
        raise ReportError("give at least one PATH (a run dir, a sweep dir or outputs/)")
    runs = load_runs(resolved)
    groups = build_groups(runs)
    tag_variants([v for g in groups for v in g.variants])
    choose_baselines(groups, parse_selector(baseline, option="--baseline"))
    for group in groups:
        if group.baseline is not None:
            group.baseline.is_baseline = True
            group.comparisons = {v.key: compare(v, group.baseline) for v in group.variants}
        group.phases = build_phase_table(group)
        group.judged_note = furthest_phase(group)[1] if group.phases else None
    gates = gates or Gates()
    candidates = parse_selector(candidate, option="--candidate")
    if candidates and not any(matches(v, candidates) for g in groups for v in g.variants):
        raise unmatched("--candidate", candidates, groups)
    results = check_gates(groups, gates, candidates)
    notes = [note for run in runs for note in run.notes]  # unreadable runs are listed in their group
    notes += provenance_notes(runs)
    return Report([str(p) for p in paths], common_root(resolved), groups, gates, results, notes)


def provenance_notes(runs: list) -> list[str]:
    """One line when the runs pooled here were measured with different code or stacks (summary.json
    ``provenance``: commit, package versions, GPU, CPU); nothing when they agree."""
    from optbench.provenance import differences

    shared = {id(run.summary.provenance): run.summary.provenance for run in runs}  # runs that recorded one alike
    differ = differences(list(shared.values()))  # share it (report.runs.Shared): each looked at once
    if not differ:
        return []
    shown = "; ".join(f"{key}: {' vs '.join(values[:3])}{' ...' if len(values) > 3 else ''}"
                      for key, values in list(differ.items())[:4])
    more = f" (and {len(differ) - 4} more)" if len(differ) > 4 else ""
    return [f"warning: the runs pooled here differ in what they were measured with: {shown}{more}"]


def common_root(paths: list[Path]) -> Path:
    dirs = [(p.parent if p.is_file() else p).resolve() for p in paths]
    return Path(os.path.commonpath([str(d) for d in dirs]))
