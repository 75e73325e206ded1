"""Machine speed: a short matmul probe before the first step and after the last
(``summary.json`` ``machine_speed.before/after/moved``), so ``optbench report`` and ``compare``
can withhold a speed verdict when the machine itself got faster or slower by more than the effect
claimed (a shared machine that got busier half-way through a sweep)."""

from __future__ import annotations

from optbench.measure import record_machine_speed
from optbench.run.loop import Component, RunContext


class MachineSpeed(Component):
    def __init__(self, ctx: RunContext) -> None:
        self.ctx = ctx
        record_machine_speed(ctx.summary, "before", ctx.device)  # built right before the loop starts

    def finish(self, *, ranks_agree: bool) -> None:
        record_machine_speed(self.ctx.summary, "after", self.ctx.device)
