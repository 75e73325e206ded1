"""A finished run is never trained over (``guard_finished_run``).

A run directory whose ``summary.json`` records a finished run (``FINISHED``: completed or
stopped early) is kept as it is. A run started there again is refused with one line naming the
fix (another directory, or ``run.overwrite=true``), whatever it would do: start over (no
checkpoint, e.g. the default ``checkpoint.every=0``), or resume the last checkpoint of a run that
stopped early and train on past its end (its best evaluation would be lost). The one continuation
allowed is the documented one: a completed run with a checkpoint, run again with a larger
``train.steps``, trains on; its summary is kept beside it first as ``summary.step-NNNNNNNN.json``.

``run.overwrite=true`` moves the earlier run aside, whole, into the sibling directory
``<run dir>.replaced-<time>`` (summary, metrics, checkpoints, TensorBoard, logs, ``.hydra``), and the
run starts over in the emptied directory. ``optbench train`` checks before Hydra writes anything
into the directory (``FinishedRunGuard``, a Hydra callback), so a refused run changes nothing there;
``train`` checks again under the directory's lock.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback

from optbench.checkpoint.store import checkpoint_root, complete_checkpoints
from optbench.config import Config
from optbench.errors import ConfigError
from optbench.exits import fail
from optbench.files import LOCK_FILE, os_error_message, write_atomic
from optbench.summary import RunSummary, summary_or_reason

log = logging.getLogger(__name__)

# outcomes that end a run for good: a re-run keeps them (a sweep skips them, see optbench.run.sweep)
FINISHED = ("completed", "stopped_early")


def earlier_run(run_dir: Path) -> tuple[RunSummary | None, str | None]:
    """What ``run_dir``'s summary.json says, read once: (its record when it records a finished run,
    else None: none, or a run that may be resumed or run again: interrupted, time_limit, failed, ...;
    why it cannot be read, else None)."""
    summary, unreadable = summary_or_reason(run_dir)
    return (summary if summary is not None and summary.status in FINISHED else None), unreadable


def guard_finished_run(cfg: Config, *, run_dir: Path, keep: tuple[str, ...] = ()) -> Path | None:
    """Before a run trains in ``run_dir``: nothing to do when it holds no finished run; with
    ``run.overwrite=true`` the finished run is moved aside (but ``keep``: files this run already
    wrote there); a completed run trained on from its checkpoint has its summary kept beside it;
    anything else is refused (ConfigError naming the fix). A summary that cannot be read may record
    a finished run: refused too (or moved aside), never trained over. Returns where the earlier run
    was moved."""
    summary, unreadable = earlier_run(run_dir)
    if summary is None and unreadable is None:
        return None
    if cfg.run.overwrite:
        aside = move_aside(run_dir, keep=keep)
        log.warning("run.overwrite=true: the earlier %s run in %s moved aside to %s",
                    summary.status if summary is not None else "unreadable", run_dir, aside)
        return aside
    if unreadable is not None:
        raise ConfigError(
            f"{unreadable}, so what the run in {run_dir} recorded is unknown and this run would replace its "
            "results; use another directory (hydra.run.dir, or hydra.sweep.dir for a sweep), run.overwrite=true "
            f"to move the earlier run aside, or restore or delete {run_dir / 'summary.json'} to train there"
        )
    steps = summary.steps
    resumed = _resumed_checkpoint(cfg, run_dir=run_dir)
    if resumed is not None and summary.status == "completed":  # resume refuses it if nothing is left to train
        _keep_summary(run_dir, steps=steps)
        return None
    action = ("start it over" if resumed is None
              else f"resume its checkpoint {resumed} and train on past its end")
    raise ConfigError(
        f"{run_dir} holds a finished run ({summary.status} after {steps} steps, {summary.finished_at}) "
        f"and this run would {action}, replacing its results; use another directory (hydra.run.dir, or "
        "hydra.sweep.dir for a sweep), or run.overwrite=true to move the earlier run aside"
    )


def _resumed_checkpoint(cfg: Config, *, run_dir: Path) -> str | None:
    """The name of the checkpoint this run would resume (None: it would start over)."""
    if cfg.checkpoint.resume == "none":
        return None
    if cfg.checkpoint.resume != "auto":
        return Path(cfg.checkpoint.resume).name
    existing = complete_checkpoints(checkpoint_root(cfg.checkpoint, run_dir=run_dir))
    return existing[-1][1].name if existing else None


def _keep_summary(run_dir: Path, *, steps: Any) -> None:
    kept = run_dir / f"summary.step-{steps:08d}.json" if isinstance(steps, int) else run_dir / "summary.kept.json"
    if kept.exists():
        return
    try:
        write_atomic(kept, (run_dir / "summary.json").read_bytes())
    except OSError as exc:
        raise ConfigError(os_error_message(exc, "keep the finished run's summary before training on")) from None
    log.info("training on from a completed run: its summary kept as %s", kept)


def hydra_files(run_dir: Path) -> tuple[str, ...]:
    """What Hydra has just written for this run into ``run_dir`` (its job directory): kept there
    when the earlier run is moved aside."""
    from hydra.core.hydra_config import HydraConfig

    if HydraConfig.initialized() and Path(HydraConfig.get().runtime.output_dir).resolve() == run_dir.resolve():
        return (".hydra", "train.log")
    return ()


def move_aside(run_dir: Path, *, keep: tuple[str, ...] = ()) -> Path:
    """Move everything in ``run_dir`` (its lock and ``keep`` aside) into a new sibling directory
    ``<name>.replaced-<time>``; returns it."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    aside = run_dir.with_name(f"{run_dir.name}.replaced-{stamp}")
    n = 1
    while aside.exists():
        n += 1
        aside = run_dir.with_name(f"{run_dir.name}.replaced-{stamp}-{n}")
    try:
        aside.mkdir()
        for entry in sorted(run_dir.iterdir()):
            if entry.name != LOCK_FILE and entry.name not in keep:
                entry.rename(aside / entry.name)
    except OSError as exc:
        raise ConfigError(os_error_message(exc, f"move the earlier run aside to {aside}")) from None
    return aside


class FinishedRunGuard(Callback):
    """Hydra callback (conf/train.yaml): ``guard_finished_run`` for ``optbench train``'s single run,
    before Hydra writes ``.hydra`` and ``train.log`` into the run directory. A config that does not
    validate is left for the run to report."""

    def on_run_start(self, config: Any, **_: Any) -> None:
        import copy

        from omegaconf import open_dict, read_write

        from optbench.config import to_config
        from optbench.files import DirLock

        run_dir = Path(str(config.hydra.run.dir))
        summary, unreadable = earlier_run(run_dir)
        if summary is None and unreadable is None:
            return
        task_cfg = copy.deepcopy(config)
        with read_write(task_cfg), open_dict(task_cfg):
            del task_cfg["hydra"]
        try:
            cfg = to_config(task_cfg)
            lock = DirLock.acquire(run_dir, what="training")
        except Exception:  # noqa: BLE001 - a bad config, a live run: the run reports it, in one line
            return
        try:
            guard_finished_run(cfg, run_dir=run_dir)
        except ConfigError as exc:  # one line, exit 2
            fail(str(exc))
        finally:
            lock.release()
