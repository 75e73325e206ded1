"""The run in MLflow and W&B (``log.trackers``; ``optbench.tracking``): connected in ``start()``
(the config as parameters, the sweep's and job's tags), the scalars TensorBoard gets every
``log.every`` steps, and in ``finish()`` the summary's figures and the run's end: FINISHED, or
FAILED / KILLED when the loop ends with an error or a stop request.

It finishes after every component but the watchdog (second in ``loop_components``), so the
sections of the others are already in the record (``run_loop`` places each as it is returned)."""

from __future__ import annotations

import sys
from pathlib import Path

from optbench.errors import Interrupted, RunStopped
from optbench.run.loop import Component, RunContext, StepState
from optbench.summary import RunSummary
from optbench.tracking import RunIdentity, Tracker, build_trackers


def run_identity(run_dir: Path, overrides: list[str]) -> RunIdentity:
    """This run's identity; a job of a Hydra multirun names its sweep and job number."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN:
        hydra = HydraConfig.get()
        return RunIdentity(run_dir=run_dir.resolve(), sweep_dir=Path(hydra.sweep.dir).resolve(),
                           job=hydra.job.num, overrides=list(overrides))
    return RunIdentity(run_dir=run_dir.resolve(), overrides=list(overrides))


class Tracking(Component):
    def __init__(self, ctx: RunContext, *, record: RunSummary) -> None:
        self.ctx = ctx
        self.record = record
        self.trackers: list[Tracker] = []

    def start(self) -> None:
        identity = run_identity(self.ctx.outputs.run_dir, self.record.overrides)
        for tracker in build_trackers(self.ctx.cfg.log):
            self.trackers.append(tracker)  # finish() closes every tracker that was started
            tracker.start(identity, self.record.config)

    def on_step(self, state: StepState) -> None:
        ctx, stats = self.ctx, state.stats
        if state.done % ctx.cfg.log.every and state.done != ctx.total:
            return
        tokens_per_s = ctx.tokens_per_step / state.elapsed_s
        scalars = {"loss/train": stats.loss, "lr": state.lr, "grad_norm": stats.grad_norm,
                   "step_time_s": state.elapsed_s, "throughput/tokens_per_s": tokens_per_s,
                   "throughput/mfu": ctx.mfu(tokens_per_s)}
        for tracker in self.trackers:
            tracker.log_scalars(state.step, scalars)

    def finish(self, *, ranks_agree: bool) -> None:
        status, error = _ending()
        first: BaseException | None = None
        for tracker in self.trackers:
            try:
                tracker.finish(status=status, error=error, record=self.record)
            except Exception as exc:  # noqa: BLE001 - the other trackers still close; raised after
                first = first or exc
        if first is not None:
            raise first


def _ending() -> tuple[str, str | None]:
    """How the loop is ending, from the exception it is ending with (none: completed)."""
    exc = sys.exc_info()[1]
    if exc is None:
        return "completed", None
    if isinstance(exc, Interrupted | KeyboardInterrupt):
        return "interrupted", str(exc) or "interrupted"
    if isinstance(exc, RunStopped):
        return exc.status, str(exc)
    return "failed", f"{type(exc).__name__}: {exc}".splitlines()[0]
