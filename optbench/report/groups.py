"""What the report's analysis produces, as data: a comparison of two variants, a row of the phase
table, a group of runs (one model, task and schedule) with its baseline. Computed by
``optbench.report.analysis``, judged by ``optbench.report.gates``, shown by ``optbench.report.format``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from optbench.report.runs import Run, num
from optbench.report.stats import VERDICTS
from optbench.report.variants import Variant


@dataclass
class Comparison:
    speedup: float | None
    ci: tuple[float, float] | None
    verdict: str
    loss_delta: float | None
    loss_kind: str
    memory_ratio: float | None
    reference: str
    loss_note: str | None = None  # why the loss delta is not like for like (another batch)
    verdict_short: str = ""  # the verdict in a few words (a table cell)
    verdict_note: str | None = None  # what the short verdict leaves out (a note under the table)

    @property
    def judged(self) -> bool:
        """The interval gives a verdict; else the ratio is not a finding (the drift guard, too few steps)."""
        return self.verdict in VERDICTS

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
            "verdict": self.verdict, "judged": self.judged, "loss_delta": self.loss_delta,
            "loss_kind": self.loss_kind, "loss_note": self.loss_note, "memory_ratio": self.memory_ratio,
            "verdict_short": self.verdict_short or self.verdict, "verdict_note": self.verdict_note,
        }


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
    schedule: str = ""  # "14 steps x seq 256"
    apart: str | None = None  # why runs of the same model and task are in another group
    judged_note: str | None = None  # which phase the gates judge, when not the last

    @property
    def runs(self) -> list[Run]:
        return [r for v in self.variants for r in v.runs]

    def params(self) -> int | None:
        for run in self.runs:
            value = num(run.summary.model.params)
            if value is not None:
                return int(value)
        return None
