"""What the plan (its optimization-phases document, phases 1-9) claims, as numbers optbench can hold a
measurement against: its phase-9 gates, its headline, and each phase's expected epoch-time gain."""

from __future__ import annotations

import re
from dataclasses import dataclass

from optbench.report.options import Gates

PLAN = "plan 001 (phases 1-9)"
# The plan's phase 9 gates: "assert speedup >= 3.0", "assert loss_delta < 0.001", and "Memory usage
# safe: <50GB/GPU" against a baseline of "~15GB/GPU": 50/15 as a ratio, so that it means the same at
# any model scale.
PLAN_GATES = Gates(min_speedup=3.0, max_loss_delta=0.001, max_memory_ratio=round(50 / 15, 2))
PLAN_HEADLINE = "5-10x (conservative 3-5x) for phases 1-8"
PROJECTED_WORLD_SIZES = (2, 4)  # the plan's 2-GPU and 4-GPU setups


@dataclass(frozen=True)
class Claim:
    """The plan's expected epoch-time gain of one phase over the previous one, read as a speedup:
    "15-30% faster" is 1.15-1.30x."""

    low: float
    high: float
    text: str


# plan 001, "Success Criteria" of each phase ("Epoch time improves: Expect ...")
PLAN_CLAIMS: dict[int, Claim] = {
    1: Claim(1.15, 1.30, "15-30% faster (7 -> 5-6 min/epoch)"),
    2: Claim(1.30, 1.60, "1.3-1.6x faster (5 -> 3-4 min/epoch)"),
    3: Claim(1.20, 1.30, "20-30% faster (3-4 -> 2.5-3 min/epoch)"),
    4: Claim(1.05, 1.10, "5-10% faster"),
    5: Claim(1.15, 1.25, "15-25% faster despite CPU overhead"),
    6: Claim(1.05, 1.10, "5-10% faster"),
    7: Claim(1.10, 1.20, "10-20% faster"),
    8: Claim(1.05, 1.15, "5-15% faster if FlexAttention used (+3-5% faster optimizer steps)"),
}


def phase_number(name: str | None) -> int | None:
    match = re.match(r"(\d+)", name or "")
    return int(match.group(1)) if match else None


def claim_between(previous: str | None, phase: str | None) -> tuple[float, float] | None:
    """The plan's claimed speedup of ``phase`` over ``previous``: the product of the per-phase claims
    in between (phases sharing a number, like the two phase 7s, count once)."""
    first, last = phase_number(previous), phase_number(phase)
    if first is None or last is None or last <= first:
        return None
    low = high = 1.0
    for number in range(first + 1, last + 1):
        if number not in PLAN_CLAIMS:
            return None
        low, high = low * PLAN_CLAIMS[number].low, high * PLAN_CLAIMS[number].high
    return low, high


def claim_text(span: tuple[float, float] | None) -> str:
    return "-" if span is None else f"{span[0]:.2f}-{span[1]:.2f}x"
