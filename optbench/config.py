"""Typed config schemas, registered in Hydra's ConfigStore.

Every YAML preset under ``conf/<group>/`` starts with ``defaults: [base_<group>, _self_]`` so Hydra
checks it against the dataclass here (a typo or a wrong type fails with Hydra's own message).
``OmegaConf.to_object`` then builds these dataclasses, and their ``__post_init__`` runs the
cross-field checks, which raise ``ConfigError`` with a message that names the fix.

Code after composition reads typed fields (``cfg.train.steps``), never ``cfg.get(...)``.
Groups whose presets differ in shape (``data``, ``task``) use a base dataclass and one subclass per
kind; the top-level field is typed with the base so any registered kind can be selected.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import MissingMandatoryValue

from optbench.data.roles import CLIMATE_ROLES, PHYSICAL_ROLES
from optbench.errors import ConfigError

PRECISIONS = ("fp32", "tf32", "fp16", "bf16")
SCHEDULES = ("cosine", "onecycle", "constant")
DEVICES = ("auto", "cpu", "cuda")


def _positive(**values: int | float) -> None:
    for key, value in values.items():
        if value <= 0:
            raise ConfigError(f"{key} must be positive, got {value}")


def _one_of(key: str, value: Any, choices: tuple | list) -> None:
    """The one "X is unknown" check: ``value`` must be one of ``choices``."""
    if value not in choices:
        shown = ", ".join("null" if c is None else str(c) for c in choices)
        raise ConfigError(f"{key}={value} is unknown; use one of {shown}")


def _non_negative(**values: int | float) -> None:
    for key, value in values.items():
        if value < 0:
            raise ConfigError(f"{key} must be >= 0, got {value}")


# ---------------------------------------------------------------------------------------- model
@dataclass
class ModelConfig:
    """Shape of the transformer trunk plus the token vocabulary of the lm task."""

    name: str = "custom"
    dim: int = 128
    layers: int = 4
    heads: int = 4
    ffn_dim: int = 512
    vocab_size: int = 1024
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    init_std: float = 0.02

    def __post_init__(self) -> None:
        _positive(
            **{
                "model.dim": self.dim,
                "model.layers": self.layers,
                "model.heads": self.heads,
                "model.ffn_dim": self.ffn_dim,
                "model.vocab_size": self.vocab_size,
            }
        )
        if self.dim % self.heads:
            divisors = [
                h
                for h in range(max(1, self.heads - 16), self.heads + 17)
                if self.dim % h == 0 and (self.dim // h) % 2 == 0
            ]
            raise ConfigError(
                f"model.dim={self.dim} is not divisible by model.heads={self.heads}; "
                f"pick heads that divide the width (e.g. {', '.join(map(str, divisors[-4:]))})"
            )
        if (self.dim // self.heads) % 2:
            raise ConfigError(
                f"head dim model.dim/model.heads={self.dim // self.heads} is odd; RoPE needs an even "
                "head dim"
            )

    @property
    def head_dim(self) -> int:
        return self.dim // self.heads


# ------------------------------------------------------------------------------------ precision
@dataclass
class PrecisionConfig:
    """Numerics of the training step.

    ``autocast`` is the dtype autocast runs matmuls in (null = no autocast); ``tf32`` allows TF32
    matmuls on CUDA; ``grad_scaler`` enables loss scaling (fp16 needs it).
    """

    name: str = "fp32"
    autocast: str | None = None
    tf32: bool = False
    grad_scaler: bool = False

    def __post_init__(self) -> None:
        _one_of("precision", self.name, PRECISIONS)
        _one_of("precision.autocast", self.autocast, (None, "bfloat16", "float16"))
        if self.autocast == "float16" and not self.grad_scaler:
            raise ConfigError(
                "precision.autocast=float16 without precision.grad_scaler=true underflows gradients; "
                "use precision=fp16 (which enables the scaler) or precision=bf16"
            )


# ----------------------------------------------------------------------------------------- task
@dataclass
class TaskConfig:
    name: str = MISSING


@dataclass
class LMTaskConfig(TaskConfig):
    """Next-token prediction; the auxiliary loss is a z-loss on the logits."""

    name: str = "lm"
    z_loss_weight: float = 1e-4

    def __post_init__(self) -> None:
        _non_negative(**{"task.z_loss_weight": self.z_loss_weight})


@dataclass
class ClimateTaskConfig(TaskConfig):
    """Next-step forecasting of a climate datacube (``data=netcdf``): the (variable x level)
    channels of ``data.history`` steps are cut into ``patch_size`` x ``patch_size`` lat/lon patches
    (one token each), a bidirectional trunk, and a linear head back to the grid. The main loss is
    the MSE of the normalized next step over valid points; on ``loss_freq`` steps the auxiliary
    losses are added with these weights: the inverse (reconstruction of the last input step at
    ``loss_freq.num_queries`` sampled points) and the physics constraints (humidity bounds,
    global-mean mass and energy conservation between input and prediction). ``lead_steps``: the
    forecast's lead in time steps (inputs are that many steps apart too); eval rolls the model out
    autoregressively ``rollout_steps`` times and scores every lead (lat-weighted RMSE and ACC against
    the training climatology, beside persistence and climatology)."""

    name: str = "climate"
    patch_size: int = 4
    lead_steps: int = 1
    rollout_steps: int = 3
    inverse_weight: float = 0.01
    humidity_weight: float = 0.1
    mass_weight: float = 0.01
    energy_weight: float = 0.01

    def __post_init__(self) -> None:
        _positive(**{"task.patch_size": self.patch_size, "task.lead_steps": self.lead_steps,
                     "task.rollout_steps": self.rollout_steps})
        _non_negative(
            **{
                "task.inverse_weight": self.inverse_weight,
                "task.humidity_weight": self.humidity_weight,
                "task.mass_weight": self.mass_weight,
                "task.energy_weight": self.energy_weight,
            }
        )


@dataclass
class ClimateTextTaskConfig(TaskConfig):
    """Text conditioned on climate (``data=netcdf data.text=PAIRS.jsonl``, with a ``fusion`` kind):
    next-token loss on the text of a sample's target time, the climate history window encoded into
    ``patch_size`` x ``patch_size`` patch tokens (the climate task's patching) that the decoder
    reads through the fusion layers. Eval reports the loss with the true climate, with the climate
    of another time (each eval sample gets the climate of the one ``shuffle_offset`` samples further
    in the eval split, cyclically; 0 = half the split) and with the decoder alone."""

    name: str = "climate_text"
    patch_size: int = 4
    shuffle_offset: int = 0

    def __post_init__(self) -> None:
        _positive(**{"task.patch_size": self.patch_size})
        _non_negative(**{"task.shuffle_offset": self.shuffle_offset})


# ----------------------------------------------------------------------------------------- data
@dataclass
class DataConfig:
    name: str = MISSING


@dataclass
class SyntheticDataConfig(DataConfig):
    """Seeded Markov-chain tokens: each token has ``branching`` likely successors; with probability
    ``noise`` a uniformly random token is drawn instead. Loss can fall from ln(vocab) towards the
    chain's entropy."""

    name: str = "synthetic"
    branching: int = 4
    noise: float = 0.1
    num_samples: int = 1_000_000

    def __post_init__(self) -> None:
        _positive(**{"data.branching": self.branching, "data.num_samples": self.num_samples})
        if not 0.0 <= self.noise <= 1.0:
            raise ConfigError(f"data.noise must be in [0, 1], got {self.noise}")


@dataclass
class TokensDataConfig(DataConfig):
    """A pre-tokenized memmap file (``optbench data tokenize`` writes one with a .json sidecar)."""

    name: str = "tokens"
    path: str = MISSING
    dtype: str = "auto"
    eval_fraction: float = 0.05

    def __post_init__(self) -> None:
        _one_of("data.dtype", self.dtype, ("auto", "uint16", "uint32"))
        if not 0.0 < self.eval_fraction < 1.0:
            raise ConfigError(f"data.eval_fraction must be in (0, 1), got {self.eval_fraction}")


@dataclass
class AugmentConfig:
    """Physics-informed augmentation of the training batches (the plan's list), on the batch's
    device, vectorized over the batch and seeded by (train.seed, step, micro-batch). With
    probability ``prob`` a sample is augmented: Gaussian noise on its input steps with a per-role
    std (in units of each channel's std), anomalies scaled by a factor drawn from
    ``scale_factor_range``, with probability ``roll_prob`` a random roll in longitude (null = 0.3
    on a global grid and 0 on a regional one; a number > 0 on a regional grid is refused), with
    probability ``temporal_shift_prob`` its input history lagged by one step.
    Humidity always stays within its physical bounds."""

    enabled: bool = True
    prob: float = 0.5
    temperature_noise_std: float = 0.1
    pressure_noise_std: float = 0.05
    humidity_noise_std: float = 0.02
    roll_prob: float | None = None
    temporal_shift_prob: float = 0.2
    scale_factor_range: list[float] = field(default_factory=lambda: [0.95, 1.05])

    def __post_init__(self) -> None:
        for key in ("prob", "roll_prob", "temporal_shift_prob"):
            value = getattr(self, key)
            if value is not None and not 0.0 <= value <= 1.0:
                raise ConfigError(f"data.augment.{key} must be in [0, 1], got {value}")
        _non_negative(
            **{
                "data.augment.temperature_noise_std": self.temperature_noise_std,
                "data.augment.pressure_noise_std": self.pressure_noise_std,
                "data.augment.humidity_noise_std": self.humidity_noise_std,
            }
        )
        low_high = self.scale_factor_range
        if len(low_high) != 2 or not 0.0 < low_high[0] <= low_high[1]:
            raise ConfigError(
                f"data.augment.scale_factor_range must be [low, high] with 0 < low <= high, got {low_high}"
            )


@dataclass
class NetCDFDataConfig(DataConfig):
    """Climate fields from NetCDF4/HDF5 or NetCDF3 files or Zarr stores, read lazily with xarray.

    ``paths``: a file, a glob, or a list of them (several files are joined along time).
    ``variables``: variable names, or roles (temperature, pressure, humidity, u_wind, v_wind) that
    one variable of the file has by its CF standard_name or name. ``roles`` maps a variable name to
    its role where neither tells. ``levels``: level values to keep (null = all). A sample is
    ``history`` steps -> the next one; the last ``eval_fraction`` of the time steps is the eval
    split. ``resolution`` (degrees) regrids with xarray interp (null = native grid).
    ``block_size``: samples read per block (null = from the file's time chunking, capped at
    ``block_mb``). ``stats_cache``: where normalization statistics are cached (null = the optbench
    cache directory). ``humidity_bounds``: physical [low, high] of humidity (null = from units).
    ``time_dim``: the name of the time dimension (null = found from CF attributes or the name:
    time, valid_time, t, month, ...; its coordinate may be CF times or plain numbers)."""

    name: str = "netcdf"
    paths: Any = MISSING
    variables: list[str] = field(default_factory=lambda: list(PHYSICAL_ROLES))
    roles: dict[str, str] = field(default_factory=dict)
    levels: list[float] | None = None
    history: int = 2
    eval_fraction: float = 0.1
    resolution: float | None = None
    block_size: int | None = None
    block_mb: int = 256
    stats_cache: str | None = None
    humidity_bounds: list[float] | None = None
    time_dim: str | None = None
    augment: AugmentConfig = field(default_factory=AugmentConfig)
    text: str | None = None  # JSON lines {"time": ..., "text": ...} paired with the steps (task=climate_text)

    def __post_init__(self) -> None:
        if isinstance(self.paths, str):
            self.paths = [self.paths]
        if not isinstance(self.paths, (list, tuple)) or not self.paths or not all(
            isinstance(p, str) and p for p in self.paths
        ):
            raise ConfigError(
                f"data.paths must be a file, a glob or a list of them, got {self.paths!r}; "
                "e.g. data.paths=[data.nc]"
            )
        self.paths = list(self.paths)
        if not self.variables:
            raise ConfigError("data.variables is empty; name at least one variable, e.g. [temperature]")
        for var, role in self.roles.items():
            _one_of(f"data.roles.{var}", role, CLIMATE_ROLES)
        _positive(**{"data.history": self.history, "data.block_mb": self.block_mb})
        if self.block_size is not None:
            _positive(**{"data.block_size": self.block_size})
        if self.resolution is not None:
            _positive(**{"data.resolution": self.resolution})
        if not 0.0 < self.eval_fraction < 1.0:
            raise ConfigError(f"data.eval_fraction must be in (0, 1), got {self.eval_fraction}")
        if self.augment.enabled and self.augment.temporal_shift_prob > 0 and self.history < 2:
            raise ConfigError(
                f"data.augment.temporal_shift_prob={self.augment.temporal_shift_prob} lags the input history by "
                f"one step, which needs data.history >= 2 (got {self.history}); set "
                "data.augment.temporal_shift_prob=0 or raise data.history"
            )
        if self.humidity_bounds is not None and (
            len(self.humidity_bounds) != 2 or not self.humidity_bounds[0] < self.humidity_bounds[1]
        ):
            raise ConfigError(f"data.humidity_bounds must be [low, high] with low < high, got {self.humidity_bounds}")


# ------------------------------------------------------------------------------------ optimizer
@dataclass
class OptimizerConfig:
    """AdamW; ``impl`` picks torch's multi-tensor (foreach) or fused kernel.

    Every kind uses AdamW for at least some parameters, so its fields live here; a kind with more
    knobs subclasses this (``CPUOffloadOptimizerConfig``, ``MuonOptimizerConfig``) and is selected
    by the preset's ``base_<kind>`` schema."""

    name: str = "adamw"
    impl: str = "foreach"
    weight_decay: float = 0.1
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8

    def __post_init__(self) -> None:
        _one_of("optimizer.impl", self.impl, ("foreach", "fused"))
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            raise ConfigError(f"optimizer.betas must be two numbers in [0, 1), got {self.betas}")
        _non_negative(**{"optimizer.weight_decay": self.weight_decay})
        _positive(**{"optimizer.eps": self.eps})

    def offloads(self) -> tuple[bool, bool]:
        """(optimizer states live on the host, device gradients are freed as they are copied there)."""
        return False, False

    def state_bytes(self, *, params: int, matrices: int) -> int:
        """Bytes of optimizer state for ``params`` parameters, ``matrices`` of them in the blocks'
        weight matrices: AdamW keeps exp_avg and exp_avg_sq in fp32 (8 B/param)."""
        return 8 * params


@dataclass
class CPUOffloadOptimizerConfig(OptimizerConfig):
    """torchao's ``CPUOffloadOptimizer`` around AdamW (ZeRO-Offload for one GPU): optimizer state
    and the step live on the CPU. ``offload_gradients`` also frees device gradients after their copy
    (not compatible with gradient accumulation); tensors under ``minimal_size`` elements stay on
    the device."""

    name: str = "cpu_offload"
    impl: str = "fused"
    offload_gradients: bool = False
    minimal_size: int = 4096

    def __post_init__(self) -> None:
        super().__post_init__()
        _positive(**{"optimizer.minimal_size": self.minimal_size})

    def offloads(self) -> tuple[bool, bool]:
        return True, self.offload_gradients


MUON_LR_ADJUSTMENTS = ("original", "match_rms_adamw")


@dataclass
class MuonOptimizerConfig(OptimizerConfig):
    """``torch.optim.Muon`` for the 2-D weight matrices of the transformer trunk, AdamW (the fields
    inherited from OptimizerConfig) for everything else: embeddings, head, norms. With
    ``adjust_lr_fn=match_rms_adamw`` Muon reuses AdamW's learning rate and weight decay."""

    name: str = "muon"
    momentum: float = 0.95
    nesterov: bool = True
    ns_steps: int = 5
    adjust_lr_fn: str = "match_rms_adamw"

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0.0 <= self.momentum < 1.0:
            raise ConfigError(f"optimizer.momentum must be in [0, 1), got {self.momentum}")
        _positive(**{"optimizer.ns_steps": self.ns_steps})
        _one_of("optimizer.adjust_lr_fn", self.adjust_lr_fn, MUON_LR_ADJUSTMENTS)

    def state_bytes(self, *, params: int, matrices: int) -> int:
        """Muon keeps one fp32 momentum for the blocks' matrices, AdamW two states for the rest."""
        return 4 * matrices + 8 * (params - matrices)


# -------------------------------------------------------------------------- optimization groups
COMPILE_MODES = ("off", "default", "reduce-overhead", "max-autotune")
CHECKPOINTING_MODES = ("none", "selective", "full")
ATTENTION_KERNELS = ("sdpa", "flex", "math")
PARALLEL_MODES = ("single", "ddp", "fsdp2")


@dataclass
class CompileConfig:
    """torch.compile per transformer block; ``mode`` is torch.compile's mode (off = eager)."""

    mode: str = "off"
    fullgraph: bool = False

    @property
    def name(self) -> str:
        """The preset's name: the mode it selects (one source of truth, not a second field)."""
        return self.mode

    def __post_init__(self) -> None:
        _one_of("compile.mode", self.mode, COMPILE_MODES)


@dataclass
class CheckpointingConfig:
    """Activation checkpointing (non-reentrant): ``full`` wraps every block, ``selective`` every
    ``every``-th block, ``none`` keeps all activations."""

    mode: str = "none"
    every: int = 2

    @property
    def name(self) -> str:
        """The preset's name: the mode it selects (one source of truth, not a second field)."""
        return self.mode

    def __post_init__(self) -> None:
        _one_of("checkpointing.mode", self.mode, CHECKPOINTING_MODES)
        _positive(**{"checkpointing.every": self.every})


@dataclass
class AttentionConfig:
    """The attention kernel: ``sdpa`` (F.scaled_dot_product_attention), ``flex`` (FlexAttention
    with a block mask) or ``math`` (explicit softmax(QK^T)V, the reference)."""

    kernel: str = "sdpa"

    @property
    def name(self) -> str:
        """The preset's name: the kernel it selects (one source of truth, not a second field)."""
        return self.kernel

    def __post_init__(self) -> None:
        _one_of("attention.kernel", self.kernel, ATTENTION_KERNELS)


@dataclass
class ParallelConfig:
    """Data parallelism. ``nproc_per_node`` local workers (self-launched unless under torchrun);
    ``backend`` auto picks nccl on CUDA and gloo on CPU."""

    mode: str = "single"
    nproc_per_node: int = 1
    backend: str = "auto"
    reshard_after_forward: bool = True
    # FSDP2's own CPU offload (fully_shard(offload_policy=CPUOffloadPolicy())): sharded parameters,
    # gradients and optimizer state live on the CPU and the optimizer steps there.
    cpu_offload: bool = False

    @property
    def name(self) -> str:
        """The preset's name: the mode it selects (one source of truth, not a second field)."""
        return self.mode

    def __post_init__(self) -> None:
        _one_of("parallel.mode", self.mode, PARALLEL_MODES)
        if self.cpu_offload and self.mode != "fsdp2":
            raise ConfigError(
                f"parallel.cpu_offload=true is FSDP2's CPUOffloadPolicy; it needs parallel=fsdp2, not "
                f"parallel={self.mode}"
            )
        _one_of("parallel.backend", self.backend, ("auto", "gloo", "nccl"))
        if self.mode == "single" and self.nproc_per_node != 1:
            raise ConfigError(
                f"parallel.mode=single runs one process but parallel.nproc_per_node={self.nproc_per_node}; "
                "use parallel=ddp or parallel=fsdp2 for several workers"
            )


@dataclass
class NCCLConfig:
    """Environment variables for NCCL (the plan's phase-1 tuning); applied only where NCCL runs."""

    name: str = "default"
    env: dict[str, str] = field(default_factory=dict)


# ----------------------------------------------------------------------------------- dataloader
@dataclass
class DataLoaderConfig:
    """torch DataLoader knobs. ``prefetch_factor`` and ``persistent_workers`` only apply with
    ``num_workers > 0``."""

    name: str = "baseline"
    num_workers: int = 0
    pin_memory: bool = False
    persistent_workers: bool = False
    prefetch_factor: int | None = None

    def __post_init__(self) -> None:
        _non_negative(**{"dataloader.num_workers": self.num_workers})
        if self.num_workers == 0 and (self.persistent_workers or self.prefetch_factor is not None):
            raise ConfigError(
                "dataloader.persistent_workers and dataloader.prefetch_factor need "
                "dataloader.num_workers > 0; set num_workers or reset them (false / null)"
            )
        if self.prefetch_factor is not None:
            _positive(**{"dataloader.prefetch_factor": self.prefetch_factor})


# ------------------------------------------------------------------------------------ loss_freq
@dataclass
class LossFreqConfig:
    """Auxiliary losses are computed on steps where ``step % every == 0`` only; ``num_queries`` is
    how many points a task samples for its auxiliary loss (the plan's decoder queries)."""

    name: str = "every_step"
    every: int = 1
    num_queries: int = 2048

    def __post_init__(self) -> None:
        _positive(**{"loss_freq.every": self.every, "loss_freq.num_queries": self.num_queries})


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
    # run control (optbench.loop.stopping / watchdog, optbench.loop.oom)
    max_minutes: float | None = None  # wall-clock budget of the loop: checkpoint and stop (time_limit)
    stop_timeout_s: float = 30.0  # a stop request ends the process within this bound, even mid-kernel
    check_memory: bool = True  # refuse up front a config whose estimate exceeds the device's memory
    log_level: str = "auto"  # console: auto (warning beside a progress bar, else info) | warning | info | debug

    def __post_init__(self) -> None:
        _positive(
            **{
                "train.steps": self.steps,
                "train.batch_size": self.batch_size,
                "train.seq_len": self.seq_len,
                "train.grad_accum": self.grad_accum,
                "train.lr": self.lr,
                "train.log_every": self.log_every,
            }
        )
        _non_negative(
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
        _one_of("train.schedule", self.schedule, SCHEDULES)
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
        _one_of("train.device", self.device, DEVICES)
        _one_of("train.progress", self.progress, ("auto", "bar", "log"))
        _one_of("train.log_level", self.log_level, LOG_LEVELS)
        if self.max_minutes is not None and not self.max_minutes > 0:
            raise ConfigError(f"train.max_minutes must be positive, got {self.max_minutes}; "
                              "use train.max_minutes=null for no time budget")
        _positive(**{"train.stop_timeout_s": self.stop_timeout_s})


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
        _one_of("stopping.mode", self.mode, ("min", "max"))
        _one_of("stopping.spike_action", self.spike_action, ("skip", "stop"))
        _non_negative(**{"stopping.patience": self.patience, "stopping.min_delta": self.min_delta})
        _positive(**{"stopping.spike_window": self.spike_window, "stopping.max_skips": self.max_skips})
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
        _one_of("profile.ranks", self.ranks, ("0", "all"))
        _non_negative(**{"profile.skip_first": self.skip_first, "profile.wait": self.wait,
                         "profile.warmup": self.warmup})
        _positive(**{"profile.active": self.active, "profile.top_ops": self.top_ops})


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
    tokens/s are predicted at."""

    world_size: int | None = None
    gpu: str = "h100"
    device_gb: float | None = None
    headroom: float = 0.1
    format: str = "table"
    mfu: float = 0.4
    search: bool = True

    def __post_init__(self) -> None:
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
            _positive(**{"estimate.device_gb": self.device_gb})
        if not 0.0 <= self.headroom < 1.0:
            raise ConfigError(f"estimate.headroom must be in [0, 1), got {self.headroom}")
        _one_of("estimate.format", self.format, ESTIMATE_FORMATS)
        if not 0.0 < self.mfu <= 1.0:
            raise ConfigError(f"estimate.mfu must be in (0, 1], got {self.mfu}")


# --------------------------------------------------------------------------------------- fusion
FUSION_KINDS = ("none", "add", "cross_attention", "gated")


@dataclass
class FusionConfig:
    """How the climate tokens reach the decoder (``task=climate_text``); see ``optbench.fusion``.

    ``kind``: ``none``; ``add`` (mean-pooled climate tokens, projected and added to every text
    embedding through a learned per-channel gate); ``cross_attention`` (a cross-attention + MLP
    layer with residual connections before every ``every``-th decoder layer); ``gated`` (the same
    layers with Flamingo's tanh gates, initialized at 0, so the untrained model is the base model).
    ``encoder_layers``: bidirectional transformer blocks over the climate patch tokens.
    ``freeze_base``: the decoder (embedding, blocks, norm, head) gets no gradients and no optimizer
    state. ``base_checkpoint``: an optbench checkpoint directory of a ``task=lm`` run whose model
    initializes the decoder."""

    name: str = "none"
    kind: str = "none"
    every: int = 2
    encoder_layers: int = 1
    freeze_base: bool = False
    base_checkpoint: str | None = None

    def __post_init__(self) -> None:
        if self.kind not in FUSION_KINDS:
            raise ConfigError(f"fusion.kind={self.kind} is unknown; use one of {', '.join(FUSION_KINDS)}")
        _positive(**{"fusion.every": self.every})
        _non_negative(**{"fusion.encoder_layers": self.encoder_layers})


# ------------------------------------------------------------------------------------------ top
@dataclass
class Config:
    model: ModelConfig = MISSING
    precision: PrecisionConfig = MISSING
    task: TaskConfig = MISSING
    data: DataConfig = MISSING
    optimizer: OptimizerConfig = MISSING
    dataloader: DataLoaderConfig = MISSING
    loss_freq: LossFreqConfig = MISSING
    compile: CompileConfig = MISSING
    checkpointing: CheckpointingConfig = MISSING
    attention: AttentionConfig = MISSING
    parallel: ParallelConfig = MISSING
    nccl: NCCLConfig = MISSING
    fusion: FusionConfig = field(default_factory=FusionConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    stopping: StoppingConfig = field(default_factory=StoppingConfig)
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    estimate: EstimateConfig = field(default_factory=EstimateConfig)


def register_configs() -> None:
    """Register the schemas as ``base_<group>`` nodes (idempotent)."""
    cs = ConfigStore.instance()
    cs.store(name="base_config", node=Config)
    cs.store(group="model", name="base_model", node=ModelConfig)
    cs.store(group="precision", name="base_precision", node=PrecisionConfig)
    cs.store(group="task", name="base_lm", node=LMTaskConfig)
    cs.store(group="task", name="base_climate", node=ClimateTaskConfig)
    cs.store(group="task", name="base_climate_text", node=ClimateTextTaskConfig)
    cs.store(group="fusion", name="base_fusion", node=FusionConfig)
    cs.store(group="data", name="base_synthetic", node=SyntheticDataConfig)
    cs.store(group="data", name="base_tokens", node=TokensDataConfig)
    cs.store(group="data", name="base_netcdf", node=NetCDFDataConfig)
    cs.store(group="optimizer", name="base_optimizer", node=OptimizerConfig)
    cs.store(group="optimizer", name="base_cpu_offload", node=CPUOffloadOptimizerConfig)
    cs.store(group="optimizer", name="base_muon", node=MuonOptimizerConfig)
    cs.store(group="dataloader", name="base_dataloader", node=DataLoaderConfig)
    cs.store(group="loss_freq", name="base_loss_freq", node=LossFreqConfig)
    cs.store(group="compile", name="base_compile", node=CompileConfig)
    cs.store(group="checkpointing", name="base_checkpointing", node=CheckpointingConfig)
    cs.store(group="attention", name="base_attention", node=AttentionConfig)
    cs.store(group="parallel", name="base_parallel", node=ParallelConfig)
    cs.store(group="nccl", name="base_nccl", node=NCCLConfig)
    cs.store(group="stopping", name="base_stopping", node=StoppingConfig)
    cs.store(group="profile", name="base_profile", node=ProfileConfig)


def to_config(cfg: DictConfig | Config) -> Config:
    """Turn a composed DictConfig into typed dataclasses; the schemas' checks run here."""
    if isinstance(cfg, Config):
        return cfg
    try:
        obj: Any = OmegaConf.to_object(cfg)
    except MissingMandatoryValue as exc:  # a ??? left in a preset, e.g. data.paths of data=netcdf
        example = {"data.paths": "data.paths=[data.nc] (`optbench data synth data.nc` writes one)",
                   "data.path": "data.path=corpus.bin (`optbench data tokenize TEXT corpus.bin` writes one)"}
        raise ConfigError(f"{exc.full_key} is required and has no value; pass "
                          f"{example.get(exc.full_key, exc.full_key + '=...')}") from exc
    assert isinstance(obj, Config), f"composed config is {type(obj).__name__}, not Config"
    return obj


register_configs()


def conf_dir() -> Path:
    """The directory of Hydra configs: in an installed wheel the copy packaged as ``optbench.conf``
    (``optbench/conf/`` inside the installed package), in a source checkout ``conf/`` beside the
    package. A real directory either way: ``optbench.conf`` has no ``__init__.py``, so
    ``importlib.resources.files`` would give a MultiplexedPath, whose ``str()`` Hydra cannot load."""
    package = Path(__file__).resolve().parent
    candidates = (package / "conf", package.parent / "conf")
    for candidate in candidates:
        if (candidate / "train.yaml").is_file():
            return candidate
    raise ConfigError(
        f"optbench's configs are missing (no train.yaml in {' or '.join(map(str, candidates))}); "
        "reinstall optbench (pip install --force-reinstall optbench) or run it from a source checkout"
    )


def compose(overrides: list[str] | tuple[str, ...] = (), *, config_name: str = "train") -> DictConfig:
    """Compose ``config_name`` with ``overrides`` exactly as the CLI does (outside ``@hydra.main``):
    for compare, validate, the benches and the tests."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    with initialize_config_dir(version_base="1.3", config_dir=str(conf_dir())):
        return hydra_compose(config_name=config_name, overrides=list(overrides))
