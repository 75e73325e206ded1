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
    """The checkpoint directory ``path`` names, checked as a resume checks its checkpoints
    (``store.damage``); a directory of them gives its newest that looks whole, skipping (with a
    warning) the damaged ones. ConfigError when there is none."""
    from optbench.checkpoint.store import complete_checkpoints, damage

    p = Path(path).expanduser()
    if (p / "optbench.json").is_file():
        why = damage(p)
        if why is not None:
            raise ConfigError(f"fusion.base_checkpoint={p} cannot be loaded: {why}; give another checkpoint "
                              "(or its checkpoints directory, whose newest whole one is taken)")
        return p
    found = complete_checkpoints(p) if p.is_dir() else []
    if not found:
        raise ConfigError(
            f"fusion.base_checkpoint={path} is not an optbench checkpoint (no optbench.json in it or in a step_* "
            "directory under it); give <run dir>/checkpoints/step-NNNNNNNN of a task=lm run (checkpoint.every=N)"
        )
    skipped = []
    for _, candidate in reversed(found):
        why = damage(candidate)
        if why is None:
            return candidate
        log.warning("fusion.base_checkpoint: skipping damaged checkpoint %s: %s", candidate, why)
        skipped.append(f"{candidate.name}: {why}")
    raise ConfigError(f"fusion.base_checkpoint={p}: no checkpoint there can be loaded ({'; '.join(skipped)}); "
                      "give another checkpoint")


def check_base_checkpoint(path: str | Path, *, model: ModelConfig) -> Path:
    """Preflight: the checkpoint exists, looks whole, and its decoder has this run's shape."""
    from optbench.checkpoint.store import read_meta

    p = resolve_base_checkpoint(path)
    saved = read_meta(p)["model"]  # a dict: resolve_base_checkpoint checked its shape
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
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        set_model_state_dict,
    )

    from optbench.model.fusion import is_base_name

    p = resolve_base_checkpoint(path)
    where = f"fusion.base_checkpoint={p}"
    stored = verified_metadata(p, what=where).state_dict_metadata
    state = {k: v for k, v in get_model_state_dict(model).items() if is_base_name(k)}
    _check_names_and_shapes(p, state=state, stored=stored)
    read_model_tensors(p, state, what=where)
    set_model_state_dict(model, state, options=StateDictOptions(strict=False))
    numel = sum(t.numel() for t in state.values())
    log.info("Loaded the base decoder (%d tensors, %s values) from %s", len(state), f"{numel:,}", p)
    return {"path": str(p), "tensors": len(state), "numel": int(numel)}


def verified_metadata(p: Path, *, what: str) -> Any:
    """DCP's metadata of the checkpoint at ``p`` once its files match the hashes recorded at save,
    read with only DCP's own classes (``safe``): how every model read from a checkpoint starts
    (``what`` names it in the one-line error). Every rank calls it and gets the same answer."""
    from optbench.checkpoint import digests, safe
    from optbench.checkpoint.store import read_meta

    changed = digests.verify(p, read_meta(p).get("files"))
    if changed is not None:
        raise ConfigError(f"{what} cannot be loaded: {changed}; give another checkpoint")
    return safe.read_metadata(p)


def read_model_tensors(p: Path, tensors: dict[str, Any], *, what: str) -> None:
    """Read the checkpoint's model tensors named by ``tensors``' keys (as the model stores them)
    into ``tensors``, in place (possibly sharded), through ``safe``'s reader and planner; every rank
    calls it. A failure on any rank is one ConfigError naming ``what``."""
    import torch.distributed.checkpoint as dcp

    from optbench import distributed
    from optbench.checkpoint import safe
    from optbench.checkpoint.store import checkpoint_exception, first_line

    try:
        with warnings.catch_warnings():  # one process without a process group is what is meant here
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load({"app": {"model": tensors}}, storage_reader=safe.reader(p), planner=safe.planner(),
                     no_dist=not distributed.is_distributed())
    except (Exception, checkpoint_exception()) as exc:  # DCP gathers every rank's failure: all see it
        raise ConfigError(f"{what} does not load ({first_line(exc)}); give another checkpoint") from None


def _check_names_and_shapes(p: Path, *, state: dict[str, Any], stored: dict[str, Any]) -> None:
    for name, tensor in state.items():
        meta = stored.get(PREFIX + name)
        if meta is None:
            raise ConfigError(f"fusion.base_checkpoint={p} has no decoder tensor {name}; give a checkpoint of a "
                              "task=lm run")
        if tuple(getattr(meta, "size", ())) != tuple(tensor.shape):
            raise ConfigError(f"fusion.base_checkpoint={p}: {name} has shape {tuple(getattr(meta, 'size', ()))} "
                              f"there but {tuple(tensor.shape)} in this run's model; use a checkpoint of this shape")
