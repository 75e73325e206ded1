"""The loop's side of the run's ``optbench.checkpoint.Manager``, as thin as torchtitan's
checkpointer: after each step, save when the manager says the step is due (every
``checkpoint.every`` steps and after the last); on a stop request (SIGTERM/SIGINT on any rank) save
and end the run as ``interrupted``, resumable with ``checkpoint.resume=auto`` in the same run directory."""

from __future__ import annotations

import signal

from optbench.checkpoint import Manager
from optbench.errors import Interrupted
from optbench.run.loop import Component, RunContext, StepState
from optbench.summary import CheckpointRecord


class CheckpointSaver(Component):
    """Saves through the run's checkpoint manager: when a step is due, and on a stop request."""

    def __init__(self, ctx: RunContext, *, manager: Manager) -> None:
        self.ctx = ctx
        self.manager = manager

    def on_step(self, state: StepState) -> None:
        total = self.ctx.total
        stopping = bool(state.stop_signal) and state.done != total
        if stopping or self.manager.due(state.done, last=state.done == total):
            path = self.manager.save(state.done, first_loss=self.ctx.progress.first_loss)
        if stopping:
            name = signal.Signals(state.stop_signal).name
            raise Interrupted(f"stopped by {name} after step {state.step} ({state.done} of {total} steps done); "
                              f"checkpoint {path}; checkpoint.resume=auto in the same run directory continues it",
                              signum=state.stop_signal)

    def finish(self, *, ranks_agree: bool) -> CheckpointRecord:
        return self.manager.record()
