"""Sharded, atomic, exactly resumable checkpoints with torch.distributed.checkpoint (DCP): the
storage under ``optbench.checkpoint.Manager`` (save, load, prune, and finding damage).

Where they live: ``checkpoint.dir``, by default ``<run dir>/checkpoints``, one directory per
checkpoint named ``step-00000012`` (12 optimizer steps done) holding DCP's ``.metadata`` and one
``__<rank>_0.distcp`` file per rank, plus ``optbench.json`` (step, world size, model, config hash).
``checkpoint.resume=auto`` continues from the newest complete checkpoint there, so re-running the same
command in the same run directory (a fixed ``hydra.run.dir``, a requeued SLURM job) continues it.

What one holds: model and optimizer through ``torch.distributed.checkpoint.state_dict``
(``get_state_dict``/``set_state_dict``: the same names and full-tensor semantics for single, DDP and
FSDP2, each rank writing only its shards), the LR scheduler, the GradScaler, the step, the data
position (samples consumed per rank) and every rank's RNG states (torch, CUDA, numpy, python).

Atomic: every rank writes into ``.tmp-step-...``; after DCP's metadata is written (all ranks done),
rank 0 adds ``optbench.json``, fsyncs and renames the directory to its final name. A process killed
at any point (even SIGKILL) leaves at most a ``.tmp-`` directory, which is never read and is removed
by the next save; the newest complete checkpoint stays loadable. ``checkpoint.keep_last`` removes older
ones (renamed away first, then deleted).

Resuming with another world size is refused: the data order and the RNG states are per rank.

Damage: resume verifies what it loads. A checkpoint whose ``optbench.json`` or ``.metadata`` does
not parse, or whose ``.distcp`` files are missing or shorter than its metadata says, is skipped
(with a warning naming it and why), and so is one whose data fails to load (overwritten bytes):
the run continues from the newest checkpoint that loads, and stops with one line when none does.
A save that fails (full disk, file-size limit) removes its ``.tmp-`` directory, keeps every
complete checkpoint, and stops the run with one line naming the directory and the space needed.
An explicit ``checkpoint.dir`` outside the run directory is locked for the life of the run
(``optbench.files.DirLock``), as the run directory is.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import logging
import os
import re
import shutil
import time
import uuid
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from optbench import distributed
from optbench.checkpoint import digests, safe
from optbench.config import CheckpointConfig
from optbench.files import DirLock, OutputError, free_bytes, held_lock, os_error_message, timestamp
from optbench.outputs import human_bytes

log = logging.getLogger(__name__)

META_FILE = "optbench.json"
FORMAT = 2  # 2: RNG states as tensors and numbers, files' SHA-256 recorded (1: pickled RNG states, no hashes)
_STEP_DIR = re.compile(r"^step-(\d+)$")


def checkpoint_root(cfg: CheckpointConfig, *, run_dir: str | Path) -> Path:
    """``checkpoint.dir`` (relative to the working directory) or ``<run dir>/checkpoints``."""
    return Path(cfg.dir) if cfg.dir else Path(run_dir) / "checkpoints"


def step_dir(root: Path, step: int) -> Path:
    return root / f"step-{step:08d}"


def named_checkpoint(path: str | Path) -> Path | None:
    """The checkpoint ``path`` names: itself (it holds ``optbench.json``), else the newest complete
    one in its ``checkpoints`` directory or in it (a run directory, a checkpoints directory); None
    when there is none."""
    p = Path(path).expanduser()
    if (p / META_FILE).is_file():
        return p
    for root in (p / "checkpoints", p):
        found = complete_checkpoints(root)
        if found:
            return found[-1][1]
    return None


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


def damage(path: Path) -> str | None:
    """Why the checkpoint at ``path`` cannot be loaded, found without loading it (None: it looks
    whole): ``optbench.json`` unreadable or of the wrong shape, ``.metadata`` unreadable (or naming
    something that is not DCP's metadata), a data file missing or truncated. Overwritten bytes are
    found when it is loaded (``load`` verifies the recorded hashes first)."""
    try:
        meta = read_meta(path)
    except (OSError, ValueError) as exc:
        return f"{META_FILE} is unreadable ({first_line(exc)})"
    problem = meta_problem(meta, step=_dir_step(path))
    if problem is not None:
        return f"{META_FILE} {problem} (overwritten?)"
    try:
        metadata = safe.read_metadata(path)
    except Exception as exc:  # noqa: BLE001 - any failure to read it is damage
        return f".metadata is unreadable ({first_line(exc)})"
    needed: dict[str, int] = {}
    for info in (getattr(metadata, "storage_data", None) or {}).values():
        end = int(info.offset) + int(info.length)
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), end)
    for name, size in sorted(needed.items()):
        file = path / name
        if not file.is_file():
            return f"{name} is missing"
        actual = file.stat().st_size
        if actual < size:
            return f"{name} is truncated ({actual:,} of {size:,} bytes)"
    return None


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def meta_problem(meta: Any, *, step: int | None = None) -> str | None:
    """What is wrong with the shape of an ``optbench.json`` (None: nothing): its fields and their
    types, and its step against its directory's name (``step``)."""
    if not isinstance(meta, dict):
        return f"holds a JSON {type(meta).__name__}, not an object"
    missing = [key for key in ("step", "world_size", "model") if key not in meta]
    if missing:
        return f"lacks {', '.join(missing)}"
    for key in ("step", "world_size", "samples_per_rank"):
        if key in meta and not _count(meta[key]):
            return f"has {key}={json.dumps(meta[key])}, not a count"
    if meta["world_size"] < 1:
        return "has world_size=0"
    if not isinstance(meta["model"], dict):
        return f"has model={json.dumps(meta['model'])}, not the model's fields"
    if not isinstance(meta.get("config", {}), (dict, type(None))) or not isinstance(meta.get("files", {}), dict):
        return "has a config or files entry that is not an object"
    if step is not None and meta["step"] != step:
        return f"says step {meta['step']} but its directory is step {step}"
    return None


def _dir_step(path: Path) -> int | None:
    match = _STEP_DIR.match(path.name)
    return int(match.group(1)) if match else None


def first_line(exc: BaseException) -> str:
    if isinstance(exc, checkpoint_exception()):
        failures = list(exc.failures.values())  # type: ignore[attr-defined]
        if failures:
            inner = failures[0][0] if isinstance(failures[0], tuple) else failures[0]
            return first_line(inner)
    text = str(exc).strip().splitlines()
    if isinstance(exc, EOFError):
        return "EOFError: the data ends early (truncated)"
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


def checkpoint_exception() -> type[BaseException]:
    """DCP's CheckpointException derives from BaseException, so ``except Exception`` misses it."""
    from torch.distributed.checkpoint.api import CheckpointException

    return CheckpointException


def lock_root(root: Path) -> None:
    """Lock ``root`` for this run unless a lock this process holds covers it (the run directory's)."""
    if held_lock(root) is not None:
        return
    try:
        DirLock.acquire(root, what="training with its checkpoints")
    except OSError as exc:
        raise OutputError(os_error_message(exc, "use the checkpoint directory") + " (checkpoint.dir)") from None


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
    """Stateful: this rank's RNG states (torch CPU, CUDA, numpy, python) as tensors and numbers;
    ``legacy``: the pickled numpy/python states of a FORMAT 1 checkpoint (``optbench.checkpoint.safe``)."""

    def __init__(self, *, legacy: bool = False) -> None:
        self.legacy = legacy

    def state_dict(self) -> dict[str, Any]:
        return safe.rng_state(legacy=self.legacy)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        safe.set_rng_state(state)


def _state(
    *, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any, scaler: Any, progress: Progress,
    legacy: bool = False,
) -> dict[str, Any]:
    state: dict[str, Any] = {
        "app": _ModelAndOptimizer(model, optimizer),
        "scheduler": scheduler,
        "progress": dataclasses.asdict(progress),
        f"rng_rank{distributed.rank()}": _RankRNG(legacy=legacy),
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
    failure: str | None = None
    files: dict[str, Any] = {}
    try:
        with _single_process_is_intended():
            dcp.save(_state(model=model, optimizer=optimizer, scheduler=scheduler, scaler=scaler,
                            progress=progress), checkpoint_id=tmp, no_dist=not distributed.is_distributed())
        files = digests.record(tmp)  # every rank hashes what it wrote, while it is in the page cache
    except (Exception, checkpoint_exception()) as exc:  # DCP gathers every rank's failure: all see it
        failure = _save_failure(exc, root=root, tmp=tmp, model=model, optimizer=optimizer)
    if rank0 and failure is None:
        info = {"format": FORMAT, "step": progress.step, "world_size": distributed.world_size(),
                "samples_per_rank": progress.samples_per_rank, "written_at": timestamp(), **meta, "files": files}
        try:
            _publish(tmp, final, info=info, keep_last=keep_last)
        except OSError as exc:
            failure = _save_failure(exc, root=root, tmp=tmp, model=model, optimizer=optimizer)
    failure = distributed.broadcast_object(failure)  # rank 0's verdict, also a barrier
    if failure is not None:
        raise OutputError(failure)
    log.info("Saved checkpoint %s (%.2f s)", final, time.perf_counter() - started)
    return final


def _publish(tmp: Path, final: Path, *, info: dict[str, Any], keep_last: int) -> None:
    """Rank 0, once every rank's data is written: ``optbench.json``, fsync, rename into place, prune."""
    _write_synced(tmp / META_FILE, json.dumps(info, indent=2) + "\n")
    if final.exists():
        _discard(final)
    os.rename(tmp, final)
    _fsync_dir(final.parent)
    prune(final.parent, keep_last=keep_last)


def _save_failure(exc: BaseException, *, root: Path, tmp: Path, model: nn.Module,
                  optimizer: torch.optim.Optimizer) -> str:
    """Remove the half-written checkpoint; one line: where, why, the space needed and the fix.
    torch.save's zip writer reports a full disk or a file-size limit as "unexpected pos", without
    the OSError: the free space and the limit then say which it was."""
    if distributed.rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    needed, free, limit = state_bytes(model, optimizer), free_bytes(root), _file_size_limit()
    os_error = _os_error(exc)
    fix = "free some space there, set checkpoint.dir to a directory with room, or checkpoint.every=0"
    if os_error is not None and os_error.errno == errno.EFBIG or (
            os_error is None and limit is not None and limit < needed and (free is None or free >= needed)):
        cause = f"a file-size limit stops it (ulimit -f: {human_bytes(limit)})"
        fix = "raise the limit (ulimit -f unlimited), or set checkpoint.every=0"
    elif os_error is not None:
        cause = os_error.strerror or first_line(os_error)
        if os_error.errno not in (errno.ENOSPC, errno.EDQUOT):
            fix = os_error_message(os_error).rpartition("; ")[2] or fix
    elif free is not None and free < needed:
        cause = "the disk is full"
    else:
        cause = first_line(exc)
    kept = complete_checkpoints(root)
    return (f"cannot save checkpoint {tmp.name.removeprefix('.tmp-')} in {root}: {cause} (it needs about "
            f"{human_bytes(needed)}; {human_bytes(free)} free there); "
            + (f"the last complete checkpoint, {kept[-1][1].name}, is kept" if kept else "no earlier checkpoint")
            + f"; {fix}")


def _file_size_limit() -> int | None:
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_FSIZE)
    return None if soft == resource.RLIM_INFINITY else soft


def _os_error(exc: BaseException) -> OSError | None:
    """The OSError behind a failure (DCP wraps each rank's)."""
    if isinstance(exc, OSError):
        return exc
    if isinstance(exc, checkpoint_exception()):
        for failure in exc.failures.values():  # type: ignore[attr-defined]
            inner = failure[0] if isinstance(failure, tuple) else failure
            if isinstance(inner, OSError):
                return inner
    cause = exc.__cause__ or exc.__context__
    return _os_error(cause) if cause is not None else None


def state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the tensors a checkpoint holds (model and optimizer state, every rank together)."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    for state in optimizer.state.values():
        total += sum(v.numel() * v.element_size() for v in state.values() if isinstance(v, torch.Tensor))
    return total


def load(
    path: Path, *, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any, scaler: Any
) -> Progress:
    """Restore everything the checkpoint at ``path`` holds into the given objects (every rank calls
    this, after the model is materialized and the optimizer built); returns the progress it was
    saved at. A checkpoint whose data does not load raises (``first_line`` says why in one line);
    ``optbench.checkpoint.Manager.resume`` then falls back to an older one."""
    import torch.distributed.checkpoint as dcp

    meta = read_meta(path)
    changed = digests.verify(path, meta.get("files"))  # every rank gets the same answer
    if changed is not None:
        raise DamagedCheckpoint(changed)
    # get_state_dict builds the optimizer's state to load into only when no gradient is held (else it
    # takes the optimizer for a stateless one, and Adam's moments would silently not be loaded)
    optimizer.zero_grad(set_to_none=True)
    state = _state(model=model, optimizer=optimizer, scheduler=scheduler, scaler=scaler, progress=Progress(),
                   legacy=meta.get("format", 1) < 2)
    with _single_process_is_intended():
        dcp.load(state, storage_reader=safe.reader(path), planner=safe.planner(),
                 no_dist=not distributed.is_distributed())
    return Progress(**state["progress"])


class DamagedCheckpoint(RuntimeError):
    """A checkpoint's files differ from what was recorded when it was saved."""


def older_whole(path: Path) -> list[Path]:
    """The checkpoints beside ``path`` older than it that look whole and match this world size,
    newest first: where a resume falls back to when ``path`` does not load."""
    match = _STEP_DIR.match(path.name)
    if match is None:
        return []
    older = [p for step, p in reversed(complete_checkpoints(path.parent)) if step < int(match.group(1))]
    return [p for p in older if damage(p) is None and read_meta(p)["world_size"] == distributed.world_size()]


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
