"""Experiment trackers beside metrics.jsonl: MLflow and Weights & Biases (``log.trackers``).

Each gets the run's composed config as parameters, the per-step scalars TensorBoard gets, the
summary's figures at the end, and tags naming the sweep and the job; the run ends FINISHED, or
FAILED / KILLED with the reason. A sweep's jobs are grouped: under one MLflow parent run (found by
its ``optbench/sweep_dir`` tag, made by the first job), in one W&B group; the sweep's report goes to
the parent run (MLflow) and to a ``report`` run of the group (W&B).

Only what the two clients document is used: ``mlflow.tracking.MlflowClient`` (no global active run,
so in-process sweeps never leak one) and ``wandb.init(reinit="create_new")``. TensorBoard stays in
``optbench.outputs.RunOutputs`` (events in the run directory).
"""

from __future__ import annotations

import logging
import math
import netrc
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from optbench.config.run import LogConfig, MLflowConfig, WandbConfig
from optbench.summary import RunSummary

log = logging.getLogger(__name__)

MLFLOW_PARAMS_PER_CALL = 100  # MlflowClient.log_batch's limit
MLFLOW_PARAM_CHARS = 6000  # a longer value is cut, and says so
# a run's status as each tracker names it
MLFLOW_STATUS = {"completed": "FINISHED", "stopped_early": "FINISHED", "interrupted": "KILLED"}
TRACKED_SECTIONS = ("model", "throughput", "memory", "loss", "steps", "wall_s")


@dataclass
class RunIdentity:
    """Who a tracked run is: its directory and, in a sweep, the sweep's directory, the job's number
    and overrides (Hydra's ``job.num`` and ``job.override_dirname``)."""

    run_dir: Path
    sweep_dir: Path | None = None
    job: int | None = None
    overrides: list[str] = field(default_factory=list)

    @property
    def name(self) -> str:
        return self.run_dir.name if self.sweep_dir is None else f"{self.sweep_label}/{self.run_dir.name}"

    @property
    def sweep_label(self) -> str:
        """The sweep's name: its directory's last two parts (``<date>/<time>`` under outputs/multirun)."""
        assert self.sweep_dir is not None
        return "/".join(self.sweep_dir.parts[-2:])

    def tags(self) -> dict[str, str]:
        tags = {"optbench/run_dir": str(self.run_dir), "optbench/overrides": " ".join(self.overrides)}
        if self.sweep_dir is not None:
            tags.update({"optbench/sweep": self.sweep_label, "optbench/sweep_dir": str(self.sweep_dir),
                         "optbench/job": str(self.job)})
        return tags


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(tree, dict):
        out: dict[str, Any] = {}
        for key, value in tree.items():
            out.update(flatten(value, f"{prefix}{key}."))
        return out
    return {prefix[:-1]: tree}


def figures(record: RunSummary) -> dict[str, float]:
    """The summary's numbers a tracker shows (``summary/loss.final``, ...): model size, throughput,
    memory, loss, steps and wall time; lists and missing values left out."""
    written = record.to_dict()
    flat = flatten({key: written[key] for key in TRACKED_SECTIONS if key in written})
    return {f"summary/{k}": float(v) for k, v in flat.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}


def _finite(scalars: dict[str, float | None]) -> dict[str, float]:
    return {k: float(v) for k, v in scalars.items() if v is not None and math.isfinite(v)}


# ------------------------------------------------------------------------------------------ MLflow
def mlflow_uri(cfg: MLflowConfig) -> str:
    """The tracking URI: the configured one, else a SQLite store under ``outputs/mlflow`` here."""
    if cfg.tracking_uri:
        return cfg.tracking_uri
    return f"sqlite:///{local_mlflow_dir() / 'mlflow.db'}"


def artifact_location(uri: str) -> str | None:
    """Artifacts beside a SQLite store (``<its directory>/artifacts``: MLflow's own default is
    ``./mlruns`` of whatever the working directory is); a server or file store decides its own."""
    if uri.startswith("sqlite:///"):
        return (Path(uri.removeprefix("sqlite:///")).parent / "artifacts").as_uri()
    return None


def local_mlflow_dir() -> Path:
    return Path.cwd().resolve() / "outputs" / "mlflow"


class MLflowTracker:
    def __init__(self, cfg: MLflowConfig) -> None:
        self.cfg = cfg
        self.client: Any = None
        self.run_id: str | None = None

    def _connect(self) -> str:
        """The client on the tracking URI and the experiment's id (made when missing)."""
        from mlflow.tracking import MlflowClient

        uri = mlflow_uri(self.cfg)
        if not self.cfg.tracking_uri:
            local_mlflow_dir().mkdir(parents=True, exist_ok=True)
        self.client = MlflowClient(tracking_uri=uri)
        experiment = self.client.get_experiment_by_name(self.cfg.experiment)
        if experiment is not None:
            return experiment.experiment_id
        return self.client.create_experiment(self.cfg.experiment, artifact_location=artifact_location(uri))

    def start(self, identity: RunIdentity, config: dict[str, Any]) -> None:
        from mlflow.entities import Param

        experiment = self._connect()
        tags = identity.tags()
        if identity.sweep_dir is not None:
            tags["mlflow.parentRunId"] = self._sweep_run(experiment, identity)
        self.run_id = self.client.create_run(experiment, run_name=identity.name, tags=tags).info.run_id
        params = [Param(k[:250], _param_value(v)) for k, v in flatten(config).items()]
        for first in range(0, len(params), MLFLOW_PARAMS_PER_CALL):
            self.client.log_batch(self.run_id, params=params[first:first + MLFLOW_PARAMS_PER_CALL])

    def _sweep_run(self, experiment: str, identity: RunIdentity) -> str:
        """The sweep's parent run: the one tagged with this sweep's directory, else a new one."""
        found = self.client.search_runs([experiment], filter_string=_sweep_filter(identity.sweep_dir),
                                        max_results=1)
        if found:
            return found[0].info.run_id
        parent = self.client.create_run(experiment, run_name=f"sweep {identity.sweep_label}", tags={
            "optbench/role": "sweep", "optbench/sweep": identity.sweep_label,
            "optbench/sweep_dir": str(identity.sweep_dir)})
        self.client.set_terminated(parent.info.run_id, "FINISHED")  # a container: its jobs hold the runs
        return parent.info.run_id

    def log_scalars(self, step: int, scalars: dict[str, float | None]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(k, v, now, step) for k, v in _finite(scalars).items()]
        if metrics:
            self.client.log_batch(self.run_id, metrics=metrics)

    def finish(self, *, status: str, error: str | None, record: RunSummary) -> None:
        if self.run_id is None:
            return
        from mlflow.entities import RunTag

        self.log_scalars(record.steps or 0, figures(record))
        self.client.log_dict(self.run_id, record.to_dict(), "summary.json")
        tags = [RunTag("optbench/status", status)] + ([RunTag("optbench/error", error[:5000])] if error else [])
        self.client.log_batch(self.run_id, tags=tags)
        self.client.set_terminated(self.run_id, MLFLOW_STATUS.get(status, "FAILED"))

    def log_report(self, sweep_dir: Path, report_files: list[Path]) -> None:
        experiment = self._connect()
        identity = RunIdentity(run_dir=sweep_dir, sweep_dir=sweep_dir)
        parent = self._sweep_run(experiment, identity)
        for path in report_files:
            self.client.log_artifact(parent, str(path), artifact_path="report")


def _sweep_filter(sweep_dir: Path | None) -> str:
    quoted = str(sweep_dir).replace("'", "\\'")
    return f"tags.`optbench/sweep_dir` = '{quoted}' and tags.`optbench/role` = 'sweep'"


def _param_value(value: Any) -> str:
    text = "null" if value is None else str(value)
    return text if len(text) <= MLFLOW_PARAM_CHARS else text[:MLFLOW_PARAM_CHARS - 12] + " ...(cut)"


# -------------------------------------------------------------------------------------------- W&B
def wandb_mode(cfg: WandbConfig) -> str:
    """offline / online; auto: online when W&B has an API key (the environment or netrc)."""
    if cfg.mode != "auto":
        return cfg.mode
    if os.environ.get("WANDB_MODE"):
        return os.environ["WANDB_MODE"]
    if os.environ.get("WANDB_API_KEY"):
        return "online"
    try:
        host = os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai").split("://")[-1].split("/")[0]
        return "online" if netrc.netrc().authenticators(host) else "offline"
    except (OSError, netrc.NetrcParseError):
        return "offline"


def wandb_dir(cfg: WandbConfig) -> Path:
    return Path(cfg.dir) if cfg.dir else Path.cwd().resolve() / "outputs"


class WandbTracker:
    def __init__(self, cfg: WandbConfig) -> None:
        self.cfg = cfg
        self.run: Any = None

    def _init(self, **kwargs: Any) -> Any:
        import wandb

        directory = wandb_dir(self.cfg)
        directory.mkdir(parents=True, exist_ok=True)
        # console="off": the run's console is train.log; W&B must not wrap this process's streams
        return wandb.init(project=self.cfg.project, entity=self.cfg.entity, dir=str(directory),
                          mode=wandb_mode(self.cfg), reinit="create_new", settings=wandb.Settings(console="off"),
                          **kwargs)

    def start(self, identity: RunIdentity, config: dict[str, Any]) -> None:
        tags = [f"job:{identity.job}", f"sweep:{identity.sweep_label}"] if identity.sweep_dir else []
        group = identity.sweep_label if identity.sweep_dir is not None else None
        self.run = self._init(name=identity.name, group=group, job_type="train", config=config,
                              tags=[t[:64] for t in tags], notes=" ".join(identity.overrides) or None)

    def log_scalars(self, step: int, scalars: dict[str, float | None]) -> None:
        self.run.log(_finite(scalars), step=step)

    def finish(self, *, status: str, error: str | None, record: RunSummary) -> None:
        if self.run is None:
            return
        self.run.summary.update({**figures(record), "status": status, **({"error": error} if error else {})})
        self.run.finish(exit_code=0 if MLFLOW_STATUS.get(status) == "FINISHED" else 1)
        self.run = None

    def log_report(self, sweep_dir: Path, report_files: list[Path]) -> None:
        import wandb

        label = RunIdentity(run_dir=sweep_dir, sweep_dir=sweep_dir).sweep_label
        run = self._init(name=f"report {label}", group=label, job_type="report", tags=[f"sweep:{label}"[:64]])
        try:
            artifact = wandb.Artifact(f"report-{label.replace('/', '_')}", type="report")
            for path in report_files:
                artifact.add_file(str(path))
            run.log_artifact(artifact)
            markdown = [p for p in report_files if p.suffix == ".md"]
            if markdown:
                run.summary["report"] = markdown[0].read_text()
        finally:
            run.finish()


# ------------------------------------------------------------------------------------------ build
Tracker = MLflowTracker | WandbTracker


def build_trackers(cfg: LogConfig) -> list[Tracker]:
    """The trackers ``log.trackers`` selects besides TensorBoard (``RunOutputs`` writes its events)."""
    built: list[Tracker] = []
    if "mlflow" in cfg.trackers:
        built.append(MLflowTracker(cfg.mlflow))
    if "wandb" in cfg.trackers:
        built.append(WandbTracker(cfg.wandb))
    return built


def log_sweep_report(cfg: LogConfig, sweep_dir: Path, report_files: list[Path]) -> None:
    """The sweep's report (report.md, .csv, .json) to each tracker, beside the sweep's jobs."""
    for tracker in build_trackers(cfg):
        tracker.log_report(sweep_dir, [p for p in report_files if p.is_file()])
