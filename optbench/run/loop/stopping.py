"""Ending a run on purpose before ``train.steps``, each with its own status (never ``completed``):

* ``EarlyStopping`` (``stopping.patience``): after each evaluation, stop as ``stopped_early`` once
  ``patience`` evaluations in a row did not improve ``stopping.metric`` (the eval loss, or any eval
  metric such as the climate task's ``nrmse/temperature``) by more than ``min_delta``.
* ``LossSpikeGuard`` (``stopping.spike_factor``): a step whose loss exceeds ``spike_factor`` x the
  median of the last ``spike_window`` accepted losses is a spike; ``skip`` vetoes its optimizer
  update (and ``max_skips`` in a row end the run as ``loss_spike``), ``stop`` ends it at once.
* ``TimeBudget`` (``run.time_limit_s``): when the next step would end past the budget, save a
  checkpoint and stop as ``time_limit``; ``checkpoint.resume=auto`` in the same run directory goes on.

The eval results and losses these read are the same on every rank, and the time budget's decision
is the slowest rank's, so every rank stops at the same step.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections import deque
from typing import Any

from optbench.checkpoint import Manager
from optbench.distributed import max_across_ranks
from optbench.errors import ConfigError, RunStopped
from optbench.run.loop import Component, RunContext, StepState
from optbench.run.loop.evaluation import Evaluation
from optbench.summary import EarlyStoppingRecord, SpikeRecord, TimeBudgetRecord

log = logging.getLogger(__name__)


class EarlyStopping(Component):
    """Built for ``stopping.patience`` > 0 (preflight: with ``train.eval_every``); after the evaluation."""

    def __init__(self, ctx: RunContext, *, evaluation: Evaluation) -> None:
        self.ctx = ctx
        self.cfg = ctx.cfg.stopping
        self.evaluation = evaluation
        self.best: float | None = None
        self.best_step: int | None = None
        self.since_best = 0
        self.stopped_at: int | None = None

    def _value(self, result: dict[str, float]) -> float:
        metric = self.cfg.metric
        if metric not in result:
            raise ConfigError(f"stopping.metric={metric} is not an eval metric of this task; choose one of: "
                              f"{', '.join(sorted(result))}")
        return float(result[metric])

    def _improved(self, value: float) -> bool:
        if self.best is None:
            return True
        delta = self.best - value if self.cfg.mode == "min" else value - self.best
        return delta > self.cfg.min_delta

    def on_step(self, state: StepState) -> None:
        if not self.evaluation.due(state.done) or self.evaluation.result is None:
            return
        value = self._value(self.evaluation.result)
        if self._improved(value):
            self.best, self.best_step, self.since_best = value, state.step, 0  # 0-based, as metrics.jsonl
            return
        self.since_best += 1
        if self.since_best >= self.cfg.patience and state.done < self.ctx.total:
            self.stopped_at = state.step
            raise RunStopped("stopped_early", (
                f"{self.cfg.metric} did not improve by more than {self.cfg.min_delta} in {self.cfg.patience} "
                f"evaluations (best {self.best:.6g} at step {self.best_step}); stopped after step {state.step} "
                f"({state.done}/{self.ctx.total} done)"))

    def finish(self, *, ranks_agree: bool) -> EarlyStoppingRecord:
        return EarlyStoppingRecord(
            metric=self.cfg.metric, mode=self.cfg.mode, patience=self.cfg.patience, min_delta=self.cfg.min_delta,
            best=self.best, best_step=self.best_step, evals_without_improvement=self.since_best,
            stopped_at_step=self.stopped_at)


class LossSpikeGuard(Component):
    """Built for ``stopping.spike_factor`` set."""

    def __init__(self, ctx: RunContext) -> None:
        self.ctx = ctx
        self.cfg = ctx.cfg.stopping
        self.recent: deque[float] = deque(maxlen=self.cfg.spike_window)
        self.spikes: list[dict[str, Any]] = []
        self.in_a_row = 0

    def accepts_update(self, step: int, *, loss: float, grad_norm: float) -> bool:
        factor = self.cfg.spike_factor
        full = len(self.recent) == self.recent.maxlen
        median = statistics.median(self.recent) if self.recent else None
        if not full or median is None or loss <= factor * median:
            self.recent.append(loss)
            self.in_a_row = 0
            return True
        self.in_a_row += 1
        stop = self.cfg.spike_action == "stop" or self.in_a_row >= self.cfg.max_skips
        self.spikes.append({"step": step, "loss": loss, "median": median, "action": "stop" if stop else "skip"})
        what = f"loss {loss:.6g} at step {step} is above {factor} x the median {median:.6g} of the last " \
               f"{len(self.recent)} losses"
        if self.cfg.spike_action == "stop":
            raise RunStopped("loss_spike", f"{what}; stopped before its update (stopping.spike_action=stop)")
        if stop:
            raise RunStopped("loss_spike", f"{what}; the {self.in_a_row}th spike in a row "
                                           f"(stopping.max_skips={self.cfg.max_skips}); stopped before its update")
        log.warning("%s: update skipped (%d in a row)", what, self.in_a_row)
        return False

    def finish(self, *, ranks_agree: bool) -> SpikeRecord:
        return SpikeRecord(factor=self.cfg.spike_factor, window=self.cfg.spike_window, action=self.cfg.spike_action,
                           skipped_steps=[s["step"] for s in self.spikes if s["action"] == "skip"],
                           events=self.spikes)


class TimeBudget(Component):
    """Built for ``run.time_limit_s`` set; saves through the run's checkpoint manager."""

    def __init__(self, ctx: RunContext, *, checkpoint_manager: Manager, clock=time.monotonic) -> None:
        self.ctx = ctx
        self.budget_s = ctx.cfg.run.time_limit_s
        self.checkpoint_manager = checkpoint_manager
        self.clock = clock
        self.started = self.last = 0.0
        self.longest_step_s = 0.0
        self.stopped_at: int | None = None

    def start(self) -> None:
        self.started = self.last = self.clock()

    def on_step(self, state: StepState) -> None:
        now = self.clock()
        if state.timed:  # the step with its eval/checkpoint; warm-up steps (compilation) would overstate it
            self.longest_step_s = max(self.longest_step_s, now - self.last)
        self.last = now
        over = now - self.started + self.longest_step_s > self.budget_s
        if self.ctx.world_size > 1:  # the slowest rank decides for all
            over = bool(max_across_ranks([float(over)], device=self.ctx.device)[0])
        if not over or state.done == self.ctx.total:
            return
        path = self.checkpoint_manager.save(state.done, first_loss=self.ctx.progress.first_loss)  # unless just saved
        self.stopped_at = state.step
        raise RunStopped("time_limit", (
            f"run.time_limit_s={self.budget_s:g} reached after step {state.step} ({state.done}/{self.ctx.total} "
            f"done, {now - self.started:.1f} s in the loop); checkpoint {path}; checkpoint.resume=auto in the same "
            "run directory continues it"))

    def finish(self, *, ranks_agree: bool) -> TimeBudgetRecord:
        return TimeBudgetRecord(time_limit_s=self.budget_s, loop_s=self.clock() - self.started,
                                stopped_at_step=self.stopped_at)
