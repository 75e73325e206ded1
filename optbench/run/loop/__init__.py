"""The training loop as a short sequence over components.

``run_loop`` fetches batches, runs ``optbench.training.step.train_step`` and hands every component the
``StepState`` of the step just done; each component owns its cadence ("is this my step?") and
writes its own part of ``summary.json`` in ``finish``. Adding a concern (a profiler, early
stopping) is adding a component to the list ``optbench.run.train`` builds, never editing the others.

A component may also wrap the step (``around_step``: a memory tracker, the compile timer), take a
step out of the timed steps (``excludes``), run between micro-steps (``between_micro_steps``), or
end the run (raise from ``on_step``: ``Interrupted`` after a stop request, which every rank sees at
the same step; ``RunStopped`` with the component's own status, at a step the ranks agree on), or
veto a step's optimizer update (``accepts_update``: the loss-spike guard).
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from optbench.config import Config
from optbench.distributed import max_across_ranks
from optbench.errors import Interrupted, RunStopped
from optbench.measure import Peak, StepClock
from optbench.outputs import RunOutputs
from optbench.run.preemption import StopRequest
from optbench.tasks import Task
from optbench.training.step import StepStats, train_step

log = logging.getLogger(__name__)


@dataclass
class RunContext:
    """What every component may read: built once, before the loop."""

    cfg: Config
    model: nn.Module
    task: Task
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    scaler: torch.amp.GradScaler | None
    device: torch.device
    outputs: RunOutputs
    summary: dict[str, Any]
    tokens_per_step: int
    peak: Peak  # the FLOP/s peak behind every MFU of the run
    start: int = 0  # steps already done (a resumed run)
    first_loss: float | None = None  # the run's first loss (a resumed run's from its checkpoint)

    @property
    def total(self) -> int:
        return self.cfg.train.steps

    def mfu(self, tokens_per_s: float) -> float | None:
        if self.peak.flops is None:
            return None
        world = self.summary["world_size"] or 1
        return self.summary["model"]["flops_per_token"] * tokens_per_s / (self.peak.flops * world)


@dataclass
class StepState:
    """One finished step, as every component sees it."""

    step: int  # 0-based index of the step just done
    stats: StepStats
    elapsed_s: float  # the slowest rank's step time
    lr: float  # the learning rate the step used
    timed: bool  # counts towards the run's step time
    stop_signal: int  # a stop signal any rank received (0: none)

    @property
    def done(self) -> int:
        return self.step + 1


class Component:
    """A concern of the loop. Every hook is optional; the defaults do nothing."""

    def excludes(self, step: int) -> bool:
        """True to leave ``step`` out of the timed steps (its own work would distort them)."""
        return False

    def around_step(self, step: int, *, timed: bool) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def between_micro_steps(self) -> None:
        pass

    def accepts_update(self, step: int, *, loss: float, grad_norm: float) -> bool:
        """False to skip this step's optimizer update (the step's loss is the global batch's,
        the same on every rank, so the ranks agree). Called before the update."""
        return True

    def on_step(self, state: StepState) -> None:
        pass

    def finish(self, *, ranks_agree: bool) -> None:
        """Write this component's part of the summary, whatever ended the loop. ``ranks_agree``:
        every rank left the loop at the same point, so collectives are safe."""


def run_loop(ctx: RunContext, *, batches: Iterable, components: list[Component]) -> None:
    cfg = ctx.cfg
    clock = StepClock(ctx.device)
    batch_iter = iter(batches)
    micro_hooks = [c.between_micro_steps for c in components
                   if type(c).between_micro_steps is not Component.between_micro_steps]
    vetoes = [c for c in components if type(c).accepts_update is not Component.accepts_update]
    ctx.summary["steps"] = ctx.start  # a resumed run has done these already
    if ctx.first_loss is not None:  # a resumed run: its loss so far is the checkpoint's
        ctx.summary["loss"].update(first=ctx.first_loss, final=ctx.first_loss)
    stop = StopRequest().install()
    ranks_agree = False
    try:
        for step in range(ctx.start, ctx.total):
            timed = step >= ctx.start + cfg.measure.warmup_steps and not any(c.excludes(step) for c in components)
            with contextlib.ExitStack() as around:
                for component in components:
                    around.enter_context(component.around_step(step, timed=timed))
                clock.start()
                stats = train_step(
                    ctx.model, task=ctx.task, optimizer=ctx.optimizer, batches=batch_iter, device=ctx.device,
                    cfg=cfg, step=step, scaler=ctx.scaler, with_aux=step % cfg.loss_freq.every == 0,
                    between_micro_steps=(lambda: [hook() for hook in micro_hooks]) if micro_hooks else None,
                    accept_update=(lambda loss, norm, step=step: all(
                        [c.accepts_update(step, loss=loss, grad_norm=norm) for c in vetoes])) if vetoes else None,
                )
                elapsed = clock.stop()
            # the job's step time is its slowest rank's; any rank's stop signal stops them all
            elapsed, stop_signal = max_across_ranks([elapsed, float(stop.signum or 0)], device=ctx.device)
            lr = ctx.scheduler.get_last_lr()[0]
            ctx.scheduler.step()
            if ctx.first_loss is None:
                ctx.first_loss = stats.loss
            ctx.summary["steps"] = step + 1
            ctx.summary["loss"].update(first=ctx.first_loss, final=stats.loss)
            state = StepState(step=step, stats=stats, elapsed_s=elapsed, lr=lr, timed=timed,
                              stop_signal=int(stop_signal))
            for component in components:
                component.on_step(state)
        ranks_agree = True
    except (Interrupted, RunStopped):
        ranks_agree = True  # a stop request or a component's stop: every rank stops at the same step
        raise
    finally:
        stop.restore()
        _finish_all(components, ranks_agree=ranks_agree)


def _finish_all(components: list[Component], *, ranks_agree: bool) -> None:
    """Every component's ``finish``, even when one raises (a profiler that cannot dump must not leave
    the watchdog armed or the progress bar open); the first error is raised once all have run,
    unless the loop is already ending with one."""
    first: BaseException | None = None
    for component in components:
        try:
            component.finish(ranks_agree=ranks_agree)
        except BaseException as exc:  # noqa: BLE001 - re-raised below, after the others
            log.error("%s.finish failed: %s", type(component).__name__, exc)
            first = first or exc
    if first is not None and sys.exc_info()[0] is None:
        raise first
