"""Initialize a fused model's decoder from an earlier ``task=lm`` run (``fusion.base_checkpoint``).

The checkpoint is an optbench DCP checkpoint directory (``<run>/checkpoints/step-NNNNNNNN``, or the
``checkpoints`` directory itself: its newest complete checkpoint is taken). Only the decoder's
tensors (``embed``, ``layers``, ``norm``, ``head``; everything but ``fusion``) are read, through
``torch.distributed.checkpoint`` into the model's own (possibly FSDP2-sharded) parameters (for a
``model=hf`` base, transformers' names: everything outside ``model.fusion``), so a
base saved by any world size loads into any other. A base of another shape is refused before
anything is built, naming both shapes.
"""

from __future__ import annotations

import logging
import warnings
from pathlib import Path
from typing import Any

from torch import nn

from optbench.config import ModelConfig
from optbench.errors import ConfigError

log = logging.getLogger(__name__)

SHAPE_KEYS = ("dim", "layers", "heads", "ffn_dim", "vocab_size")
PREFIX = "app.model."


def _shape(model: dict[str, Any]) -> str:
    return " ".join(f"{key}={model.get(key)}" for key in SHAPE_KEYS)


def resolve_base_checkpoint(path: str | Path) -> Path:
    """The checkpoint directory ``path`` names (or the newest complete one under it)."""
    from optbench.checkpoint.store import complete_checkpoints

    p = Path(path).expanduser()
    if (p / "optbench.json").is_file():
        return p
    found = complete_checkpoints(p) if p.is_dir() else []
    if not found:
        raise ConfigError(
            f"fusion.base_checkpoint={path} is not an optbench checkpoint (no optbench.json in it or in a step_* "
            "directory under it); give <run dir>/checkpoints/step-NNNNNNNN of a task=lm run (checkpoint.every=N)"
        )
    return found[-1][1]


def check_base_checkpoint(path: str | Path, *, model: ModelConfig) -> Path:
    """Preflight: the checkpoint exists and its decoder has this run's shape."""
    from optbench.checkpoint.store import read_meta

    p = resolve_base_checkpoint(path)
    try:
        saved = read_meta(p)["model"]
    except (OSError, ValueError, KeyError) as exc:
        raise ConfigError(f"fusion.base_checkpoint={p}: optbench.json cannot be read ({exc}); give another checkpoint") from exc
    wanted = {key: getattr(model, key) for key in SHAPE_KEYS}
    if any(saved.get(key) != value for key, value in wanted.items()):
        raise ConfigError(
            f"fusion.base_checkpoint={p} holds a decoder of shape {_shape(saved)} but this run's model is "
            f"{_shape(wanted)}; use the base's model preset (or model.*=) or a checkpoint of this shape"
        )
    return p


def load_base(model: nn.Module, path: str | Path) -> dict[str, Any]:
    """Load the decoder's tensors of the checkpoint at ``path`` into ``model`` (materialized,
    possibly sharded); every rank calls it. Returns what was loaded (for summary.json)."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        set_model_state_dict,
    )

    from optbench.model.fusion import is_base_name

    p = resolve_base_checkpoint(path)
    stored = dcp.FileSystemReader(str(p)).read_metadata().state_dict_metadata
    state = {k: v for k, v in get_model_state_dict(model).items() if is_base_name(k)}
    for name, tensor in state.items():
        meta = stored.get(PREFIX + name)
        if meta is None:
            raise ConfigError(f"fusion.base_checkpoint={p} has no decoder tensor {name}; give a checkpoint of a "
                              "task=lm run")
        if tuple(meta.size) != tuple(tensor.shape):
            raise ConfigError(f"fusion.base_checkpoint={p}: {name} has shape {tuple(meta.size)} there but "
                              f"{tuple(tensor.shape)} in this run's model; use a checkpoint of this shape")
    with warnings.catch_warnings():  # one process without a process group is what is meant here
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load({"app": {"model": state}}, checkpoint_id=str(p), no_dist=not dist.is_initialized())
    set_model_state_dict(model, state, options=StateDictOptions(strict=False))
    numel = sum(t.numel() for t in state.values())
    log.info("Loaded the base decoder (%d tensors, %s values) from %s", len(state), f"{numel:,}", p)
    return {"path": str(p), "tensors": len(state), "numel": int(numel)}

