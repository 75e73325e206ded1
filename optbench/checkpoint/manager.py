"""One checkpoint manager per run: where its checkpoints live and which one it resumes from
(``plan``, decided once, before anything is built), loading it (``Manager.resume``), saving on the
steps that are due (``Manager.save``, which prunes to ``checkpoint.keep_last``) and what it did
(``Manager.record``: summary.json's ``applied.checkpoint``, an ``optbench.summary.CheckpointRecord``). The loop's component
(``optbench.run.loop.checkpoint_saver``) only tells it when a step ends; storage is ``store``, the rules
of resuming are ``resume``.

A checkpoint is checked once: the planned one by ``plan`` (world size, model, steps, config
changes), an older one by ``resume`` when the planned one's data does not load and the run falls
back to it. ``plan`` runs in the process that decides (rank 0, or the launcher of local workers,
which hands its plan to them) and every rank follows it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from optbench import distributed
from optbench.checkpoint import store
from optbench.checkpoint.resume import (
    ResumePoint,
    check_resumable,
    describe_changes,
    find_resume,
    model_signature,
)
from optbench.config import Config
from optbench.errors import ConfigError
from optbench.summary import CheckpointRecord

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Plan:
    """Where a run's checkpoints live, and the checkpoint it resumes (None: it starts fresh)."""

    root: Path
    resume: ResumePoint | None


def plan(cfg: Config, *, run_dir: Path, world_size: int, config: dict[str, Any]) -> Plan:
    """This process's plan: ``checkpoint.dir`` (locked for the run) and the checkpoint
    ``checkpoint.resume`` names, checked against this run (``config``: its resolved config). Raises
    ConfigError when it cannot be resumed."""
    root = store.checkpoint_root(cfg.checkpoint, run_dir=run_dir).absolute()
    point = find_resume(cfg.checkpoint, steps=cfg.train.steps, root=root, world_size=world_size, model=cfg.model, config=config)
    return Plan(root, point)


def agreed_plan(cfg: Config, *, machine: distributed.Machine, run_dir: Path, config: dict[str, Any]) -> Plan:
    """Rank 0's plan on every rank (under torchrun each rank's Hydra run directory may differ); a
    ConfigError there is raised on every rank."""
    outcome: tuple[str, Any]
    if machine.rank == 0:
        try:
            outcome = ("ok", plan(cfg, run_dir=run_dir, world_size=machine.world_size, config=config))
        except ConfigError as exc:
            outcome = ("error", str(exc))
        except Exception as exc:  # reaches the other ranks too, or they would wait in the broadcast forever
            distributed.broadcast_object(("failed", f"{type(exc).__name__}: {exc}"))
            raise
    else:
        outcome = ("", None)
    kind, value = distributed.broadcast_object(outcome)
    if kind == "error":
        raise ConfigError(value)
    if kind == "failed":
        raise RuntimeError(f"rank 0 could not plan the checkpoints: {value}")
    return value


class Manager:
    """The checkpoints of one run, bound to the objects they save and restore."""

    def __init__(self, plan: Plan, *, cfg: Config, config: dict[str, Any], config_hash: str, model: nn.Module,
                 optimizer: torch.optim.Optimizer, scheduler: Any, scaler: Any) -> None:
        self.plan = plan
        self.root = plan.root
        self.cfg = cfg
        self.config = config
        self.every, self.keep_last = cfg.checkpoint.every, cfg.checkpoint.keep_last
        self.meta = {"model": model_signature(cfg.model), "parallel": cfg.parallel.name, "config_hash": config_hash,
                     "config": config}
        self.state = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "scaler": scaler}
        self.resumed = store.Progress()  # where the loaded checkpoint left off (step 0: a fresh start)
        self.resumed_from: Path | None = None
        self.changes: list[dict[str, Any]] = []
        self.saved: list[str] = []
        self.skipped: list[str] = []

    # ----------------------------------------------------------------------------------- resume
    def resume(self) -> store.Progress:
        """Load the planned checkpoint (if any) into the run's objects; the loop then starts after
        its step. One whose data does not load falls back to the newest older one that does,
        checked here; when none loads, ConfigError."""
        point = self.plan.resume
        if point is None:
            return self.resumed
        candidates = [point.path, *store.older_whole(point.path)]
        failures: list[str] = []
        for index, candidate in enumerate(candidates):
            changes = point.changes if index == 0 else self._check(candidate)
            try:
                progress = store.load(candidate, **self.state)
            except (Exception, store.checkpoint_exception()) as exc:  # a failed load is overwritten by the next
                why = store.first_line(exc)
                log.warning("checkpoint %s does not load (%s)%s", candidate, why,
                            "; trying the one before it" if index + 1 < len(candidates) else "")
                failures.append(f"{candidate.name}: {why}")
                continue
            self._resumed(candidate, progress=progress, changes=changes, failures=failures)
            return progress
        raise ConfigError(
            f"no checkpoint in {point.path.parent} loads ({'; '.join(failures)}); restore them, or start over "
            "with checkpoint.resume=none in another checkpoint.dir / hydra.run.dir")

    def _check(self, path: Path) -> list[dict[str, Any]]:
        train = self.cfg.train
        return check_resumable(path, world_size=distributed.world_size(), steps=train.steps,
                               model=self.cfg.model, config=self.config)

    def _resumed(self, path: Path, *, progress: store.Progress, changes: list[dict[str, Any]],
                 failures: list[str]) -> None:
        log.info("Resumed from checkpoint %s (step %d)", path, progress.step)
        self.resumed, self.resumed_from, self.changes = progress, path, changes
        newer = [p for step, p in store.complete_checkpoints(path.parent) if step > progress.step]
        damaged = [(p.name, store.damage(p)) for p in newer]
        self.skipped = [f"{name}: {why}" for name, why in damaged if why] + failures
        if changes:
            log.warning("resuming %s at step %d under a changed config: %s; the summary and the report say so",
                        path, progress.step, describe_changes(changes))

    # ------------------------------------------------------------------------------------- save
    def due(self, done: int, *, last: bool) -> bool:
        """Whether a checkpoint is due after ``done`` steps (``last``: the run's last step)."""
        return self.every > 0 and (done % self.every == 0 or last)

    def save(self, done: int, *, first_loss: float | None) -> Path:
        """A checkpoint after ``done`` steps (every rank calls this), unless this run just saved it;
        returns its path. ``first_loss``: the run's first loss, which a resumed run reports."""
        path = store.step_dir(self.root, done)
        if self.saved and self.saved[-1] == path.name:
            return path
        train = self.cfg.train
        samples = self.resumed.samples_per_rank + (done - self.resumed.step) * (train.batch_size * train.grad_accum)
        progress = store.Progress(step=done, samples_per_rank=samples, first_loss=first_loss)
        path = store.save(self.root, **self.state, progress=progress, meta=self.meta, keep_last=self.keep_last)
        self.saved.append(path.name)
        return path

    def last(self) -> Path | None:
        """The newest checkpoint of this run: the last it saved, else the one it resumed."""
        return self.root / self.saved[-1] if self.saved else self.resumed_from

    def record(self) -> CheckpointRecord:
        name = f"every_{self.every}" if self.every else "on_stop"
        resumed = self.resumed_from is not None
        if resumed:
            name += f",resumed@{self.resumed.step}"
        if self.changes:
            name += ",config_changed"
        return CheckpointRecord(name=name, dir=str(self.root), save_every=self.every, keep_last=self.keep_last,
                      resumed_from=str(self.resumed_from) if resumed else None,
                      resumed_step=self.resumed.step if resumed else None, saved=list(self.saved),
                      skipped=list(self.skipped), config_changes=list(self.changes))
