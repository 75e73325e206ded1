"""The gates of ``optbench report`` (``--min-speedup`` ``--max-loss-delta`` ``--max-memory-ratio``):
which variant they judge, and each gate's result as one line that states only what the analysis
found (a speedup the drift guard withholds is not printed as one)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from optbench.report.groups import Comparison, Group
from optbench.report.options import Gates
from optbench.report.variants import Variant, matches


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


def furthest_phase(group: Group) -> tuple[Variant | None, str | None]:
    """The phase the plan's gates judge in a phase sweep: the last phase, or, when the last ones are
    ``incompatible`` here (a CPU blocks phases 5-8: an expected, recorded outcome), the furthest
    phase that ran, as ``optbench validate`` picks it. A phase that ran and failed is judged (and
    fails). (variant, why it is not the last phase)."""
    ran = [row for row in group.phases if row.variant.status != "incompatible"]
    if not ran:
        return None, None
    chosen = ran[-1]
    blocked = [row.phase for row in group.phases[group.phases.index(chosen) + 1:]]
    if not blocked:
        return chosen.variant, None
    return chosen.variant, (f"the gates judge phase={chosen.phase}, the furthest phase that ran here: "
                            f"{', '.join(blocked)} {'is' if len(blocked) == 1 else 'are'} incompatible with this "
                            "machine (--candidate phase=... judges another)")


def select_candidates(group: Group, selector: list[tuple[str, str]]) -> list[Variant]:
    """What the gates judge: --candidate's match; in a phase sweep the furthest phase that ran;
    otherwise every variant but the baseline."""
    others = [v for v in group.variants if v is not group.baseline]
    if selector:
        return [v for v in others if matches(v, selector)]
    if group.phases:
        chosen, _why = furthest_phase(group)
        return [chosen] if chosen is not None and chosen is not group.baseline else []
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
        for name, threshold in gates.items():
            results.append(GateResult(name, threshold, "", "", None, False, f"{name} {threshold:g}: nothing to judge: {why}"))
    return results


def _gate_candidate(group: Group, candidate: Variant, gates: Gates) -> list[GateResult]:
    baseline = group.baseline
    assert baseline is not None
    comparison = group.comparisons.get(candidate.key)
    results = []
    for name, threshold in gates.items():
        where = f"{candidate.label} vs {baseline.label}"
        if not candidate.completed or len(candidate.completed) < len(candidate.runs):
            message = f"{name} {threshold:g}: {where}: candidate did not complete ({candidate.reason})"
            results.append(GateResult(name, threshold, group.label, candidate.label, None, False, message))
            continue
        if not baseline.completed:
            message = f"{name} {threshold:g}: {where}: baseline did not complete ({baseline.reason})"
            results.append(GateResult(name, threshold, group.label, candidate.label, None, False, message))
            continue
        assert comparison is not None
        value, ok, shown, rule = GATE_RULES[name](comparison, threshold)
        message = f"{name} {threshold:g}: {where}: {shown}, needs {rule}"
        results.append(GateResult(name, threshold, group.label, candidate.label, value, ok, message))
    return results


def _speedup_gate(comparison: Comparison, threshold: float) -> tuple[float | None, bool, str, str]:
    """Noise-aware: the whole 95% interval must clear the bar, not just the point estimate; and a
    ratio the analysis gives no verdict on (the machine's speed moved more than the effect, too few
    timed steps) is not a finding: no number is printed, the gate is not passed."""
    rule = f"the 95% interval >= {threshold:g}x"
    if not comparison.judged:  # why, in a few words: the report's note says the rest
        why = (comparison.verdict_short or comparison.verdict).removeprefix("no verdict: ")
        return None, False, f"no speed verdict ({why})", rule
    ok = comparison.ci is not None and comparison.ci[0] >= threshold
    return comparison.speedup, ok, f"speedup {comparison.speedup_text()}", rule


def _loss_gate(comparison: Comparison, threshold: float) -> tuple[float | None, bool, str, str]:
    value = comparison.loss_delta
    ok = value is not None and abs(value) <= threshold
    shown = f"|{comparison.loss_kind} loss delta| {'n/a' if value is None else f'{abs(value):.6f}'}"
    if comparison.loss_note:
        shown += f" ({comparison.loss_note})"
    return value, ok, shown, f"<= {threshold:g}"


def _memory_gate(comparison: Comparison, threshold: float) -> tuple[float | None, bool, str, str]:
    value = comparison.memory_ratio
    ok = value is not None and value <= threshold
    shown = f"peak memory ratio {'n/a (peak memory not measured)' if value is None else f'{value:.2f}x'}"
    return value, ok, shown, f"<= {threshold:g}x"


GATE_RULES = {"min-speedup": _speedup_gate, "max-loss-delta": _loss_gate, "max-memory-ratio": _memory_gate}
