"""Schemas of the data (``optbench.data``): the datasets (the ``data`` group) and the torch
DataLoader around them (the ``dataloader`` group)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from omegaconf import MISSING

from optbench.config.checks import non_negative, one_of, positive
from optbench.config.roles import CLIMATE_ROLES, PHYSICAL_ROLES
from optbench.errors import ConfigError


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
        positive(**{"data.branching": self.branching, "data.num_samples": self.num_samples})
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
        one_of("data.dtype", self.dtype, ("auto", "uint16", "uint32"))
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
        non_negative(
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
    reader: str = "auto"  # auto: chunks read directly where the layout allows (see data/netcdf/source.py) | xarray
    prefetch: int = 2  # batches a background thread prepares ahead without worker processes (0: none)
    read_ahead: int = 1  # blocks a background thread reads ahead, in each process (0: none)
    augment: AugmentConfig = field(default_factory=AugmentConfig)
    text: str | None = None  # JSON lines {"time": ..., "text": ...} paired with the steps (task=climate_text)
    # how those texts become tokens: a tokenizer.json or a directory holding one, "bytes", or null
    # (bytes; with model=hf the model.hf.config directory's tokenizer.json)
    tokenizer: str | None = None

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
            one_of(f"data.roles.{var}", role, CLIMATE_ROLES)
        positive(**{"data.history": self.history, "data.block_mb": self.block_mb})
        non_negative(**{"data.prefetch": self.prefetch, "data.read_ahead": self.read_ahead})
        one_of("data.reader", self.reader, ("auto", "xarray"))
        if self.block_size is not None:
            positive(**{"data.block_size": self.block_size})
        if self.resolution is not None:
            positive(**{"data.resolution": self.resolution})
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


# ----------------------------------------------------------------------------------- dataloader
@dataclass
class DataLoaderConfig:
    """torch DataLoader knobs. ``prefetch_factor`` and ``persistent_workers`` only apply with
    ``num_workers > 0``. The default preset is ``baseline``, not ``none``: a loader always runs, and
    the baseline one (no worker processes) is the reference the ``tuned`` preset is measured against."""

    name: str = "baseline"
    num_workers: int = 0
    pin_memory: bool = False
    persistent_workers: bool = False
    prefetch_factor: int | None = None

    def __post_init__(self) -> None:
        non_negative(**{"dataloader.num_workers": self.num_workers})
        if self.num_workers == 0 and (self.persistent_workers or self.prefetch_factor is not None):
            raise ConfigError(
                "dataloader.persistent_workers and dataloader.prefetch_factor need "
                "dataloader.num_workers > 0; set num_workers or reset them (false / null)"
            )
        if self.prefetch_factor is not None:
            positive(**{"dataloader.prefetch_factor": self.prefetch_factor})
