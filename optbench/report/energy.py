"""Plan 003's claims (the energy-flow pipeline), as data the report holds a measured factor against:
each phase of ``conf/energy_phase/`` with the speedup the plan expects of it over the phase before,
and its total. Cited once, here, from plan 003 ("Energy Flow Training Pipeline - Analysis &
Optimization Plan"); docs/energy-flow.md says how each is read."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from optbench.report.groups import Group, PhaseRow
from optbench.summary import RunSummary

PLAN_003 = "plan 003 (energy-flow pipeline)"


@dataclass(frozen=True)
class EnergyClaim:
    factor: float  # the plan's expected speedup of this phase over the one before
    text: str  # the plan's words, and where


# plan 003, "Optimization Plan (Priority Order)" items 1-6, in its order
ENERGY_CLAIMS: dict[str, EnergyClaim] = {
    "1_bridge": EnergyClaim(16.0, "16x: batched text bridge (item 1, \"Potential speedup: 16x (batch size)\")"),
    "2_adaptive": EnergyClaim(8.33, "8.33x: adaptive max_steps, threshold 0.95, patience 3 (item 2)"),
    "3_vectorized": EnergyClaim(5.0, "5x: vectorized FlowProcessor (item 3)"),
    "4_batch": EnergyClaim(4.0, "4x throughput: batch 64, grad accumulation 4 (item 4)"),
    "5_dataloader": EnergyClaim(2.0, "2x I/O: DataLoader workers, pinned memory, prefetch (item 5)"),
    "6_bf16": EnergyClaim(1.5, "1.5x: mixed precision (item 6)"),
}
# "Expected Results": 0.5 -> 20 samples/s
ENERGY_TOTAL = EnergyClaim(40.0, "40x throughput: 0.5 -> 20 samples/s (\"Expected Results\")")


def claim_between(previous: str | None, phase: str) -> EnergyClaim | None:
    """The plan's claim for ``phase`` over ``previous``: the product of the claims of the phases
    after ``previous`` up to ``phase`` (a sweep that skips a phase compares across it)."""
    names = list(ENERGY_CLAIMS)
    if previous is None or phase not in names:
        return None
    first = names.index(previous) + 1 if previous in names else 0
    span = names[first:names.index(phase) + 1]
    if not span:
        return None
    factor = 1.0
    for name in span:
        factor *= ENERGY_CLAIMS[name].factor
    text = ENERGY_CLAIMS[phase].text if len(span) == 1 else (
        f"{factor:.3g}x: " + " x ".join(f"{ENERGY_CLAIMS[n].factor:g}x ({n})" for n in span))
    return EnergyClaim(factor, text)


CLAIMS_HEADER = ["phase", "plan 003 claims", "measured vs previous", "verdict", "cosine delta vs previous",
                 "flow steps (mean)", "peak memory vs previous"]


def claim_rows(group: Group) -> list[dict[str, Any]]:
    """Each energy phase of ``group`` beside its claim, then the furthest phase against the baseline
    beside the plan's total (as JSON-able dicts)."""
    if group.task != "energy_flow" or not group.phases:
        return []
    rows, previous = [], None
    for row in group.phases:
        claim = claim_between(previous.phase if previous else None, row.phase)
        rows.append(_row(row.phase, claim, row, row.vs_previous, previous))
        if row.variant.completed:
            previous = row
    done = [r for r in group.phases if r.variant.completed and not r.variant.is_baseline]
    if done and group.baseline is not None:
        last = done[-1]
        rows.append(_row(f"{last.phase} vs baseline", ENERGY_TOTAL, last, last.vs_baseline,
                         next((r for r in group.phases if r.variant.is_baseline), None)))
    return rows


def _cosine(summary: RunSummary) -> Any:
    return (summary.loss.eval_metrics or {}).get("cosine")


def _flow_steps(summary: RunSummary) -> Any:
    task = summary.task_record
    return task.flow_steps.mean if task is not None and task.flow_steps is not None else None


def _row(phase: str, claim: EnergyClaim | None, row: PhaseRow, comparison: Any, previous: PhaseRow | None) -> dict:
    variant = row.variant
    cosine, before = variant.mean_of(_cosine), None
    memory = None
    if previous is not None:
        before = previous.variant.mean_of(_cosine)
        own, theirs = variant.peak_memory(), previous.variant.peak_memory()
        memory = own / theirs if own and theirs else None
    return {
        "phase": phase, "claim": claim.factor if claim else None, "claim_text": claim.text if claim else None,
        "status": variant.status, "speedup": comparison.speedup if comparison else None,
        "speedup_text": comparison.speedup_text() if comparison else "-",
        "verdict": comparison.verdict_short or comparison.verdict if comparison else "-",
        "cosine_delta": cosine - before if cosine is not None and before is not None else None,
        "flow_steps": variant.mean_of(_flow_steps), "memory_ratio": memory,
    }


def claim_table(group: Group) -> list[list[str]]:
    """The rows of ``claim_rows`` as table cells."""
    def number(value: float | None, spec: str) -> str:
        return "-" if value is None else format(value, spec)

    return [[r["phase"], r["claim_text"] or "-", r["speedup_text"] if r["status"] == "completed" else r["status"],
             r["verdict"], number(r["cosine_delta"], "+.4f"), number(r["flow_steps"], ".1f"),
             "-" if r["memory_ratio"] is None else f"{r['memory_ratio']:.2f}x"] for r in claim_rows(group)]
