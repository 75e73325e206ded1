"""Sharded, atomic, exactly resumable checkpoints with torch.distributed.checkpoint (DCP).

Where they live: ``train.checkpoint_dir``, by default ``<run dir>/checkpoints``, one directory per
checkpoint named ``step-00000012`` (12 optimizer steps done) holding DCP's ``.metadata`` and one
``__<rank>_0.distcp`` file per rank, plus ``optbench.json`` (step, world size, model, config hash).
``train.resume=auto`` continues from the newest complete checkpoint there, so re-running the same
command in the same run directory (a fixed ``hydra.run.dir``, a requeued SLURM job) continues it.

What one holds: model and optimizer through ``torch.distributed.checkpoint.state_dict``
(``get_state_dict``/``set_state_dict``: the same names and full-tensor semantics for single, DDP and
FSDP2, each rank writing only its shards), the LR scheduler, the GradScaler, the step, the data
position (samples consumed per rank) and every rank's RNG states (torch, CUDA, numpy, python).

Atomic: every rank writes into ``.tmp-step-...``; after DCP's metadata is written (all ranks done),
rank 0 adds ``optbench.json``, fsyncs and renames the directory to its final name. A process killed
at any point (even SIGKILL) leaves at most a ``.tmp-`` directory, which is never read and is removed
by the next save; the newest complete checkpoint stays loadable. ``train.keep_last`` removes older
ones (renamed away first, then deleted).

Resuming with another world size is refused: the data order and the RNG states are per rank.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import pickle
import random
import re
import shutil
import time
import uuid
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from optbench import distributed
from optbench.config import ModelConfig, TrainConfig
from optbench.errors import ConfigError

log = logging.getLogger(__name__)

META_FILE = "optbench.json"
FORMAT = 1
_STEP_DIR = re.compile(r"^step-(\d+)$")


def checkpoint_root(cfg: TrainConfig, *, run_dir: str | Path) -> Path:
    """``train.checkpoint_dir`` (relative to the working directory) or ``<run dir>/checkpoints``."""
    return Path(cfg.checkpoint_dir) if cfg.checkpoint_dir else Path(run_dir) / "checkpoints"


def step_dir(root: Path, step: int) -> Path:
    return root / f"step-{step:08d}"


def complete_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """(step, path) of every complete checkpoint under ``root``, oldest first."""
    if not root.is_dir():
        return []
    found = []
    for path in root.iterdir():
        match = _STEP_DIR.match(path.name)
        if match and (path / META_FILE).is_file() and (path / ".metadata").is_file():
            found.append((int(match.group(1)), path))
    return sorted(found)


def read_meta(path: Path) -> dict[str, Any]:
    return json.loads((path / META_FILE).read_text())


# ------------------------------------------------------------------------------------- resume
def find_resume(
    cfg: TrainConfig, *, root: Path, world_size: int, model: ModelConfig
) -> Path | None:
    """The checkpoint ``train.resume`` names (auto: the newest under ``root``, if any; none: no
    checkpoint, and ``root`` must hold none; else a checkpoint directory, or a directory of them).
    Raises ConfigError when it cannot be resumed by this run."""
    if cfg.resume == "none":
        existing = complete_checkpoints(root)
        if existing:
            raise ConfigError(
                f"train.resume=none but {root} already holds checkpoints (newest: step {existing[-1][0]}); "
                "use train.resume=auto to continue that run, or another train.checkpoint_dir / "
                "hydra.run.dir to start a new one"
            )
        return None
    if cfg.resume == "auto":
        existing = complete_checkpoints(root)
        if not existing:
            return None
        path = existing[-1][1]
    else:
        path = _explicit_checkpoint(Path(cfg.resume))
    check_resumable(path, world_size=world_size, steps=cfg.steps, model=model)
    return path


def _explicit_checkpoint(path: Path) -> Path:
    if (path / META_FILE).is_file() and (path / ".metadata").is_file():
        return path
    inside = complete_checkpoints(path)
    if inside:
        return inside[-1][1]
    raise ConfigError(
        f"train.resume={path}: no optbench checkpoint there (a step-NNNNNNNN directory with "
        f"{META_FILE} and .metadata, or a directory of them); use train.resume=auto or train.resume=none"
    )


def check_resumable(path: Path, *, world_size: int, steps: int, model: ModelConfig) -> None:
    meta = read_meta(path)
    if meta["world_size"] != world_size:
        raise ConfigError(
            f"checkpoint {path} was written by {meta['world_size']} ranks but this run has {world_size}: "
            "resuming with another world size is not supported (the data order and RNG states are per "
            f"rank); resume with parallel.nproc_per_node={meta['world_size']} (or the same torchrun world), "
            "or start over with train.resume=none in another train.checkpoint_dir"
        )
    wanted = model_signature(model)
    if meta["model"] != wanted:
        saved = meta["model"]
        changed = ", ".join(f"model.{k}={saved.get(k)}" for k in sorted(wanted) if saved.get(k) != wanted[k])
        raise ConfigError(
            f"checkpoint {path} holds another model ({changed}); "
            "resume with the same model, or start over with train.resume=none in another train.checkpoint_dir"
        )
    if meta["step"] >= steps:
        raise ConfigError(
            f"checkpoint {path} is at step {meta['step']} and train.steps={steps}: nothing is left to train; "
            "raise train.steps to train on, or start over with train.resume=none in another train.checkpoint_dir"
        )


def model_signature(model: ModelConfig) -> dict[str, Any]:
    """The model's shape as recorded in a checkpoint (the preset's name aside)."""
    return {k: v for k, v in dataclasses.asdict(model).items() if k != "name"}


# ------------------------------------------------------------------------------------- state
@dataclass
class Progress:
    """Where training stands, besides model and optimizer."""

    step: int = 0
    samples_per_rank: int = 0
    first_loss: float | None = None


class _ModelAndOptimizer:
    """Stateful: model and optimizer state dicts via torch.distributed.checkpoint.state_dict."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model = model
        self.optimizer = optimizer

    def state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        return {"model": model_sd, "optim": optim_sd}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_state_dict

        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])


class _RankRNG:
    """Stateful: this rank's RNG states (torch CPU, CUDA, numpy, python)."""

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {
            "torch": torch.get_rng_state(),
            "numpy": pickle.dumps(np.random.get_state()),
            "python": pickle.dumps(random.getstate()),
        }
        if torch.cuda.is_available():
            state["cuda"] = torch.cuda.get_rng_state_all()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        torch.set_rng_state(state["torch"])
        np.random.set_state(pickle.loads(state["numpy"]))
        random.setstate(pickle.loads(state["python"]))
        if "cuda" in state:
            torch.cuda.set_rng_state_all(state["cuda"])


def _state(
    *, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any, scaler: Any, progress: Progress
) -> dict[str, Any]:
    state: dict[str, Any] = {
        "app": _ModelAndOptimizer(model, optimizer),
        "scheduler": scheduler,
        "progress": dataclasses.asdict(progress),
        f"rng_rank{distributed.rank()}": _RankRNG(),
    }
    if scaler is not None:
        state["scaler"] = scaler
    return state


# -------------------------------------------------------------------------------- save / load
def save(
    root: Path, *, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any, scaler: Any,
    progress: Progress, meta: dict[str, Any], keep_last: int,
) -> Path:
    """Write a checkpoint of ``progress.step`` atomically (every rank calls this); keep the newest
    ``keep_last`` (0: all). Returns its final path."""
    import torch.distributed.checkpoint as dcp

    final = step_dir(root, progress.step)
    tmp = root / f".tmp-{final.name}"
    rank0 = distributed.rank() == 0
    if rank0:
        root.mkdir(parents=True, exist_ok=True)
        _remove_stale(root)
    distributed.barrier()
    started = time.perf_counter()
    with _single_process_is_intended():
        dcp.save(_state(model=model, optimizer=optimizer, scheduler=scheduler, scaler=scaler, progress=progress),
                 checkpoint_id=tmp, no_dist=not distributed.is_distributed())
    if rank0:
        info = {"format": FORMAT, "step": progress.step, "world_size": distributed.world_size(),
                "samples_per_rank": progress.samples_per_rank,
                "written_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), **meta}
        _write_synced(tmp / META_FILE, json.dumps(info, indent=2) + "\n")
        if final.exists():
            _discard(final)
        os.rename(tmp, final)
        _fsync_dir(root)
        prune(root, keep_last=keep_last)
    distributed.barrier()
    log.info("Saved checkpoint %s (%.2f s)", final, time.perf_counter() - started)
    return final


def load(
    path: Path, *, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any, scaler: Any
) -> Progress:
    """Restore everything a checkpoint holds into the given objects (every rank calls this, after
    the model is materialized and the optimizer built); returns the progress it was saved at."""
    import torch.distributed.checkpoint as dcp

    # get_state_dict builds the optimizer's state to load into only when no gradient is held (else it
    # takes the optimizer for a stateless one, and Adam's moments would silently not be loaded)
    optimizer.zero_grad(set_to_none=True)
    state = _state(model=model, optimizer=optimizer, scheduler=scheduler, scaler=scaler, progress=Progress())
    with _single_process_is_intended():
        dcp.load(state, checkpoint_id=path, no_dist=not distributed.is_distributed())
    progress = Progress(**state["progress"])
    log.info("Resumed from checkpoint %s (step %d)", path, progress.step)
    return progress


@contextlib.contextmanager
def _single_process_is_intended() -> Iterator[None]:
    """DCP warns that it assumes one process whenever no process group exists, even when told so
    (no_dist=True); for parallel=single that is the intent."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def prune(root: Path, *, keep_last: int) -> list[Path]:
    """Remove all but the newest ``keep_last`` complete checkpoints (0 keeps all)."""
    if keep_last <= 0:
        return []
    old = [path for _, path in complete_checkpoints(root)[:-keep_last]]
    for path in old:
        _discard(path)
    return old


def _discard(path: Path) -> None:
    """Rename first (a crash mid-delete never leaves a half-deleted ``step-`` directory), then delete."""
    trash = path.with_name(f".trash-{path.name}-{uuid.uuid4().hex[:8]}")
    os.rename(path, trash)
    shutil.rmtree(trash, ignore_errors=True)


def _remove_stale(root: Path) -> None:
    """Leftovers of an interrupted save or delete (``.tmp-*``, ``.trash-*``)."""
    for path in root.iterdir():
        if path.name.startswith((".tmp-step-", ".trash-step-")):
            shutil.rmtree(path, ignore_errors=True)


def _write_synced(path: Path, text: str) -> None:
    with open(path, "w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
