"""Checkpoints and stop requests: resume before the loop, save every ``checkpoint.every`` steps and
after the last, and on a stop request (SIGTERM/SIGINT on any rank) save and end the run as
``interrupted``, resumable with ``checkpoint.resume=auto`` in the same run directory."""

from __future__ import annotations

import logging
import signal
from pathlib import Path
from typing import Any

from optbench.checkpoint import resume
from optbench.checkpoint import store as checkpoint
from optbench.config import Config
from optbench.distributed import Machine, broadcast_object
from optbench.errors import ConfigError, Interrupted
from optbench.run.loop import Component, RunContext, StepState

log = logging.getLogger(__name__)


def checkpoint_plan(cfg: Config, *, machine: Machine, run_dir: Path,
                    config: dict[str, Any] | None = None) -> tuple[Path, Path | None]:
    """Rank 0 decides where checkpoints live and which one to resume from; every rank follows
    (under torchrun each rank's Hydra run directory may differ). ``config``: the run's resolved
    config, checked against the checkpoint's (a change that makes it meaningless is refused)."""
    plan: tuple[str, Any, Any]
    if machine.rank == 0:
        root = checkpoint.checkpoint_root(cfg.checkpoint, run_dir=run_dir).absolute()
        try:
            plan = ("ok", root, resume.find_resume(cfg.checkpoint, steps=cfg.train.steps, root=root,
                                                   world_size=machine.world_size, model=cfg.model, config=config))
        except ConfigError as exc:
            plan = ("error", str(exc), None)
        except Exception as exc:  # reaches the other ranks too, or they would wait in the broadcast forever
            broadcast_object(("failed", f"{type(exc).__name__}: {exc}", None))
            raise
    else:
        plan = ("", None, None)
    kind, first, second = broadcast_object(plan)
    if kind == "error":
        raise ConfigError(first)
    if kind == "failed":
        raise RuntimeError(f"rank 0 could not plan the checkpoints: {first}")
    return first, second


class Checkpointing(Component):
    def __init__(self, ctx: RunContext, *, root: Path, resume_from: Path | None, meta: dict[str, Any]) -> None:
        self.ctx = ctx
        self.root = root
        self.resume_from = resume_from
        self.every, self.keep_last = ctx.cfg.checkpoint.every, ctx.cfg.checkpoint.keep_last
        self.meta = meta
        self.resumed = checkpoint.Progress()
        self.saved: list[str] = []
        self.skipped: list[str] = []  # newer checkpoints that did not load, and why
        self.config_changes: list[dict[str, Any]] = []  # what differs from the config it was written under

    def resume(self) -> None:
        """Load the checkpoint to resume from (if any) into the run's model, optimizer, scheduler
        and scaler; the loop then starts after its step. A damaged one falls back to the newest
        older one that loads; a changed config is recorded (or refused, see resume.REFUSED_CHANGES)."""
        ctx = self.ctx
        if self.resume_from is not None:
            loaded, self.resumed, failed = checkpoint.load_newest(
                self.resume_from, model=ctx.model, optimizer=ctx.optimizer, scheduler=ctx.scheduler,
                scaler=ctx.scaler)
            newer = [p for step, p in checkpoint.complete_checkpoints(loaded.parent) if step > self.resumed.step]
            damaged = [(p.name, checkpoint.damage(p)) for p in newer]
            self.skipped = [f"{name}: {why}" for name, why in damaged if why] + failed
            self.resume_from = loaded
            ctx.start, ctx.first_loss = self.resumed.step, self.resumed.first_loss
            self.config_changes = resume.config_changes(checkpoint.read_meta(loaded).get("config"),
                                                            ctx.summary["config"])
            resume.check_config_changes(loaded, self.config_changes)
            if self.config_changes:
                log.warning("resuming %s at step %d under a changed config: %s; the summary and the report "
                            "say so", loaded, self.resumed.step, resume.describe_changes(self.config_changes))
        ctx.summary["applied"]["checkpoint"] = self.describe()

    def describe(self) -> dict[str, Any]:
        name = f"every_{self.every}" if self.every else "on_stop"
        resumed = self.resume_from is not None
        if resumed:
            name += f",resumed@{self.resumed.step}"
        if self.config_changes:
            name += ",config_changed"
        return {"name": name, "dir": str(self.root), "save_every": self.every, "keep_last": self.keep_last,
                "resumed_from": str(self.resume_from) if resumed else None,
                "resumed_step": self.resumed.step if resumed else None, "saved": self.saved,
                "skipped": self.skipped, "config_changes": self.config_changes}

    def due(self, done: int) -> bool:
        return self.every > 0 and (done % self.every == 0 or done == self.ctx.total)

    def on_step(self, state: StepState) -> None:
        stopping = bool(state.stop_signal) and state.done != self.ctx.total
        if stopping or self.due(state.done):
            path = self.save(state.done)
        if stopping:
            name = signal.Signals(state.stop_signal).name
            raise Interrupted(f"stopped by {name} after step {state.step} ({state.done} of {self.ctx.total} "
                              f"steps done); checkpoint {path}; checkpoint.resume=auto in the same run directory "
                              "continues it", signum=state.stop_signal)

    def save(self, done: int) -> Path:
        ctx, train = self.ctx, self.ctx.cfg.train
        samples = self.resumed.samples_per_rank + (done - self.resumed.step) * (train.batch_size * train.grad_accum)
        progress = checkpoint.Progress(step=done, samples_per_rank=samples, first_loss=ctx.first_loss)
        path = checkpoint.save(self.root, model=ctx.model, optimizer=ctx.optimizer, scheduler=ctx.scheduler,
                               scaler=ctx.scaler, progress=progress, meta=self.meta, keep_last=self.keep_last)
        self.saved.append(path.name)
        return path
