"""Nothing lost, round three: planted links in a shared run directory, a live run's checkpoints,
re-runs over finished results, failed resumes, data tools writing over their inputs, files where
directories go, results that cannot be written, SIGTERM at any moment of start-up."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from optbench.checkpoint import store as checkpoint
from optbench.files import DirLock, LockedError, UnsafePathError
from optbench.run.train import train
from tests.helpers import FAST, compose_cfg

SAVING = [*FAST, "train.steps=4", "checkpoint.every=2", "checkpoint.keep_last=0"]
HOLD = "import sys, time; from optbench.files import DirLock; DirLock.acquire(sys.argv[1], what='x'); " \
       "print('held', flush=True); time.sleep(60)"


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Path:
    """A completed 4-step run with checkpoints at steps 2 and 4 (copied by each test that changes it)."""
    run_dir = tmp_path_factory.mktemp("finished") / "run"
    result = train(compose_cfg(SAVING), run_dir=run_dir)
    assert result.status == "completed", result.error
    return run_dir


def copy_of(run: Path, tmp_path: Path) -> Path:
    target = tmp_path / "run"
    shutil.copytree(run, target, ignore=shutil.ignore_patterns(".optbench.lock"))
    return target


class Holder:
    """Another live optbench run holding ``directory``'s lock (a process of its own)."""

    def __init__(self, directory: Path) -> None:
        self.process = subprocess.Popen([sys.executable, "-c", HOLD, str(directory)], stdout=subprocess.PIPE, text=True)
        assert self.process.stdout.readline().strip() == "held"

    def __enter__(self) -> Holder:
        return self

    def __exit__(self, *exc) -> None:
        self.process.kill()
        self.process.wait()


# --------------------------------------------------------------------- S2. planted links
def test_a_planted_lock_link_is_refused_and_its_target_untouched(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    run = tmp_path / "run"
    run.mkdir()
    (run / ".optbench.lock").symlink_to(victim)
    result = train(compose_cfg(FAST), run_dir=run)
    assert result.status == "failed" and result.exit_code == 2 and "\n" not in result.error
    assert result.error.startswith(f"{run}/.optbench.lock (a run's lock file) is a symbolic link to {victim}; "
                                   "optbench does not write through links")
    assert victim.read_text() == "precious" and not (run / "summary.json").exists()


def test_a_hard_linked_lock_file_is_refused(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    (tmp_path / "run").mkdir()
    os.link(victim, tmp_path / "run" / ".optbench.lock")
    with pytest.raises(UnsafePathError, match="has other hard links"):
        DirLock.acquire(tmp_path / "run", what="training")
    assert victim.read_text() == "precious"


def test_a_planted_metrics_link_is_refused_and_its_target_untouched(finished, tmp_path):
    run = copy_of(finished, tmp_path)
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    (run / "metrics.jsonl").unlink()
    (run / "metrics.jsonl").symlink_to(victim)
    summary = (run / "summary.json").read_bytes()
    result = train(compose_cfg([*SAVING, "train.steps=5"]), run_dir=run)
    assert result.status == "failed" and result.exit_code == 2
    assert "metrics.jsonl (the run's metrics) is a symbolic link" in result.error
    assert victim.read_text() == "precious" and (run / "summary.json").read_bytes() == summary


# --------------------------------------------------------------------- 3. a live run's checkpoints
def test_a_live_runs_checkpoints_cannot_be_used_by_another_run(finished, tmp_path):
    run = copy_of(finished, tmp_path)
    before = {p.name: p.stat().st_mtime_ns for p in (run / "checkpoints").iterdir()}
    with Holder(run):
        with pytest.raises(LockedError, match=f"{run}/checkpoints is inside {run}, which is in use by another "
                                              "optbench run"):
            checkpoint.lock_root(run / "checkpoints")
        result = train(compose_cfg([*SAVING, "train.steps=6", f"checkpoint.dir={run}/checkpoints"]),
                       run_dir=tmp_path / "other")
    assert result.status == "failed" and result.exit_code == 2 and "in use by another optbench run" in result.error
    assert {p.name: p.stat().st_mtime_ns for p in (run / "checkpoints").iterdir()} == before
    assert json.loads((run / "summary.json").read_text())["status"] == "completed"
