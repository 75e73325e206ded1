"""Nothing lost, nothing cryptic: damaged checkpoints, full disks, re-runs, shared run directories,
torn metrics lines, bad token files, unwritable outputs, oversubscription, SIGTERM at start-up."""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from optbench import distributed
from optbench.checkpoint import resume
from optbench.checkpoint import store as checkpoint
from optbench.config import CheckpointConfig, to_config
from optbench.data.tokens import TokenFile
from optbench.errors import ConfigError
from optbench.files import DirLock, LockedError, os_error_message, parse_jsonl, write_atomic
from optbench.outputs import format_summary, read_metrics
from optbench.run.train import train
from optbench.summary import RunSummary
from tests.helpers import FAST, SAVING, cli_one_line, compose_cfg, copy_of


def newest(run: Path) -> Path:
    return run / "checkpoints" / "step-00000004"


@contextlib.contextmanager
def file_size_limit(nbytes: int):
    """RLIMIT_FSIZE for this process (Python ignores SIGXFSZ, so writes past it fail with EFBIG)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))


# ------------------------------------------------------------------ 1. damaged newest checkpoint
def _damage(path: Path, how: str) -> None:
    data = path / "__0_0.distcp"
    if how == "truncated":
        os.truncate(data, 1000)
    elif how == "deleted":
        data.unlink()
    elif how == "empty .metadata":
        (path / ".metadata").write_bytes(b"")
    elif how == "corrupt optbench.json":
        (path / "optbench.json").write_text("{bad")


@pytest.mark.parametrize("how", ["truncated", "deleted", "empty .metadata", "corrupt optbench.json"])
def test_damage_is_found_without_loading(finished, tmp_path, how):
    run = copy_of(finished, tmp_path)
    assert checkpoint.damage(newest(run)) is None
    _damage(newest(run), how)
    why = checkpoint.damage(newest(run))
    assert why is not None and why.split()[0] in ("__0_0.distcp", ".metadata", "optbench.json")
    cfg = CheckpointConfig(resume="auto")
    model = to_config(compose_cfg(FAST)).model
    assert resume.find_resume(cfg, steps=8, root=run / "checkpoints", world_size=1,
                              model=model).path.name == "step-00000002"
    _damage(run / "checkpoints" / "step-00000002", "truncated")
    with pytest.raises(ConfigError, match=r"no checkpoint in .* can be loaded \(step-00000004: .*; step-00000002: "
                                          r"__0_0.distcp is truncated"):
        resume.find_resume(cfg, steps=8, root=run / "checkpoints", world_size=1, model=model)


def test_resume_falls_back_cuts_a_torn_line_and_records_a_changed_config(finished, tmp_path, caplog):
    """One resume, three cases: the newest checkpoint's data is overwritten (it looks whole but does
    not load), metrics.jsonl ends in a torn line, and the learning rate was changed."""
    run = copy_of(finished, tmp_path)
    data = newest(run) / "__0_0.distcp"
    data.write_bytes(os.urandom(data.stat().st_size))
    with open(run / "metrics.jsonl", "a") as metrics:
        metrics.write('{"kind": "train", "step": 4, "lo')  # a kill mid-write
    with caplog.at_level(logging.WARNING):
        result = train(compose_cfg([*SAVING, "train.steps=5", "train.lr=1e-3"]), run_dir=run)
    assert result.status == "completed", result.error
    ckpt = result.summary["applied"]["checkpoint"]
    assert ckpt["resumed_step"] == 2 and ckpt["resumed_from"].endswith("step-00000002")
    assert ckpt["skipped"][0].startswith("step-00000004: ") and "step-00000004 does not load" in caplog.text
    assert "torn" in caplog.text
    records, torn = parse_jsonl(run / "metrics.jsonl")
    assert torn is None and [r["step"] for r in records if r["kind"] == "train"] == list(range(5))
    was = json.loads((finished / "summary.json").read_text())["config"]["train"]["lr"]
    assert was != 1e-3 and ckpt["config_changes"] == [{"key": "train.lr", "was": was, "now": 1e-3}]
    assert f"under a changed config: train.lr {was} -> 0.001" in caplog.text
    from optbench.report.analysis import build_report

    shutil.copytree(finished, tmp_path / "unchanged", ignore=shutil.ignore_patterns(".optbench.lock"))
    labels = [v.label for g in build_report([tmp_path]).groups for v in g.variants]
    changed = f"(config changed at step 2: train.lr {was} -> 0.001)"  # the variants' order is the report's
    assert len(labels) == 2 and sum(changed in label for label in labels) == 1, labels


def test_a_change_that_makes_the_checkpoint_meaningless_is_refused(finished, tmp_path):
    run = copy_of(finished, tmp_path)
    result = train(compose_cfg([*SAVING, "train.steps=5", "optimizer=muon"]), run_dir=run)
    assert result.status == "failed" and result.exit_code == 2
    assert "written with optimizer.name=adamw and this run has muon" in result.error


def test_a_dataset_smaller_than_one_batch_is_refused_with_the_counts(tmp_path):
    (tmp_path / "t.bin").write_bytes(np.arange(80, dtype=np.uint16).tobytes())  # 1 training window of 33
    (tmp_path / "t.bin.json").write_text('{"dtype": "uint16", "vocab_size": 256, "num_tokens": 80}')
    result = train(compose_cfg([*FAST, "data=tokens", f"data.path={tmp_path}/t.bin", "model.vocab_size=256"]),
                   run_dir=tmp_path / "run")
    assert result.status == "failed" and result.exit_code == 2
    assert "the training split holds 1 sample(s) but train.batch_size=4" in result.error


def test_no_checkpoint_that_loads_is_one_line(finished, tmp_path):
    run = copy_of(finished, tmp_path)
    for step in ("2", "4"):
        data = run / "checkpoints" / f"step-0000000{step}" / "__0_0.distcp"
        data.write_bytes(os.urandom(data.stat().st_size))
    result = train(compose_cfg([*SAVING, "train.steps=5"]), run_dir=run)
    assert result.status == "failed" and result.user_error and result.exit_code == 2
    assert "no checkpoint in" in result.error and "\n" not in result.error
    assert "step-00000004: " in result.error and "step-00000002: " in result.error


# ------------------------------------------------------------------ 2. full disk / file-size limit
def test_a_save_past_the_file_size_limit_ends_with_a_summary_and_no_temporaries(finished, tmp_path):
    run = copy_of(finished, tmp_path)
    with file_size_limit(2 * 2**20):  # the checkpoint needs ~12 MiB
        result = train(compose_cfg([*SAVING, "train.steps=5"]), run_dir=run)
    assert result.status == "failed" and result.exit_code == 2
    assert "cannot save checkpoint step-00000005" in result.error and "ulimit -f: 2.0 MiB" in result.error
    assert "it needs about 12.0 MiB" in result.error and "step-00000004, is kept" in result.error
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["error"] == result.error and summary["steps"] == 5
    leftovers = [p.name for p in (run / "checkpoints").iterdir()] + [p.name for p in run.iterdir()]
    assert not [name for name in leftovers if ".tmp" in name]
    assert checkpoint.damage(newest(run)) is None


def test_a_full_disk_message_names_the_space():
    message = os_error_message(OSError(errno.ENOSPC, "No space left on device", "/x/ckpt/__0_0.distcp"), "save")
    assert message == ("cannot save: /x/ckpt/__0_0.distcp: No space left on device; free some space or choose a "
                       "directory on another filesystem")


def test_write_atomic_keeps_the_old_file_when_the_write_fails(tmp_path):
    path = tmp_path / "summary.json"
    path.write_text("old")
    with file_size_limit(1000), pytest.raises(OSError):
        write_atomic(path, "x" * 5000)
    assert path.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["summary.json"]


# ------------------------------------------------------------------ 3. re-running a finished run
def test_rerunning_a_finished_run_never_touches_its_results(finished, tmp_path):
    run = copy_of(finished, tmp_path)
    before = {name: (run / name).read_bytes() for name in ("summary.json", "metrics.jsonl")}
    result = train(compose_cfg(SAVING), run_dir=run)
    assert result.status == "failed" and result.user_error and "nothing is left to train" in result.error
    assert "to start fresh, give a new run directory: hydra.run.dir=" in result.error  # issue 27 item 13
    assert {name: (run / name).read_bytes() for name in before} == before


# ------------------------------------------------------------------ 4. a lock on the run directory
HOLD = "import sys, time; from optbench.files import DirLock; DirLock.acquire(sys.argv[1], what='x'); " \
       "print('held', flush=True); time.sleep(60)"


def test_a_second_run_in_a_locked_directory_is_refused_and_a_stale_lock_taken_over(tmp_path, caplog):
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        result = train(compose_cfg(FAST), run_dir=tmp_path)
        assert result.status == "failed" and result.user_error
        assert f"in use by another optbench run (pid {holder.pid} on " in result.error
        assert not (tmp_path / "summary.json").exists() and not (tmp_path / "metrics.jsonl").exists()
    finally:
        holder.kill()  # SIGKILL: the lock file stays, the lock does not
        holder.wait()
    with caplog.at_level(logging.WARNING):
        lock = DirLock.acquire(tmp_path, what="x")
    lock.release()
    assert f"took over the lock on {tmp_path} left by pid {holder.pid}" in caplog.text


def test_locks_are_per_process_and_reentrant(tmp_path):
    first = DirLock.acquire(tmp_path, what="x")
    assert DirLock.acquire(tmp_path / ".", what="x") is first
    first.release()
    first.release()
    code = "import sys; from optbench.files import DirLock; DirLock.acquire(sys.argv[1], what='x')"
    assert subprocess.run([sys.executable, "-c", code, str(tmp_path)]).returncode == 0  # released


def test_an_explicit_checkpoint_dir_is_locked_too(tmp_path):
    root = tmp_path / "ckpts"
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(root)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(LockedError, match=f"{root} is in use by another optbench run"):
            checkpoint.lock_root(root)
    finally:
        holder.kill()
        holder.wait()


# ------------------------------------------------------------------ 5. torn metrics line (readers)
def test_readers_skip_a_torn_last_line_and_refuse_a_corrupt_middle(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 0}\n{"step": 1}\n{"st')
    assert read_metrics(tmp_path) == [{"step": 0}, {"step": 1}]
    (tmp_path / "metrics.jsonl").write_text('{"step": 0}\n{"st\n{"step": 2}\n')
    with pytest.raises(ConfigError, match="line 2 is not valid JSON and is not the last line"):
        read_metrics(tmp_path)


# ------------------------------------------------------------------ 6. token files
def test_a_directory_given_as_the_token_file_says_so(tmp_path):
    with pytest.raises(ConfigError, match=f"data.path={re.escape(str(tmp_path))} is a directory; give the token file"):
        TokenFile(str(tmp_path), seq_len=8, split="train", dtype="uint16", eval_fraction=0.1)


@pytest.mark.parametrize(
    ("content", "sidecar", "dtype", "message"),
    [
        (b"", None, "uint16", "is empty (0 bytes)"),
        (b"\x01\x00" * 100, "{not json", "auto", "t.bin.json is not valid JSON"),
        (b"\x01\x00" * 100, '{"dtype": "uint16"}', "auto", "t.bin.json lacks vocab_size, num_tokens"),
        (b"\x01\x00" * 100, '{"dtype": "uint16", "vocab_size": 256, "num_tokens": 300}', "auto",
         "holds 100 uint16 tokens but its sidecar t.bin.json says 300"),
        (b"\x01\x00" * 100, '{"dtype": "uint16", "vocab_size": 256, "num_tokens": "lots"}', "auto",
         't.bin.json says num_tokens "lots", not a count'),
        (b"\x01\x00" * 100, '{"dtype": "uint16", "vocab_size": -3, "num_tokens": 100}', "auto",
         "t.bin.json says vocab_size -3, not a count"),
        (b"CDF\x01" + b"\x00" * 196, None, "uint16", "t.bin is a NetCDF3 file, not token ids"),  # data.dtype as advised
        (b"\x89HDF\r\n\x1a\n" + b"\x00" * 192, None, "auto", "t.bin is a NetCDF4/HDF5 file, not token ids"),
    ],
)
def test_bad_token_files_name_the_file(tmp_path, content, sidecar, dtype, message):
    (tmp_path / "t.bin").write_bytes(content)
    if sidecar is not None:
        (tmp_path / "t.bin.json").write_text(sidecar)
    with pytest.raises(ConfigError, match=re.escape(message)):
        TokenFile(str(tmp_path / "t.bin"), seq_len=8, split="train", dtype=dtype, eval_fraction=0.1)


# ------------------------------------------------------------------ 8. unwritable outputs
def test_unwritable_outputs_are_one_line_exit_2(tmp_path, capsys):
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    text = tmp_path / "t.txt"
    text.write_text("hello world " * 10)
    long_path = str(tmp_path / ("d" * 5000))
    (tmp_path / "logdir" / "train.log").mkdir(parents=True)  # in the way of what Hydra writes in a run directory
    (tmp_path / "hydrafile").mkdir()
    (tmp_path / "hydrafile" / ".hydra").write_text("x")
    cases = [
        (("data", "synth", str(tmp_path), "--days", "2"), "is a directory; give the file to write"),
        (("data", "synth", str(blocker / "x.nc"), "--days", "2"), "a_file: is a file, not a directory"),
        (("data", "synth", str(tmp_path / "lv.nc"), "--levels", "850", "500", "850"), "--levels repeats 850 hPa"),
        (("data", "tokenize", str(text), str(blocker / "x.bin")), "a_file: is a file, not a directory"),
        (("data", "tokenize", str(text), long_path + ".bin"), "File name too long; use a shorter path"),
        (("train", "-m", "--cfg", "job"), "--cfg and -m cannot be combined"),
        (("train", f"hydra.run.dir={blocker}/run"), "hydra.run.dir names: " + f"{blocker}/run: Not a directory"),
        (("train", f"hydra.run.dir={long_path}"), "File name too long"),
        (("train", f"hydra.run.dir={tmp_path / 'logdir'}"), "train.log is a directory where the run writes its log"),
        (("train", f"hydra.run.dir={tmp_path / 'hydrafile'}"), ".hydra is a file where Hydra writes the run's config"),
        (("compare", *FAST, "--", *FAST, "--out", str(blocker / "out")), "cannot create --out"),
    ]
    for args, message in cases:
        code, err = cli_one_line(capsys, *args)
        assert code == 2 and message in err, (args, err)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file", "hydrafile", "logdir", "t.txt"]  # no temporaries
    assert sorted(p.name for p in (tmp_path / "logdir").iterdir()) == ["train.log"]  # nothing written beside them
    assert sorted(p.name for p in (tmp_path / "hydrafile").iterdir()) == [".hydra"]


def test_a_synth_that_cannot_fit_is_refused_before_writing(tmp_path, capsys):
    with file_size_limit(200_000):  # HDF5 goes on after a failed write and may crash: refuse first
        code, err = cli_one_line(capsys, "data", "synth", str(tmp_path / "d.nc"), "--days", "20")
    assert code == 2 and "d.nc: the dataset may need up to 11.1 MB" in err and "ulimit -f" in err
    assert list(tmp_path.iterdir()) == []


# ------------------------------------------------------------------ 9. oversubscription, SIGTERM
def test_more_cpu_workers_than_cores_is_warned(caplog):
    cores = distributed.usable_cores()
    assert distributed.oversubscription(cores, device=torch.device("cpu")) is None
    assert distributed.oversubscription(64, device=torch.device("cuda")) is None
    parallel = to_config(compose_cfg(["parallel=ddp", f"parallel.nproc_per_node={cores + 62}"])).parallel
    with caplog.at_level(logging.WARNING):
        distributed.detect_machine("cpu", parallel=parallel)
    assert f"starts {cores + 62} gloo workers on {cores} CPU core" in caplog.text
    assert f"parallel.nproc_per_node<={cores}" in caplog.text


def test_sigterm_during_start_up_ends_with_an_interrupted_summary(tmp_path, monkeypatch):
    from optbench.run import preemption
    from optbench.run import train as train_module

    real_build_task = train_module.build_task

    def build_task_then_sigterm(cfg):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(1)  # the handler raises before this returns
        return real_build_task(cfg)

    monkeypatch.setattr(train_module, "build_task", build_task_then_sigterm)
    previous = signal.getsignal(signal.SIGTERM)
    try:
        preemption.install_startup_handler()
        result = train(compose_cfg(FAST), run_dir=tmp_path)
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert result.status == "interrupted" and result.exit_code == 143
    assert result.error == "stopped by SIGTERM during start-up, before the first step"
    assert json.loads((tmp_path / "summary.json").read_text())["status"] == "interrupted"


# ------------------------------------------------------------------ 10. what a person reads
def test_one_applied_line_per_optimization(finished):
    log_text = (finished / "train.log").read_text()
    assert log_text.count("Applied optimizer") == 1  # not again for the memory estimate's trace


def test_a_failed_run_summary_has_no_none():
    summary = RunSummary(error="bad", wall_s=0.1)
    text = format_summary(summary, "/r")
    assert "None" not in text and "peak not measured (the run stopped before)" in text


# ------------------------------------------------------------------ 11. resuming under a changed config
def test_config_changes_at_resume_are_listed_and_the_meaningless_refused(tmp_path):
    saved = {"train": {"lr": 1e-3, "steps": 6, "seed": 0}, "optimizer": {"name": "adamw"},
             "precision": {"name": "fp32", "grad_scaler": False}, "model": {"dim": 64}}
    now = {"train": {"lr": 2e-3, "steps": 12, "seed": 1}, "optimizer": {"name": "adamw"},
           "precision": {"name": "bf16", "grad_scaler": False}, "model": {"dim": 64}}
    changes = resume.config_changes(saved, now)  # train.steps may grow: that is how a run trains on
    assert resume.describe_changes(changes) == "precision.name fp32 -> bf16, train.lr 0.001 -> 0.002, train.seed 0 -> 1"
    resume.check_config_changes(tmp_path, changes)  # recorded, not refused
    now["optimizer"]["name"] = "muon"
    with pytest.raises(ConfigError, match="written with optimizer.name=adamw and this run has muon"):
        resume.check_config_changes(tmp_path, resume.config_changes(saved, now))
    assert resume.config_changes(None, now) == []  # a checkpoint from before configs were recorded
