"""Schemas of the tasks (the ``task`` group; ``optbench.tasks``)."""

from __future__ import annotations

from dataclasses import dataclass

from omegaconf import MISSING

from optbench.config.checks import non_negative, positive


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
    next-token loss on the text of a sample's target time, the climate history window encoded into
    ``patch_size`` x ``patch_size`` patch tokens (the climate task's patching) that the decoder
    reads through the fusion layers. Eval reports the loss with the true climate, with the climate
    of another time (each eval sample gets the climate of the one ``shuffle_offset`` samples further
    in the eval split, cyclically; 0 = half the split) and with the decoder alone."""

    name: str = "climate_text"
    patch_size: int = 4
    shuffle_offset: int = 0

    def __post_init__(self) -> None:
        positive(**{"task.patch_size": self.patch_size})
        non_negative(**{"task.shuffle_offset": self.shuffle_offset})
