"""Machine speed: a short matmul probe before the first step and after the last
(``summary.json`` ``machine_speed.before/after/moved``), so ``optbench report`` and ``compare``
can withhold a speed verdict when the machine itself got faster or slower by more than the effect
claimed (a shared machine that got busier half-way through a sweep). It brackets every other
measured component: first in the list, it probes before they start and after they finish."""

from __future__ import annotations

from typing import Any

from optbench.measure import machine_speed_probe
from optbench.run.loop import Component, RunContext
from optbench.summary import MachineSpeed


class MachineSpeedProbe(Component):
    def __init__(self, ctx: RunContext) -> None:
        self.ctx = ctx
        self.before: dict[str, Any] | None = None

    def start(self) -> None:
        self.before = machine_speed_probe(self.ctx.device)

    def finish(self, *, ranks_agree: bool) -> MachineSpeed:
        after = machine_speed_probe(self.ctx.device)
        moved = after["flops"] / self.before["flops"] - 1 if self.before else None
        return MachineSpeed(before=self.before, after=after, moved=moved)
