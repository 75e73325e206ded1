"""One module per task; ``build_task`` picks it from ``cfg.task.name``."""

from __future__ import annotations

from optbench.config import Config
from optbench.errors import ConfigError
from optbench.tasks.base import Batch, Losses, Task


def build_task(cfg: Config) -> Task:
    if cfg.task.name == "lm":
        from optbench.tasks.lm import LMTask

        return LMTask(cfg)
    if cfg.task.name == "climate":
        from optbench.tasks.climate import ClimateTask

        return ClimateTask(cfg)
    if cfg.task.name == "climate_text":
        from optbench.tasks.climate_text import ClimateTextTask

        return ClimateTextTask(cfg)
    if cfg.task.name == "energy_flow":
        from optbench.tasks.energy_flow import EnergyFlowTask

        return EnergyFlowTask(cfg)
    raise ConfigError(f"task={cfg.task.name} is unknown; use task=lm, task=climate, task=climate_text or task=energy_flow")


__all__ = ["Batch", "Losses", "Task", "build_task"]
