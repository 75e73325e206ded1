"""Which checkpoint a run resumes from, and whether it may: the newest whole one in the checkpoint
directory (or the one ``checkpoint.resume`` names), refused for another world size or model shape, and
the config changes since it was written (recorded, or refused where they make it meaningless).
Each checkpoint a run loads is checked once (``check_resumable``): the one it plans to resume
(``find_resume``), or an older one it falls back to (``optbench.checkpoint.Manager.resume``)."""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from optbench.checkpoint.store import META_FILE, complete_checkpoints, damage, lock_root, read_meta
from optbench.config import CheckpointConfig, ModelConfig, upgrade_config
from optbench.errors import ConfigError
from optbench.outputs import flatten

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ResumePoint:
    """A checkpoint this run may resume, checked; ``changes``: the config changes since it was
    written (``config_changes``), recorded in the summary."""

    path: Path
    changes: list[dict[str, Any]]


def find_resume(
    cfg: CheckpointConfig, *, steps: int, root: Path, world_size: int, model: ModelConfig,
    config: dict[str, Any] | None = None
) -> ResumePoint | None:
    """The checkpoint ``checkpoint.resume`` names (auto: the newest under ``root``, if any; none: no
    checkpoint, and ``root`` must hold none; else a checkpoint directory, or a directory of them),
    checked against this run (``check_resumable``, ConfigError when it cannot be resumed). A damaged
    checkpoint is skipped for the newest older one that looks whole (see ``damage``); when none
    does, ConfigError."""
    lock_root(root)
    if cfg.resume == "none":
        existing = complete_checkpoints(root)
        if existing:
            raise ConfigError(
                f"checkpoint.resume=none but {root} already holds checkpoints (newest: step {existing[-1][0]}); "
                "use checkpoint.resume=auto to continue that run, or another checkpoint.dir / "
                "hydra.run.dir to start a new one"
            )
        return None
    if cfg.resume == "auto":
        existing = complete_checkpoints(root)
        if not existing:
            return None
        path = _newest_whole([p for _, p in existing])
    else:
        path = _explicit_checkpoint(Path(cfg.resume))
    return ResumePoint(path, check_resumable(path, world_size=world_size, steps=steps, model=model,
                                             config=config))


def _newest_whole(paths: list[Path]) -> Path:
    """The newest of ``paths`` (oldest first) that is not damaged; warns for each one skipped."""
    skipped = []
    for path in reversed(paths):
        why = damage(path)
        if why is None:
            return path
        log.warning("skipping damaged checkpoint %s: %s", path, why)
        skipped.append(f"{path.name}: {why}")
    raise ConfigError(
        f"no checkpoint in {paths[0].parent} can be loaded ({'; '.join(skipped)}); restore them, or start "
        "over with checkpoint.resume=none in another checkpoint.dir / hydra.run.dir"
    )


def _explicit_checkpoint(path: Path) -> Path:
    if (path / META_FILE).is_file() and (path / ".metadata").is_file():
        why = damage(path)
        if why is not None:
            raise ConfigError(f"checkpoint.resume={path} cannot be loaded: {why}; name another checkpoint, "
                              "or use checkpoint.resume=auto to take the newest one that loads")
        return path
    inside = complete_checkpoints(path)
    if inside:
        return _newest_whole([p for _, p in inside])
    raise ConfigError(
        f"checkpoint.resume={path}: no optbench checkpoint there (a step-NNNNNNNN directory with "
        f"{META_FILE} and .metadata, or a directory of them); use checkpoint.resume=auto or checkpoint.resume=none"
    )


def check_resumable(path: Path, *, world_size: int, steps: int, model: ModelConfig,
                    config: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """ConfigError when this run cannot continue the checkpoint at ``path``: another world size or
    model, nothing left to train, or (given this run's resolved ``config``) a change of config that
    makes the checkpoint meaningless (``REFUSED_CHANGES``); returns the other changes, which the
    run records."""
    meta = read_meta(path)
    if meta["world_size"] != world_size:
        raise ConfigError(
            f"checkpoint {path} was written by {meta['world_size']} ranks but this run has {world_size}: "
            "resuming with another world size is not supported (the data order and RNG states are per "
            f"rank); resume with parallel.nproc_per_node={meta['world_size']} (or the same torchrun world), "
            "or start over with checkpoint.resume=none in another checkpoint.dir"
        )
    wanted = model_signature(model)
    if meta["model"] != wanted:
        saved = meta["model"]
        changed = ", ".join(f"model.{k}={saved.get(k)}" for k in sorted(wanted) if saved.get(k) != wanted[k])
        raise ConfigError(
            f"checkpoint {path} holds another model ({changed}); "
            "resume with the same model, or start over with checkpoint.resume=none in another checkpoint.dir"
        )
    if meta["step"] >= steps:
        raise ConfigError(
            f"checkpoint {path} is at step {meta['step']} and train.steps={steps}: nothing is left to train; "
            "raise train.steps to train on; to start fresh, give a new run directory: hydra.run.dir=outputs/runs/NEW "
            "(or checkpoint.resume=none with another checkpoint.dir)"
        )
    changes = [] if config is None else config_changes(meta.get("config"), config)
    check_config_changes(path, changes)
    return changes


# what a resumed run may change without changing what it trains: how long it trains, where and how
# often it saves, logs and evaluates. Any other change is recorded (log, summary, report).
RESUME_FREE = frozenset({
    "train.steps", "checkpoint.resume", "checkpoint.every", "checkpoint.keep_last", "checkpoint.dir",
    "log.progress", "log.every", "train.eval_every", "measure.track_memory",
})
# changes that make the checkpoint meaningless for this run (the model's shape and the world size
# are checked on their own)
REFUSED_CHANGES = {
    "optimizer.name": "its optimizer state belongs to another optimizer",
    "precision.grad_scaler": "its loss-scaler state and this run's do not match (fp16 and the others)",
    "task.name": "it was trained on another task",
}


def config_changes(saved: dict[str, Any] | None, current: dict[str, Any]) -> list[dict[str, Any]]:
    """``[{"key", "was", "now"}]``: what differs between the resolved config a checkpoint was
    written under and this run's (the model, checked on its own, and RESUME_FREE aside). A config
    saved under older key names is read under the current ones (``upgrade_config``)."""
    if not isinstance(saved, dict):
        return []
    was, now = flatten(upgrade_config(saved)), flatten(current)
    keys = sorted(set(was) | set(now))
    return [{"key": k, "was": was.get(k), "now": now.get(k)} for k in keys
            if was.get(k) != now.get(k) and k not in RESUME_FREE and not k.startswith("model.")]


def check_config_changes(path: Path, changes: list[dict[str, Any]]) -> None:
    """ConfigError for a change that makes the checkpoint at ``path`` meaningless."""
    for change in changes:
        why = REFUSED_CHANGES.get(change["key"])
        if why:
            raise ConfigError(
                f"checkpoint {path} was written with {change['key']}={change['was']} and this run has "
                f"{change['now']}: {why}; resume with {change['key']}={change['was']}, or start over with "
                "checkpoint.resume=none in another checkpoint.dir / hydra.run.dir"
            )


def describe_changes(changes: list[dict[str, Any]]) -> str:
    return ", ".join(f"{c['key']} {c['was']} -> {c['now']}" for c in changes)


def model_signature(model: ModelConfig) -> dict[str, Any]:
    """The model's shape as recorded in a checkpoint (the preset's name aside)."""
    return {k: v for k, v in dataclasses.asdict(model).items() if k != "name"}
