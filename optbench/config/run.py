"""Schemas of a run (``optbench.run``): the training schedule (``train``), its checkpoints
(``checkpoint``), the console (``log``), what is measured (``measure``), its limits (``run``), and
the ``stopping`` and ``profile`` groups."""

from __future__ import annotations

import importlib.util
import math
import sys
from dataclasses import dataclass, field

from optbench.config.checks import non_negative, one_of, positive
from optbench.errors import ConfigError

SCHEDULES = ("cosine", "onecycle", "constant")
DEVICES = ("auto", "cpu", "cuda")
LOG_LEVELS = ("auto", "warning", "info", "debug")
PROFILES = ("none", "trace")
# log.trackers: where a run's config, scalars and figures go besides metrics.jsonl (optbench.tracking);
# the packages each needs, installed with ``pip install 'optbench[tracking]'``
TRACKERS = ("tensorboard", "mlflow", "wandb")
TRACKER_PACKAGES = {"tensorboard": (), "mlflow": ("mlflow", "sqlalchemy", "alembic"), "wandb": ("wandb",)}
WANDB_MODES = ("auto", "offline", "online")


# ---------------------------------------------------------------------------------------- train
@dataclass
class TrainConfig:
    """What is trained and how: the steps, the batch, the learning-rate schedule, clipping, the
    seed, the device and the evaluation cadence. ``batch_size`` is per micro-step and per device;
    the samples per optimizer step are ``batch_size * grad_accum * world_size``. ``lr`` and its
    schedule stay here rather than under ``optimizer``: every optimizer preset is compared at the
    same schedule, so switching optimizer=... never changes it."""

    steps: int = 30
    batch_size: int = 8
    seq_len: int = 256
    grad_accum: int = 1
    lr: float = 3e-3
    warmup_steps: int = 3
    schedule: str = "cosine"
    min_lr_ratio: float = 0.1
    clip_grad: float | None = 1.0
    seed: int = 0
    device: str = "auto"
    eval_every: int = 0
    eval_batches: int = 2

    def __post_init__(self) -> None:
        positive(
            **{
                "train.steps": self.steps,
                "train.batch_size": self.batch_size,
                "train.seq_len": self.seq_len,
                "train.grad_accum": self.grad_accum,
                "train.lr": self.lr,
            }
        )
        non_negative(
            **{
                "train.warmup_steps": self.warmup_steps,
                "train.eval_every": self.eval_every,
                "train.eval_batches": self.eval_batches,
            }
        )
        one_of("train.schedule", self.schedule, SCHEDULES)
        if self.schedule == "onecycle" and self.warmup_steps >= self.steps:
            raise ConfigError(
                f"train.schedule=onecycle needs train.warmup_steps ({self.warmup_steps}) < "
                f"train.steps ({self.steps})"
            )
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ConfigError(f"train.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if self.clip_grad is not None and not (self.clip_grad > 0 and math.isfinite(self.clip_grad)):
            raise ConfigError(
                f"train.clip_grad must be positive, got {self.clip_grad}; use train.clip_grad=null "
                "to turn clipping off"
            )
        one_of("train.device", self.device, DEVICES)


# ----------------------------------------------------------------------------------- checkpoint
@dataclass
class CheckpointConfig:
    """Training checkpoints (DCP): one every ``every`` steps (0: only when SIGTERM/SIGINT or
    ``run.time_limit_s`` stops the run) into ``dir`` (null: ``<run dir>/checkpoints``), keeping the
    newest ``keep_last`` (0: all). ``resume``: ``auto`` (the newest checkpoint in ``dir``, if any),
    ``none`` (start fresh; ``dir`` must hold none) or the path of a checkpoint."""

    every: int = 0
    keep_last: int = 2
    resume: str = "auto"
    dir: str | None = None

    def __post_init__(self) -> None:
        non_negative(**{"checkpoint.every": self.every, "checkpoint.keep_last": self.keep_last})
        if not self.resume:
            raise ConfigError("checkpoint.resume is empty; use auto, none or the path of a checkpoint")
        if self.dir is not None and not self.dir:
            raise ConfigError("checkpoint.dir is empty; use checkpoint.dir=null for <run dir>/checkpoints")


# ------------------------------------------------------------------------------------------ log
def installed(package: str) -> bool:
    """``package`` can be imported (a module set to None in ``sys.modules`` counts as missing)."""
    if package in sys.modules:
        return sys.modules[package] is not None
    return importlib.util.find_spec(package) is not None


@dataclass
class MLflowConfig:
    """``log.mlflow``: ``tracking_uri`` null is a local store under ``outputs/mlflow`` of the working
    directory (SQLite and artifact files, no server); a server's URI (``http://host:5000``), a
    ``sqlite:///`` path or a ``file:`` store (MLflow refuses the file store unless
    ``MLFLOW_ALLOW_FILE_STORE=true``) otherwise. Runs go into ``experiment``."""

    tracking_uri: str | None = None
    experiment: str = "optbench"

    def __post_init__(self) -> None:
        if not self.experiment:
            raise ConfigError("log.mlflow.experiment is empty; name the MLflow experiment (default: optbench)")


@dataclass
class WandbConfig:
    """``log.wandb``: ``mode`` auto is online when W&B has an API key (``WANDB_API_KEY`` or
    ``wandb login``'s netrc entry) and offline otherwise (``wandb sync`` uploads later); ``dir``
    null: ``outputs/`` of the working directory (W&B writes ``wandb/`` in it)."""

    project: str = "optbench"
    entity: str | None = None
    mode: str = "auto"
    dir: str | None = None

    def __post_init__(self) -> None:
        one_of("log.wandb.mode", self.mode, WANDB_MODES)
        if not self.project:
            raise ConfigError("log.wandb.project is empty; name the W&B project (default: optbench)")


@dataclass
class LogConfig:
    """The console: ``level`` auto (warning beside a progress bar, else info) | warning | info |
    debug; ``progress`` auto (a bar on a terminal, else log lines) | bar | log; a log line (and a
    metrics.jsonl record) every ``every`` steps and at the last. ``trackers``: where the run's
    config, scalars and figures go too (tensorboard, mlflow, wandb; several at once; ``[]``: only
    metrics.jsonl), set by the ``logger=`` presets or ``log.trackers=[tensorboard,mlflow]``."""

    every: int = 1
    level: str = "auto"
    progress: str = "auto"
    trackers: list[str] = field(default_factory=lambda: ["tensorboard"])
    mlflow: MLflowConfig = field(default_factory=MLflowConfig)
    wandb: WandbConfig = field(default_factory=WandbConfig)

    def __post_init__(self) -> None:
        positive(**{"log.every": self.every})
        one_of("log.level", self.level, LOG_LEVELS)
        one_of("log.progress", self.progress, ("auto", "bar", "log"))
        for tracker in self.trackers:
            one_of("log.trackers", tracker, TRACKERS)
            missing = [p for p in TRACKER_PACKAGES[tracker] if not installed(p)]
            if missing:
                raise ConfigError(f"log.trackers={tracker} needs {', '.join(missing)}, which is not installed: "
                                  "pip install 'optbench[tracking]'")
        if len(set(self.trackers)) != len(self.trackers):
            raise ConfigError(f"log.trackers names a tracker twice: {list(self.trackers)}")


# -------------------------------------------------------------------------------------- measure
@dataclass
class MeasureConfig:
    """What the run measures and how: the first ``warmup_steps`` steps (compilation, allocator
    growth) are left out of every time figure; ``track_memory`` follows one step on a CPU with
    torch's MemTracker for the peak memory (on CUDA the allocator's peak is always read)."""

    warmup_steps: int = 3
    track_memory: bool = True
    # the dense peak (TFLOP/s per device, of the dtype the matmuls run in) MFU is measured against;
    # null: the datasheet's of a known GPU, else a measured matmul ceiling (optbench.measure)
    peak_tflops: float | None = None

    def __post_init__(self) -> None:
        non_negative(**{"measure.warmup_steps": self.warmup_steps})
        if self.peak_tflops is not None and not (self.peak_tflops > 0 and math.isfinite(self.peak_tflops)):
            raise ConfigError(f"measure.peak_tflops must be a positive number of TFLOP/s, got {self.peak_tflops}; "
                              "use measure.peak_tflops=null for the datasheet's or a measured peak")


# ---------------------------------------------------------------------------------- run control
@dataclass
class RunControlConfig:
    """The run's limits (the ``run:`` node; ``optbench.run.loop``): ``time_limit_s`` (null: none) is
    the loop's wall-clock budget in seconds: when the next step would end past it, the run saves a
    checkpoint and stops as ``time_limit`` (a rerun resumes). A stop request (SIGTERM/SIGINT) ends
    the process within ``stop_timeout_s`` seconds, even mid-kernel. ``check_memory`` refuses up
    front a config whose estimated peak memory exceeds the device's. A run directory holding a
    finished run is refused unless ``overwrite`` moves that run aside first (``optbench.run.rerun``)."""

    time_limit_s: float | None = None
    stop_timeout_s: float = 30.0
    check_memory: bool = True
    overwrite: bool = False

    def __post_init__(self) -> None:
        if self.time_limit_s is not None and not (self.time_limit_s > 0 and math.isfinite(self.time_limit_s)):
            raise ConfigError(f"run.time_limit_s must be a positive number of seconds, got {self.time_limit_s}; "
                              "use run.time_limit_s=null for no time limit")
        positive(**{"run.stop_timeout_s": self.stop_timeout_s})


# ------------------------------------------------------------------------------ stopping, profile
@dataclass
class StoppingConfig:
    """Early stopping (``patience`` > 0: stop as ``stopped_early`` after ``patience`` evaluations
    without an improvement of ``metric`` by more than ``min_delta``) and the loss-spike guard
    (``spike_factor``: a loss above ``spike_factor`` x the median of the last ``spike_window``
    losses is a spike; ``spike_action`` skip: no update for that step, and ``loss_spike`` after
    ``max_skips`` skips in a row; stop: end the run as ``loss_spike``)."""

    name: str = "none"
    metric: str = "loss"  # "loss" (the eval loss) or an eval metric's name, e.g. nrmse/temperature
    mode: str = "min"  # min | max: which direction is better
    patience: int = 0  # evaluations without improvement before stopping (0: off)
    min_delta: float = 0.0
    spike_factor: float | None = None  # null: no spike guard
    spike_window: int = 20
    spike_action: str = "skip"  # skip | stop
    max_skips: int = 5

    def __post_init__(self) -> None:
        one_of("stopping.mode", self.mode, ("min", "max"))
        one_of("stopping.spike_action", self.spike_action, ("skip", "stop"))
        non_negative(**{"stopping.patience": self.patience, "stopping.min_delta": self.min_delta})
        positive(**{"stopping.spike_window": self.spike_window, "stopping.max_skips": self.max_skips})
        if self.spike_factor is not None and not (self.spike_factor > 1 and math.isfinite(self.spike_factor)):
            raise ConfigError(f"stopping.spike_factor must be > 1 (a multiple of the recent median loss), "
                              f"got {self.spike_factor}; use stopping.spike_factor=null to turn the guard off")


@dataclass
class ProfileConfig:
    """torch.profiler over steps ``skip_first + wait`` .. (``warmup`` then ``active`` recorded steps),
    on rank 0 (``ranks: all``: every rank); traces in ``<run dir>/profile``; ``memory_snapshot``
    (CUDA) records the allocator's history and dumps it at the end of the loop, OOM included.
    ``name``: ``none`` (no profiler) or ``trace``."""

    name: str = "none"
    skip_first: int = 3  # steps before the schedule starts (the timing warm-up by default)
    wait: int = 1
    warmup: int = 1
    active: int = 3
    ranks: str = "0"  # 0 | all
    record_shapes: bool = False
    profile_memory: bool = False
    with_stack: bool = False
    top_ops: int = 10  # rows of the top-operators table (by self time)
    memory_snapshot: bool = False

    @property
    def enabled(self) -> bool:
        return self.name != "none"

    def __post_init__(self) -> None:
        one_of("profile", self.name, PROFILES)
        one_of("profile.ranks", self.ranks, ("0", "all"))
        non_negative(**{"profile.skip_first": self.skip_first, "profile.wait": self.wait,
                         "profile.warmup": self.warmup})
        positive(**{"profile.active": self.active, "profile.top_ops": self.top_ops})
