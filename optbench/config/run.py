"""Schemas of the run: the loop (``train``), run control (``stopping``, ``profile``) and
``optbench estimate``."""

from __future__ import annotations

from dataclasses import dataclass

from optbench.config.checks import non_negative, one_of, positive
from optbench.errors import ConfigError

SCHEDULES = ("cosine", "onecycle", "constant")
DEVICES = ("auto", "cpu", "cuda")


# ---------------------------------------------------------------------------------------- train
@dataclass
class TrainConfig:
    """The loop. ``batch_size`` is per micro-step and per device; the samples per optimizer step
    are ``batch_size * grad_accum * world_size``.

    Checkpoints: every ``save_every`` steps (0: only when SIGTERM/SIGINT stops the run) into
    ``checkpoint_dir`` (null: ``<run dir>/checkpoints``), keeping the newest ``keep_last`` (0: all);
    ``resume`` is ``auto`` (the newest checkpoint there, if any), ``none`` or a checkpoint path."""

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
    log_every: int = 1
    eval_every: int = 0
    eval_batches: int = 2
    timing_warmup: int = 3
    track_memory: bool = True
    device: str = "auto"
    progress: str = "auto"
    save_every: int = 0
    keep_last: int = 2
    resume: str = "auto"
    checkpoint_dir: str | None = None
    # run control (optbench.run.loop.stopping / watchdog, optbench.run.loop.oom)
    max_minutes: float | None = None  # wall-clock budget of the loop: checkpoint and stop (time_limit)
    stop_timeout_s: float = 30.0  # a stop request ends the process within this bound, even mid-kernel
    check_memory: bool = True  # refuse up front a config whose estimate exceeds the device's memory
    log_level: str = "auto"  # console: auto (warning beside a progress bar, else info) | warning | info | debug

    def __post_init__(self) -> None:
        positive(
            **{
                "train.steps": self.steps,
                "train.batch_size": self.batch_size,
                "train.seq_len": self.seq_len,
                "train.grad_accum": self.grad_accum,
                "train.lr": self.lr,
                "train.log_every": self.log_every,
            }
        )
        non_negative(
            **{
                "train.warmup_steps": self.warmup_steps,
                "train.eval_every": self.eval_every,
                "train.eval_batches": self.eval_batches,
                "train.timing_warmup": self.timing_warmup,
                "train.save_every": self.save_every,
                "train.keep_last": self.keep_last,
            }
        )
        if not self.resume:
            raise ConfigError("train.resume is empty; use auto, none or the path of a checkpoint")
        one_of("train.schedule", self.schedule, SCHEDULES)
        if self.schedule == "onecycle" and self.warmup_steps >= self.steps:
            raise ConfigError(
                f"train.schedule=onecycle needs train.warmup_steps ({self.warmup_steps}) < "
                f"train.steps ({self.steps})"
            )
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ConfigError(f"train.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if self.clip_grad is not None and self.clip_grad <= 0:
            raise ConfigError(
                f"train.clip_grad must be positive, got {self.clip_grad}; use train.clip_grad=null "
                "to turn clipping off"
            )
        if self.steps <= self.timing_warmup:
            raise ConfigError(
                f"train.steps={self.steps} leaves no timed step after train.timing_warmup="
                f"{self.timing_warmup}; raise train.steps or lower train.timing_warmup"
            )
        one_of("train.device", self.device, DEVICES)
        one_of("train.progress", self.progress, ("auto", "bar", "log"))
        one_of("train.log_level", self.log_level, LOG_LEVELS)
        if self.max_minutes is not None and not self.max_minutes > 0:
            raise ConfigError(f"train.max_minutes must be positive, got {self.max_minutes}; "
                              "use train.max_minutes=null for no time budget")
        positive(**{"train.stop_timeout_s": self.stop_timeout_s})


LOG_LEVELS = ("auto", "warning", "info", "debug")


# ---------------------------------------------------------------------------------- run control
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
        if self.spike_factor is not None and not self.spike_factor > 1:
            raise ConfigError(f"stopping.spike_factor must be > 1 (a multiple of the recent median loss), "
                              f"got {self.spike_factor}; use stopping.spike_factor=null to turn the guard off")


@dataclass
class ProfileConfig:
    """torch.profiler over steps ``skip_first + wait`` .. (``warmup`` then ``active`` recorded steps),
    on rank 0 (``ranks: all``: every rank); traces in ``<run dir>/profile``; ``memory_snapshot``
    (CUDA) records the allocator's history and dumps it at the end of the loop, OOM included."""

    enabled: bool = False
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

    def __post_init__(self) -> None:
        one_of("profile.ranks", self.ranks, ("0", "all"))
        non_negative(**{"profile.skip_first": self.skip_first, "profile.wait": self.wait,
                         "profile.warmup": self.warmup})
        positive(**{"profile.active": self.active, "profile.top_ops": self.top_ops})


# ------------------------------------------------------------------------------------- estimate
ESTIMATE_GPUS = ("h100", "a100", "h200", "none")
ESTIMATE_FORMATS = ("table", "json", "markdown")


@dataclass
class EstimateConfig:
    """``optbench estimate``: the device the estimate is judged against and how it is printed.

    ``world_size`` null means the run's own (``parallel.nproc_per_node``; 1 for ``parallel=single``).
    ``gpu`` names the card (its memory and dense peak); ``device_gb`` (GiB) overrides its memory, or
    gives one for ``gpu=none``. ``headroom`` is the fraction of the device kept free for the CUDA
    context, NCCL and allocator fragmentation (MemTracker counts allocated bytes, like
    ``torch.cuda.max_memory_allocated``). ``search`` traces further steps (twice the micro-batch,
    then a bracketed search) for the largest micro-batch that fits. ``mfu`` is the utilisation
    tokens/s are predicted at. ``stacked`` (null: whenever the blocks allow) traces two or three
    short copies of the model and stacks their blocks (``optbench.estimate.tracer``); false traces the whole
    model (the same bytes, several times slower for 50 blocks)."""

    world_size: int | None = None
    gpu: str = "h100"
    device_gb: float | None = None
    headroom: float = 0.1
    format: str = "table"
    mfu: float = 0.4
    search: bool = True
    stacked: bool | None = None
    # the predicted step (optbench.estimate.predict): on estimate.gpu's card (a roofline), or on
    # this machine (the per-op benchmark) with gpu=none; link_gbps states the collectives' bandwidth
    predict: bool = True
    link_gbps: float | None = None
    # optbench plan: samples per optimizer step over all ranks (null: the config's own) and how
    # many of the ranked configurations to print
    global_batch: int | None = None
    top: int = 5

    def __post_init__(self) -> None:
        if self.link_gbps is not None:
            positive(**{"estimate.link_gbps": self.link_gbps})
        if self.global_batch is not None:
            positive(**{"estimate.global_batch": self.global_batch})
        positive(**{"estimate.top": self.top})
        if self.world_size is not None and self.world_size < 1:
            raise ConfigError(
                f"estimate.world_size must be >= 1, got {self.world_size}; use the number of GPUs of the "
                "job, or null for parallel.nproc_per_node"
            )
        if self.gpu not in ESTIMATE_GPUS:
            raise ConfigError(
                f"estimate.gpu={self.gpu} is unknown; use {', '.join(ESTIMATE_GPUS)} "
                "(with estimate.device_gb=N for another card)"
            )
        if self.device_gb is not None:
            positive(**{"estimate.device_gb": self.device_gb})
        if not 0.0 <= self.headroom < 1.0:
            raise ConfigError(f"estimate.headroom must be in [0, 1), got {self.headroom}")
        one_of("estimate.format", self.format, ESTIMATE_FORMATS)
        if not 0.0 < self.mfu <= 1.0:
            raise ConfigError(f"estimate.mfu must be in (0, 1], got {self.mfu}")
