"""Schemas of the tasks (the ``task`` group; ``optbench.tasks``)."""

from __future__ import annotations

from dataclasses import dataclass

from omegaconf import MISSING

from optbench.config.checks import non_negative, one_of, positive
from optbench.errors import ConfigError


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
        non_negative(**{"task.z_loss_weight": self.z_loss_weight})


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
        positive(**{"task.patch_size": self.patch_size, "task.lead_steps": self.lead_steps,
                     "task.rollout_steps": self.rollout_steps})
        non_negative(
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
    next-token loss on a text paired with a sample, the climate history window encoded into
    ``patch_size`` x ``patch_size`` patch tokens (the climate task's patching) that the decoder
    reads through the fusion layers. ``text_mode``: which step of a sample its text is of —
    ``describe``: the last input step, ``forecast``: the target; null: as the captions file's
    sidecar says (``optbench data captions --mode``), ``describe`` for a file without one.
    Eval scores ``eval_samples`` samples spread over the eval split: the loss with the true
    climate, with another sample's climate (a seeded random derangement, ``shuffle_offset=0``, or
    the sample ``shuffle_offset`` places further, cyclically) and with the decoder alone; the gap
    (shuffled - true, per token) with a block-bootstrap 95% interval over time blocks.
    ``text_only``: the control — the same model trained and evaluated with an all-zero climate
    (everything but the information: the information gain is its loss minus the true-climate loss).
    ``climate_shape``: ``[history, channels, lat, lon]`` of the climate input, for ``optbench
    estimate`` from shapes alone (no NetCDF file, no texts are read; training refuses it)."""

    name: str = "climate_text"
    patch_size: int = 4
    text_mode: str | None = None
    eval_samples: int = 128
    shuffle_offset: int = 0
    text_only: bool = False
    climate_shape: list[int] | None = None

    def __post_init__(self) -> None:
        positive(**{"task.patch_size": self.patch_size, "task.eval_samples": self.eval_samples})
        if self.climate_shape is not None and (len(self.climate_shape) != 4 or min(self.climate_shape) < 1):
            raise ConfigError(f"task.climate_shape={self.climate_shape}: give [history, channels, lat, lon], each >= 1 "
                              "(e.g. task.climate_shape=[2,1,49,53])")
        non_negative(**{"task.shuffle_offset": self.shuffle_offset})
        if self.text_mode is not None:
            one_of("task.text_mode", self.text_mode, ("describe", "forecast"))
