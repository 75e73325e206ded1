"""Nothing lost, round three: planted links in a shared run directory, a live run's checkpoints,
re-runs over finished results, failed resumes, data tools writing over their inputs, files where
directories go, results that cannot be written, SIGTERM at any moment of start-up."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from optbench.checkpoint import store as checkpoint
from optbench.cli import main as cli_main
from optbench.files import DirLock, LockedError, UnsafePathError
from optbench.run.train import train
from tests.helpers import FAST, SAVING, cli_one_line, compose_cfg, copy_of

HOLD = "import sys, time; from optbench.files import DirLock; DirLock.acquire(sys.argv[1], what='x'); " \
       "print('held', flush=True); time.sleep(60)"


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


# --------------------------------------------------------------------- 1. re-runs over finished runs
def _outputs(run: Path) -> dict[str, bytes]:
    return {name: (run / name).read_bytes() for name in ("summary.json", "metrics.jsonl")}


def test_a_rerun_without_checkpoints_is_refused_and_keeps_everything(tmp_path, capsys):
    """checkpoint=on_stop (the default) leaves no checkpoint: the second run would start over."""
    run = tmp_path / "run"
    args = ["train", *FAST, "train.steps=3", "measure.warmup_steps=1", f"hydra.run.dir={run}"]
    cli_main(args)  # completed: no SystemExit
    capsys.readouterr()
    before, overrides = _outputs(run), (run / ".hydra" / "overrides.yaml").read_text()
    with pytest.raises(SystemExit) as exit_info:
        cli_main([*args, "train.lr=1e-3"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "Traceback" not in err
    line = err.strip().splitlines()[-1]
    assert line.startswith(f"optbench: error: {run} holds a finished run (completed after 3 steps, ")
    assert "this run would start it over" in line and "run.overwrite=true" in line
    assert _outputs(run) == before and (run / ".hydra" / "overrides.yaml").read_text() == overrides  # untouched


@pytest.mark.parametrize("damage", [
    lambda text: text[:100],  # torn
    lambda text: "[1, 2]",  # not a summary
    lambda text: json.dumps({**json.loads(text), "schema_version": 10**6}),  # a newer optbench's
], ids=["truncated", "not-a-summary", "newer-schema"])
def test_a_run_over_an_unreadable_summary_is_refused_and_keeps_everything(finished, tmp_path, capsys, damage):
    """What an unreadable summary.json recorded is unknown (a finished run, perhaps): a run started
    there is refused, whatever it would do, and leaves the directory as it was; run.overwrite=true
    moves it all aside."""
    run = copy_of(finished, tmp_path)
    (run / "summary.json").write_text(damage((run / "summary.json").read_text()))
    before = _outputs(run)
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["train", *SAVING, "train.steps=6", f"hydra.run.dir={run}"])  # it would resume step 4
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "Traceback" not in err
    line = err.strip().splitlines()[-1]
    assert line.startswith(f"optbench: error: {run / 'summary.json'} ") and "this run would replace its results" in line
    assert "run.overwrite=true" in line and "hydra.run.dir" in line
    assert _outputs(run) == before and not (run / ".hydra").exists()
    result = train(compose_cfg([*SAVING, "train.steps=6"]), run_dir=run)  # the same guard in train()
    assert result.status == "failed" and result.exit_code == 2 and "would replace its results" in result.error
    assert _outputs(run) == before  # not even the refused run's summary
    moved = train(compose_cfg([*SAVING, "run.overwrite=true"]), run_dir=run)
    assert moved.status == "completed", moved.error
    [aside] = [p for p in tmp_path.iterdir() if p.name.startswith("run.replaced-")]
    assert _outputs(aside) == before


def test_overwrite_moves_the_earlier_run_aside_whole(finished, tmp_path):
    run = copy_of(finished, tmp_path)
    before = _outputs(run)
    result = train(compose_cfg([*SAVING, "run.overwrite=true"]), run_dir=run)
    assert result.status == "completed", result.error
    assert result.summary["applied"]["checkpoint"]["resumed_from"] is None  # started over, its checkpoints aside
    [aside] = [p for p in tmp_path.iterdir() if p.name.startswith("run.replaced-")]
    assert _outputs(aside) == before and sorted(p.name for p in (aside / "checkpoints").iterdir()) == [
        "step-00000002", "step-00000004"]
    assert (aside / "tensorboard").is_dir() and (aside / "train.log").is_file()


def test_a_stopped_early_run_is_not_trained_on(finished, tmp_path):
    run = copy_of(finished, tmp_path)
    summary = json.loads((run / "summary.json").read_text())
    (run / "summary.json").write_text(json.dumps({**summary, "status": "stopped_early"}))
    before = _outputs(run)
    result = train(compose_cfg([*SAVING, "train.steps=6"]), run_dir=run)
    assert result.status == "failed" and result.exit_code == 2
    assert "holds a finished run (stopped_early after 4 steps" in result.error
    assert "resume its checkpoint step-00000004 and train on past its end" in result.error
    assert _outputs(run) == before


def test_training_on_from_a_completed_run_keeps_its_summary(finished, tmp_path):
    run = copy_of(finished, tmp_path)
    before = (run / "summary.json").read_bytes()
    result = train(compose_cfg([*SAVING, "train.steps=5"]), run_dir=run)
    assert result.status == "completed" and result.summary["steps"] == 5
    assert (run / "summary.step-00000004.json").read_bytes() == before


# --------------------------------------------------------------------- 2. a failed resume
def test_a_failed_resume_leaves_the_finished_summary(finished, tmp_path):
    run = copy_of(finished, tmp_path)
    lines = (run / "metrics.jsonl").read_text().splitlines(keepends=True)
    lines[2] = '{"kind": "train", "st\n'
    (run / "metrics.jsonl").write_text("".join(lines))
    before = _outputs(run)
    result = train(compose_cfg([*SAVING, "train.steps=6"]), run_dir=run)
    assert result.status == "failed" and result.exit_code == 2 and "line 3 is not valid JSON" in result.error
    assert _outputs(run) == before
    assert json.loads(before["summary.json"])["status"] == "completed"


# --------------------------------------------------------------------- 4. data tools and their inputs
def test_data_tools_never_write_over_their_inputs(tmp_path, capsys):
    from optbench.data.netcdf.synth import write_synthetic

    for name in ("a.nc", "b.nc"):
        write_synthetic(tmp_path / name, days=1, step_hours=6, nlat=4, nlon=8, levels=(1000.0,))
    text = tmp_path / "t.txt"
    text.write_text("hello world\n")
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    cases = [
        (("data", "captions", str(tmp_path / "a.nc"), str(tmp_path / "b.nc")),  # the output forgotten
         "b.nc exists and is a NetCDF4/HDF5 file, not the captions (JSON lines)"),
        (("data", "captions", str(tmp_path / "a.nc"), str(tmp_path / "a.nc")), "a.nc is also an input"),
        (("data", "captions", str(tmp_path / "*.nc"), str(tmp_path / "c.jsonl"), "--lines", str(tmp_path / "b.nc")),
         "b.nc is also an input"),
        (("data", "tokenize", str(text), str(text)), "t.txt would be written over the input"),
        (("data", "tokenize", str(text), str(tmp_path / "a.nc")), "a.nc exists and is a NetCDF4/HDF5 file"),
        (("data", "tokenizer", str(text), str(text), "--vocab-size", "300"), "t.txt would be written over the input"),
        (("data", "synth", str(text)), "t.txt exists and is text or other data, not a NetCDF4 file"),
        (("data", "captions", str(tmp_path / "a.nc"), str(tmp_path / "c.jsonl"), "--history", "-1"),
         "--history -1 --eval-fraction 0.1: give a history >= 1"),
    ]
    for args, message in cases:
        code, err = cli_one_line(capsys, *args)
        assert code == 2 and message in err, (args, err)
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before


# --------------------------------------------------------------------- 8, 9. files in the way, results unwritten
@pytest.mark.parametrize(("name", "kind", "message"), [
    ("tensorboard", "file", "tensorboard is a file where this run writes its tensorboard directory"),
    ("checkpoints", "file", "checkpoints is a file where this run keeps its checkpoints"),
    ("summary.json", "dir", "summary.json is a directory where this run writes its summary"),
])
def test_something_in_the_way_of_an_output_is_refused_before_training(tmp_path, name, kind, message):
    run = tmp_path / "run"
    run.mkdir()
    (run / name).mkdir() if kind == "dir" else (run / name).write_text("x")
    result = train(compose_cfg([*FAST, "checkpoint.every=2"]), run_dir=run)
    assert result.status == "failed" and result.exit_code == 2 and message in result.error
    assert result.summary["steps"] == 0 and not (run / "metrics.jsonl").exists()


# TensorBoard's writer thread meets the limit too: it printed its traceback, which pytest reports as
# this warning; now it is a line of the run's log
@pytest.mark.filterwarnings("error::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_summary_that_cannot_be_written_is_never_completed(tmp_path, caplog):
    from tests.run.test_reliability import file_size_limit

    cfg = compose_cfg(FAST)  # before the limit: the tests' table of composed presets is a file
    with file_size_limit(6 * 1024):  # the summary is ~7 KB; ulimit -f 6
        result = train(cfg, run_dir=tmp_path)
    assert result.status == "failed" and result.exit_code == 2 and not (tmp_path / "summary.json").exists()
    assert result.error.startswith(f"cannot write the summary: {tmp_path}/summary.json: File too large")
    assert result.error.endswith("(the run itself ended completed)")
    assert (f"cannot write TensorBoard's events: {tmp_path}/tensorboard: File too large; a file-size limit "
            "stops it (ulimit -f): raise the limit") in caplog.text


# --------------------------------------------------------------------- 10. SIGTERM at any moment of start-up
@pytest.fixture
def sigterm_restored():
    previous = signal.getsignal(signal.SIGTERM)
    yield
    signal.signal(signal.SIGTERM, previous)


def test_sigterm_while_hydra_runs_is_one_line_and_nothing_trained(tmp_path, capsys, monkeypatch, sigterm_restored):
    """Raised inside Hydra's code it printed a traceback (or was swallowed and the run completed)."""
    from optbench.run import rerun

    monkeypatch.setattr(rerun.FinishedRunGuard, "on_run_start",
                        lambda self, config, **_: os.kill(os.getpid(), signal.SIGTERM))
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["train", *FAST, f"hydra.run.dir={tmp_path}"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 143 and "Traceback" not in err
    assert err.strip().splitlines()[-1] == ("optbench: error: interrupted: stopped by SIGTERM during start-up, "
                                            "before the first step; nothing was trained")
    assert not (tmp_path / "summary.json").exists() and not (tmp_path / "metrics.jsonl").exists()


def test_sigterm_swallowed_by_a_library_still_stops_the_run(tmp_path, monkeypatch, sigterm_restored):
    from optbench.run import preemption
    from optbench.run import train as train_module

    real_build_task = train_module.build_task

    def swallowing_build_task(cfg):
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(1)  # the handler raises in here ...
        except Exception:  # noqa: BLE001 - ... and a careless library catches it
            pass
        return real_build_task(cfg)

    monkeypatch.setattr(train_module, "build_task", swallowing_build_task)
    preemption.install_startup_handler()
    result = train(compose_cfg(FAST), run_dir=tmp_path)
    assert result.status == "interrupted" and result.exit_code == 143 and result.summary["steps"] == 0
    assert result.error == "stopped by SIGTERM during start-up, before the first step"


# --------------------------------------------------------------------- 14, 15. runs that would measure nothing true
def test_a_netcdf_split_smaller_than_a_batch_is_refused(tmp_path):
    from optbench.data.netcdf.synth import write_synthetic
    from tests.tasks.test_climate import climate_overrides

    path = tmp_path / "tiny.nc"
    write_synthetic(path, days=6, step_hours=6, nlat=8, nlon=16, time_chunk=4)  # 24 steps, ~18 training samples
    result = train(compose_cfg(climate_overrides(path, tmp_path, "train.batch_size=40")), run_dir=tmp_path / "run")
    assert result.status == "failed" and result.exit_code == 2 and result.summary["steps"] == 0
    assert "but train.batch_size=40: every batch would repeat samples; lower train.batch_size to at most" in result.error


@pytest.mark.parametrize(("overrides", "message"), [
    (["profile.skip_first=3", "profile.wait=0", "profile.warmup=0", "profile.active=5", "train.steps=8",
      "measure.warmup_steps=3"],
     "profile: the recorded steps 3..7 take every step timed after measure.warmup_steps=3 (train.steps=8), "
     "so no step would be timed"),
    (["profile.active=20", "train.steps=20"],  # steps 4..23 of steps 0..19, not "5..25"
     "profile: the recorded steps 4..24 go past the last step, 19 (train.steps=20)"),
])
def test_a_profile_window_that_leaves_nothing_to_time_is_refused(overrides, message):
    from optbench.config import to_config
    from optbench.errors import ConfigError
    from optbench.training.preflight import check_config

    with pytest.raises(ConfigError) as error:
        check_config(to_config(compose_cfg([*FAST, "profile=trace", *overrides])))
    assert str(error.value).startswith(message)


# --------------------------------------------------------------------- cosmetic: what a run says
def test_an_untracked_peak_says_why():
    from optbench.run.loop.memory import _untracked_reason

    assert _untracked_reason(False, step=1, steps=6, warmup_end=2) == "not measured (measure.track_memory=false)"
    # track_memory=true and the run stopped early: not "track_memory=false"
    assert _untracked_reason(True, step=1, steps=6, warmup_end=2) == (
        "not measured (the run ended before step 1, the last warm-up step, which it tracks)")
    # loss_freq=every_step: no auxiliary loss is involved
    assert _untracked_reason(True, step=4, steps=3, warmup_end=5) == (
        "not measured (step 4, the last warm-up step, is past the last step, 2)")


def test_an_unparsable_run_dir_leaves_nothing_behind(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["train", *FAST, "hydra.run.dir=out/a]b"])
    assert exit_info.value.code == 2 and list(tmp_path.iterdir()) == []
    with pytest.raises(SystemExit) as exit_info:  # parsed, created, then Hydra refuses an unknown key
        cli_main(["train", *FAST, "hydra.run.dir=out/deep/run", "train.no_such_key=1"])
    assert exit_info.value.code == 2 and list(tmp_path.iterdir()) == []
