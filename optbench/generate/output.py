"""Where ``optbench generate --out`` may write, decided before anything is generated.

Never over a file a run owns: its summary (and the summaries kept aside), per-step metrics, log,
lock, config (``.hydra``), checkpoints, TensorBoard events or profiler traces, whichever name
reaches them (a link included): a run directory is one holding ``summary.json``,
``metrics.jsonl``, ``.hydra`` or checkpoints, a checkpoint one holding ``optbench.json``, a
checkpoints directory one holding ``step-*/optbench.json``. Never over any other existing file
either, unless it is an earlier output of ``optbench generate``: a JSON-lines file whose first
line is a sample record (``"kind": "sample"`` with its time, climate, text and reference). A new
file anywhere else, in a run directory too, is written.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from optbench.errors import ConfigError

RUN_FILES = {"summary.json": "the run's summary", "metrics.jsonl": "the run's per-step metrics",
             "train.log": "the run's log", ".optbench.lock": "the run's lock file", "console.log": "the run's console"}
RUN_DIRS = {".hydra": "the run's config", "checkpoints": "the run's checkpoints",
            "tensorboard": "the run's TensorBoard events", "profile": "the run's profiler traces"}
RECORD_KEYS = {"kind", "time", "climate", "text", "reference"}


def _is_run_dir(path: Path) -> bool:
    from optbench.checkpoint.store import META_FILE

    return any((path / name).exists() for name in ("summary.json", "metrics.jsonl", ".hydra")) or any(
        (path / "checkpoints").glob(f"step-*/{META_FILE}"))


def _holds_checkpoints(path: Path) -> bool:
    from optbench.checkpoint.store import META_FILE

    return (path / META_FILE).is_file() or any(path.glob(f"step-*/{META_FILE}"))


def owner(path: Path) -> str | None:
    """What of a run ``path`` (resolved) is, or None when it is no run's."""
    for depth, directory in enumerate(path.parents):
        inside = path.relative_to(directory).parts
        if _holds_checkpoints(directory):
            return "the run's checkpoints"
        if not _is_run_dir(directory):
            continue
        if depth == 0 and (inside[0] in RUN_FILES or (inside[0].startswith("summary.") and inside[0].endswith(".json"))):
            return RUN_FILES.get(inside[0], "the run's summary")
        if depth > 0 and inside[0] in RUN_DIRS:
            return RUN_DIRS[inside[0]]
    return None


def earlier_output(path: Path) -> bool:
    """Whether ``path`` is an earlier output of ``optbench generate`` (its first line a sample record)."""
    try:
        with path.open("rb") as handle:
            first = handle.readline(1 << 20)
        record = json.loads(first)
    except (OSError, ValueError):
        return False
    return isinstance(record, dict) and record.get("kind") == "sample" and RECORD_KEYS <= set(record)


def check_out(out: str) -> Path:
    """The path ``--out`` names, where writing it loses nothing; ConfigError (one line) otherwise."""
    path = Path(out).expanduser()
    if path.is_dir():
        raise ConfigError(f"--out {out} is a directory: give a file name in it, e.g. --out {path / 'generated.jsonl'}")
    parent = path.parent
    if not parent.exists():
        raise ConfigError(f"--out {out}: the directory {parent} does not exist: create it first (mkdir -p {parent}) "
                          "or give another path")
    if not parent.is_dir():
        raise ConfigError(f"--out {out}: {parent} is a file, not a directory: give another path")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ConfigError(f"--out {out}: cannot write in {parent}: choose a directory you can write to")
    what = owner(path.resolve())
    if what is not None:
        raise ConfigError(f"--out {out} is {what} (optbench train's): writing there would destroy it; "
                          f"give a file of its own, e.g. --out {parent / 'generated.jsonl'}")
    if (path.exists() or path.is_symlink()) and not earlier_output(path):
        raise ConfigError(f"--out {out} exists and is not an earlier output of optbench generate: writing there "
                          "would destroy it; give a new file name, or remove it first")
    return path
