"""A trained model from a run directory or a checkpoint: the typed config rebuilt from the
checkpoint's own record of it (``optbench.json``'s ``config``, the resolved config of the run), the
task and model built as training built them, materialized on the CPU (or ``device``) and the
checkpoint's model tensors read into it through ``torch.distributed.checkpoint`` (the optimizer's
state is left on disk)."""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf
from torch import nn

from optbench.config import SCHEMAS, Config
from optbench.errors import ConfigError


@dataclass
class Loaded:
    cfg: Config
    task: Any
    model: nn.Module
    checkpoint: Path
    step: int


def find_checkpoint(path: str | Path) -> Path:
    """The checkpoint ``path`` names: a ``step-NNNNNNNN`` directory, or the newest complete one in a
    ``checkpoints`` directory or in a run directory's ``checkpoints``."""
    from optbench.checkpoint.store import META_FILE, named_checkpoint

    if not Path(path).expanduser().exists():
        raise ConfigError(f"{path} does not exist; give a run directory of optbench train or one of its checkpoints")
    found = named_checkpoint(path)
    if found is not None:
        return found
    raise ConfigError(f"{path} holds no checkpoint to read the model from (no {META_FILE} in it, no complete step-* "
                      "directory in it or in its checkpoints/); train with checkpoint.every=N (the last step is "
                      "saved too) and give that run directory")


def _schema_for(name: str, node: dict[str, Any]) -> type:
    """The schema class of group ``name`` whose fields are exactly ``node``'s keys (a group's kinds
    differ in their fields: model=hf has ``hf``, data=netcdf ``paths``, ...)."""
    declared = typing.get_type_hints(Config)[name]
    kinds = [declared, *[c for c in SCHEMAS.values() if isinstance(c, type) and issubclass(c, declared)]]
    keys = set(node)
    for kind in kinds:
        if {f.name for f in dataclasses.fields(kind)} == keys:
            return kind
    raise ConfigError(f"the checkpoint's config has a {name} node with fields {sorted(keys)} that no schema of "
                      "this optbench has (written by another version?); retrain, or generate with that version")


def config_from_dict(saved: dict[str, Any]) -> Config:
    """The typed ``Config`` of a run from its resolved config (summary.json's or a checkpoint's),
    under today's names (``optbench.config.renames``)."""
    from optbench.config.renames import upgrade_config

    saved = upgrade_config(saved)
    groups = {}
    for f in dataclasses.fields(Config):
        if f.name in saved:
            kind = _schema_for(f.name, saved[f.name])
            groups[f.name] = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(kind), saved[f.name]))
    return Config(**groups)


def load_run(path: str | Path, *, device: str = "cpu") -> Loaded:
    """The ``task=climate_text`` model of the checkpoint ``path`` names (``find_checkpoint``)."""
    return load_model(path, device=device, task="climate_text",
                      why="optbench generate writes the text of a task=climate_text model (a fused model that reads "
                          "climate)")


def load_model(path: str | Path, *, device: str = "cpu", task: str | None = None, why: str = "",
               data: dict[str, Any] | None = None) -> Loaded:
    """The model of the checkpoint ``path`` names (``find_checkpoint``), as training built it, its
    tensors read from the checkpoint; ``task``: the only task accepted (``why`` says why); ``data``:
    fields of the run's data config to replace (a run whose files were copied elsewhere: their
    ``paths`` and ``text`` there)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    from optbench.checkpoint.base import read_model_tensors, verified_metadata
    from optbench.checkpoint.store import damage, read_meta
    from optbench.tasks import build_task
    from optbench.training.build import build_model, materialize

    checkpoint = find_checkpoint(path)
    problem = damage(checkpoint)  # optbench.json unreadable or of another shape, a file missing or cut short
    if problem is not None:
        raise ConfigError(f"{checkpoint} cannot be read: {problem}; give another checkpoint of the run "
                          f"({checkpoint.parent}/step-*), or train it again")
    meta = read_meta(checkpoint)
    cfg = config_from_dict(meta["config"])
    if task is not None and cfg.task.name != task:
        raise ConfigError(f"{checkpoint} is a task={cfg.task.name} run; {why}")
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, device=device),
                              parallel=dataclasses.replace(cfg.parallel, name="single", nproc_per_node=1),
                              data=dataclasses.replace(cfg.data, **(data or {})))
    task = build_task(cfg)
    model = build_model(cfg, task)
    materialize(model, device=torch.device(device), seed=cfg.train.seed)
    state = get_model_state_dict(model)
    verified_metadata(checkpoint, what=str(checkpoint))  # its files as saved, its metadata data only
    read_model_tensors(checkpoint, state, what=str(checkpoint))
    set_model_state_dict(model, state)
    model.eval()
    return Loaded(cfg=cfg, task=task, model=model, checkpoint=checkpoint, step=int(meta["step"]))
