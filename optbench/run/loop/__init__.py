"""The training loop as a short sequence over components.

``run_loop`` starts the components, fetches batches, runs ``optbench.training.step.train_step`` and
hands every component the ``StepState`` of the step just done; each component owns its cadence ("is
this my step?"). Whatever ends the loop, it finishes every component it started and puts the section
each returns into the run's ``RunSummary`` (``optbench.summary``). Adding a concern (a profiler,
early stopping) is adding a component to the list ``optbench.run.train`` builds, never editing the
others.

A component's life: its constructor only stores what it is given; ``start()`` does its setup (a probe,
a thread, a directory) inside the loop's ``try``, so ``finish()`` always follows. Components start and
run each step's hooks in list order and finish in the reverse order, so each one brackets those after
it (the list in ``optbench.run.train.loop_components`` says why it is in that order).

A component may also wrap the step (``around_step``: a memory tracker, the compile timer), take a
step out of the timed steps (``excludes``), run between micro-steps (``between_micro_steps``), or
end the run (raise from ``on_step``: ``Interrupted`` after a stop request, which every rank sees at
the same step; ``RunStopped`` with the component's own status, at a step the ranks agree on), or
veto a step's optimizer update (``accepts_update``: the loss-spike guard).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from optbench.config import Config
from optbench.distributed import max_across_ranks
from optbench.errors import Interrupted, RunStopped
from optbench.measure import Peak, StepClock
from optbench.outputs import RunOutputs
from optbench.run.preemption import StopRequest
from optbench.summary import LoopProgress, RunSummary
from optbench.tasks import Task
from optbench.training.step import StepContext, StepHooks, StepStats, train_step

log = logging.getLogger(__name__)


@dataclass
class RunContext:
    """What every component may read: built once, before the loop (``progress`` moves with it)."""

    cfg: Config
    model: nn.Module
    task: Task
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    scaler: torch.amp.GradScaler | None
    device: torch.device
    outputs: RunOutputs
    world_size: int
    tokens_per_step: int  # over every rank
    flops_per_token: int  # what the model really computes (a frozen base: no weight gradients)
    peak: Peak  # the FLOP/s peak behind every MFU of the run
    estimate_bytes: int | None = None  # the traced peak of this config (optbench estimate)
    start: int = 0  # steps already done (a resumed run)
    progress: LoopProgress = field(default_factory=LoopProgress)  # steps done, first and latest loss
    running: str = "start-up"  # what the loop is doing now (the watchdog names it)

    @property
    def total(self) -> int:
        return self.cfg.train.steps

    def mfu(self, tokens_per_s: float) -> float | None:
        if self.peak.flops is None:
            return None
        return self.flops_per_token * tokens_per_s / (self.peak.flops * self.world_size)


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

    def start(self) -> None:
        """Set up (probe, open, arm) right before the first step; ``finish`` follows whatever happens."""

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

    def finish(self, *, ranks_agree: bool) -> Any:
        """Tear down and return this component's section of the summary (None: nothing to record),
        whatever ended the loop, also after a ``start`` that raised. ``ranks_agree``: every rank left
        the loop at the same point, so collectives are safe."""
        return None


def run_loop(ctx: RunContext, *, batches: Iterable, components: list[Component], record: RunSummary) -> None:
    """Train from ``ctx.start`` to ``train.steps``; the sections of ``components`` (and the loop's
    progress) go into ``record``, whatever ends the loop."""
    step_ctx = StepContext(model=ctx.model, task=ctx.task, cfg=ctx.cfg, device=ctx.device, optimizer=ctx.optimizer,
                           scaler=ctx.scaler)
    hooks = step_hooks(components)
    started: list[Component] = []
    stop = StopRequest().install()
    ranks_agree = False
    iterator = None
    try:
        for component in components:
            started.append(component)
            component.start()
        iterator = iter(batches)
        _steps(ctx, step_ctx, batches=iterator, components=components, hooks=hooks, stop=stop)
        ranks_agree = True
    except (Interrupted, RunStopped):
        ranks_agree = True  # a stop request or a component's stop: every rank stops at the same step
        raise
    finally:
        _stop_loader_workers(iterator)
        stop.restore()
        record.add(dataclasses.replace(ctx.progress))
        failure = _finish_all(started, ranks_agree=ranks_agree, record=record)
        if failure is not None and sys.exc_info()[0] is None:  # not while the loop is ending with an error
            raise failure


def _stop_loader_workers(iterator: Any) -> None:
    """A DataLoader's worker processes stopped when the loop ends, whatever ended it. Left to the
    iterator's ``__del__``, a failed run's would wait for the collector (the error's traceback holds
    the iterator in a cycle), its workers up until then, and that collection would wait for them, 5 s
    after a failed climate run here, inside whatever the process runs next (a sweep's next job, in its
    timed steps). torch has no public call for it; Lightning's CombinedLoader calls the same one."""
    stop = getattr(iterator, "_shutdown_workers", None)
    if stop is not None:
        stop()


def _steps(ctx: RunContext, step_ctx: StepContext, *, batches: Any, components: list[Component], hooks: StepHooks,
           stop: StopRequest) -> None:
    cfg, clock, progress = ctx.cfg, StepClock(ctx.device), ctx.progress
    for step in range(ctx.start, ctx.total):
        timed = step >= ctx.start + cfg.measure.warmup_steps and not any(c.excludes(step) for c in components)
        with contextlib.ExitStack() as around:
            for component in components:
                around.enter_context(component.around_step(step, timed=timed))
            ctx.running = f"step {step}"
            clock.start()
            stats = train_step(step_ctx, batches, step=step, with_aux=step % cfg.loss_freq.every == 0, hooks=hooks)
            elapsed = clock.stop()
        # the job's step time is its slowest rank's; any rank's stop signal stops them all
        elapsed, stop_signal = max_across_ranks([elapsed, float(stop.signum or 0)], device=ctx.device)
        lr = ctx.scheduler.get_last_lr()[0]
        ctx.scheduler.step()
        if progress.first_loss is None:
            progress.first_loss = stats.loss
        progress.steps, progress.final_loss = step + 1, stats.loss
        state = StepState(step=step, stats=stats, elapsed_s=elapsed, lr=lr, timed=timed, stop_signal=int(stop_signal))
        ctx.running = f"the evaluation, checkpoint and logging after step {step}"
        for component in components:
            component.on_step(state)


def step_hooks(components: list[Component]) -> StepHooks:
    """The components' ``between_micro_steps`` and ``accepts_update``, where they have them."""
    def overridden(name: str) -> list[Component]:
        return [c for c in components if getattr(type(c), name) is not getattr(Component, name)]

    return StepHooks(between_micro_steps=tuple(c.between_micro_steps for c in overridden("between_micro_steps")),
                     vetoes=tuple(c.accepts_update for c in overridden("accepts_update")))


def _finish_all(components: list[Component], *, ranks_agree: bool, record: RunSummary) -> BaseException | None:
    """Every component's ``finish``, last started first, even when one raises (a profiler that
    cannot dump must not leave the watchdog armed or the progress bar open); each section goes into
    ``record`` as it is returned, so a component that finishes later (the trackers) reads those of
    the components after it. Returns the first error, which the loop raises once all are recorded."""
    first: BaseException | None = None
    for component in reversed(components):
        try:
            record.add(component.finish(ranks_agree=ranks_agree))
        except BaseException as exc:  # noqa: BLE001 - raised by run_loop, after the others
            log.error("%s.finish failed: %s", type(component).__name__, exc)
            first = first or exc
    return first
