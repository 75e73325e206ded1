"""MLflow and W&B (log.trackers), read back through their own readers: MLflow's client on the local
store, W&B's offline run files through ``wandb leet inspect --json`` (no network anywhere)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from optbench.config import to_config
from optbench.errors import ConfigError
from optbench.run.loop.evaluation import Evaluation
from optbench.run.train import train
from tests.helpers import FAST, cli_one_line, compose_cfg, run_cli_here

# skipped without optbench[tracking]; found, not imported, at collection (1.6 s in every pytest worker)
pytestmark = pytest.mark.skipif(any(importlib.util.find_spec(m) is None for m in ("mlflow", "wandb")),
                                reason="needs optbench[tracking] (mlflow, wandb)")
TINY = [*FAST, "train.steps=2", "measure.warmup_steps=0"]


@pytest.fixture
def stores(tmp_path, monkeypatch):
    """An MLflow SQLite store and a W&B directory in tmp; W&B offline whatever the machine has."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    return uri, tmp_path / "wandb_root", [f"log.mlflow.tracking_uri={uri}", f"log.wandb.dir={tmp_path / 'wandb_root'}"]


def _leet_inspect(capfd, *args: str) -> str:
    """``wandb leet inspect ARGS``'s stdout: W&B's own command, called in this process (it runs the
    wandb-core reader, which prints to fd 1, and exits with its status) rather than a Python process
    per call that imports wandb again."""
    from wandb.cli.leet import inspect

    capfd.readouterr()
    with pytest.raises(SystemExit) as done:
        inspect.main(list(args), standalone_mode=False)
    out, err = capfd.readouterr()
    assert done.value.code == 0, err
    return out


def _wandb_runs(root, capfd) -> list[dict]:
    """Every offline run under ``root`` as W&B's own reader summarizes it."""
    runs = []
    for run_dir in sorted((root / "wandb").glob("offline-run-*")):
        run = json.loads(_leet_inspect(capfd, "--json", "--summary", str(run_dir)))
        records = _leet_inspect(capfd, "--json", str(run_dir))
        run["run_record"] = next(json.loads(line)["run"] for line in records.splitlines()
                                 if json.loads(line)["type"] == "run")
        runs.append(run)
    return runs


def test_a_sweep_is_grouped_in_mlflow_and_wandb_with_config_scalars_figures_and_report(stores, tmp_path, capfd):
    from mlflow.tracking import MlflowClient

    uri, wandb_root, overrides = stores
    sweep = tmp_path / "sweep"
    result = run_cli_here("train", "-m", "train.seed=0,1", *TINY, "logger=all", *overrides,
                          f"hydra.sweep.dir={sweep}", capsys=capfd)
    assert result.returncode == 0, result.stderr

    client = MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name("optbench").experiment_id
    runs = client.search_runs([experiment])
    parents = [r for r in runs if r.data.tags.get("optbench/role") == "sweep"]
    jobs = [r for r in runs if "optbench/job" in r.data.tags]
    assert len(parents) == 1 and len(jobs) == 2
    assert {r.data.tags["mlflow.parentRunId"] for r in jobs} == {parents[0].info.run_id}
    for job in jobs:
        seed = job.data.params["train.seed"]
        assert job.data.tags["optbench/job"] == seed  # job 0 ran seed 0
        assert job.data.params["train.steps"] == "2" and job.data.params["log.trackers"] == \
            "['tensorboard', 'mlflow', 'wandb']"
        assert job.info.status == "FINISHED"
        summary = json.loads((Path(job.data.tags["optbench/run_dir"]) / "summary.json").read_text())
        losses = [m.value for m in client.get_metric_history(job.info.run_id, "loss/train")]
        assert len(losses) == 2 and losses[-1] == summary["loss"]["final"]
        assert job.data.metrics["summary/throughput.tokens_per_s"] == summary["throughput"]["tokens_per_s"]
    assert "report/report.md" in [a.path for a in client.list_artifacts(parents[0].info.run_id, "report")]
    assert (tmp_path / "artifacts").is_dir()  # beside the store, never ./mlruns of the working directory

    wandb_runs = _wandb_runs(wandb_root, capfd)
    trained = [r for r in wandb_runs if r["run_record"]["job_type"] == "train"]
    reports = [r for r in wandb_runs if r["run_record"]["job_type"] == "report"]
    assert len(trained) == 2 and len(reports) == 1
    groups = {r["run_record"]["run_group"] for r in wandb_runs}
    assert groups == {"/".join(sweep.parts[-2:])}
    for run in trained:
        assert run["state"] == "finished" and run["config"]["train"]["steps"] == 2
        assert f"job:{run['config']['train']['seed']}" in run["tags"]
        assert run["summary"]["summary/loss.final"] == run["summary"]["loss/train"]
    assert "report" in reports[0]["summary"]


def test_a_run_failing_in_the_loop_is_marked_failed(stores, tmp_path, monkeypatch, capfd):
    from mlflow.tracking import MlflowClient

    uri, wandb_root, overrides = stores

    def broken(self, state):
        raise RuntimeError("evaluation broke")

    monkeypatch.setattr(Evaluation, "on_step", broken)
    result = train(compose_cfg([*TINY, "logger=all", *overrides]), run_dir=tmp_path / "run")
    assert result.status == "failed"
    run = MlflowClient(tracking_uri=uri).search_runs(
        [MlflowClient(tracking_uri=uri).get_experiment_by_name("optbench").experiment_id])[0]
    assert run.info.status == "FAILED" and "evaluation broke" in run.data.tags["optbench/error"]
    (wandb_run,) = _wandb_runs(wandb_root, capfd)
    assert wandb_run["state"] == "failed" and wandb_run["summary"]["status"] == "failed"


def test_tensorboard_alone_is_the_default_and_logger_none_writes_no_events(tmp_path):
    assert to_config(compose_cfg([])).log.trackers == ["tensorboard"]
    result = train(compose_cfg([*TINY, "logger=none"]), run_dir=tmp_path)
    assert result.status == "completed", result.error
    assert not (tmp_path / "tensorboard").exists() and (tmp_path / "metrics.jsonl").is_file()


@pytest.mark.parametrize("tracker", ["mlflow", "wandb"])
def test_a_tracker_whose_package_is_missing_is_refused_in_one_line(tracker, monkeypatch, capsys, tmp_path):
    monkeypatch.setitem(sys.modules, tracker, None)
    with pytest.raises(ConfigError, match=r"pip install 'optbench\[tracking\]'"):
        to_config(compose_cfg([f"logger={tracker}"]))
    code, err = cli_one_line(capsys, "train", f"log.trackers=[{tracker}]", f"hydra.run.dir={tmp_path}")
    assert code == 2 and "optbench[tracking]" in err
