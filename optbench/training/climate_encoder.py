"""A fused model's climate encoder initialized from the trunk of a ``task=climate`` run
(``fusion.encoder_checkpoint``): the forecaster's patch embedding (``embed``), its first
``fusion.encoder_layers`` bidirectional blocks (``layers.0 ..``) and its final norm (``norm``) are
read into ``model.fusion.embed``, ``model.fusion.encoder`` and ``model.fusion.norm`` — the same
modules, built by the same code (ClimaX-style: a forecaster's trunk as the climate encoder).

The checkpoint is an optbench DCP checkpoint (``<run>/checkpoints/step-NNNNNNNN``, or a run
directory or ``checkpoints`` directory: the newest complete one), read through
``torch.distributed.checkpoint`` into the model's own (possibly FSDP2-sharded) tensors. Before the
model is built, ``check_encoder_checkpoint`` refuses a run of another task, width, patching or
history; on load every tensor's shape is compared (another grid or other variables: another
number of patch tokens or values per patch) and a mismatch is refused in one line naming both.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from torch import nn

from optbench.config import Config
from optbench.errors import ConfigError

log = logging.getLogger(__name__)

PREFIX = "app.model."
# every field of the model config that changes the encoder's numerics (head_dim: dim // heads)
WIDTH = ("dim", "heads", "ffn_dim", "head_dim", "rope_theta", "norm_eps")


def _encoder_field(model: Any, key: str) -> Any:
    """``key`` of a model config (a saved dict or the typed config)."""
    get = model.get if isinstance(model, dict) else lambda k: getattr(model, k, None)
    if key == "head_dim":
        dim, heads = get("dim"), get("heads")
        return dim // heads if isinstance(dim, int) and isinstance(heads, int) and heads else None
    value = get(key)
    return float(value) if key in ("rope_theta", "norm_eps") and value is not None else value


def resolve_encoder_checkpoint(path: str | Path) -> Path:
    """The checkpoint directory ``path`` names: itself, or the newest complete one in it or in its
    ``checkpoints``."""
    from optbench.checkpoint.store import META_FILE, named_checkpoint

    found = named_checkpoint(path)
    if found is not None:
        return found
    raise ConfigError(f"fusion.encoder_checkpoint={path} is not an optbench checkpoint (no {META_FILE} in it or in a "
                      "step-* directory under it); give a task=climate run directory trained with checkpoint.every=N")


def _saved_config(p: Path) -> dict[str, Any]:
    from optbench.checkpoint.store import read_meta

    try:
        return read_meta(p)["config"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"fusion.encoder_checkpoint={p}: its optbench.json has no readable config ({exc}); "
                          "give another checkpoint") from exc


def check_encoder_checkpoint(cfg: Config) -> Path:
    """Preflight: the checkpoint is a ``task=climate`` run with this run's width, patching and
    history, and at least ``fusion.encoder_layers`` blocks."""
    p = resolve_encoder_checkpoint(cfg.fusion.encoder_checkpoint)
    saved = _saved_config(p)
    task, model, data = saved.get("task", {}), saved.get("model", {}), saved.get("data", {})
    where = f"fusion.encoder_checkpoint={p}"
    if task.get("name") != "climate":
        raise ConfigError(f"{where} is a task={task.get('name')} run; the climate encoder is the trunk of a "
                          "task=climate run (the forecaster): give one of those")
    theirs = (task.get("patch_size"), data.get("history"))
    ours = (cfg.task.patch_size, getattr(cfg.data, "history", None))
    if theirs != ours:
        raise ConfigError(f"{where} patches the climate in {theirs[0]}x{theirs[0]} patches over {theirs[1]} input "
                          f"steps but this run uses task.patch_size={ours[0]} data.history={ours[1]}; set those to "
                          "the climate run's, or train a climate run with this run's")
    mismatch = [f"{k}={_encoder_field(model, k)} (here {_encoder_field(cfg.model, k)})" for k in WIDTH
                if _encoder_field(model, k) != _encoder_field(cfg.model, k)]
    if mismatch:
        raise ConfigError(f"{where} has a trunk of {', '.join(mismatch)}: the encoder is built with the decoder's "
                          "width, RoPE base and norm epsilon; train the climate run with this run's model.dim, "
                          "model.heads, model.ffn_dim, model.rope_theta and model.norm_eps")
    if int(model.get("layers", 0)) < cfg.fusion.encoder_layers:
        raise ConfigError(f"{where} has {model.get('layers')} blocks but fusion.encoder_layers="
                          f"{cfg.fusion.encoder_layers}; lower fusion.encoder_layers to at most {model.get('layers')}")
    return p


def checkpoint_names(state: dict[str, Any]) -> dict[str, str]:
    """model key -> the climate run's key, for every tensor of the encoder in ``state``
    (``fusion.embed.X`` -> ``embed.X``, ``fusion.encoder.I.X`` -> ``layers.I.X``,
    ``fusion.norm.X`` -> ``norm.X``)."""
    renames = {"fusion.embed.": "embed.", "fusion.encoder.": "layers.", "fusion.norm.": "norm."}
    return {key: renames[start] + key[len(start):] for key in state for start in renames if key.startswith(start)}


def _check_shapes(p: Path, names: dict[str, str], state: dict[str, Any]) -> None:
    from optbench.checkpoint.base import verified_metadata

    stored = verified_metadata(p, what=f"fusion.encoder_checkpoint={p}").state_dict_metadata
    for key, theirs in names.items():
        meta = stored.get(PREFIX + theirs)
        if meta is None:
            raise ConfigError(f"fusion.encoder_checkpoint={p} has no tensor {theirs}; give a checkpoint of a "
                              "task=climate run")
        if tuple(meta.size) != tuple(state[key].shape):
            what = ("another grid, other variables or levels (patch tokens x values per patch)"
                    if theirs.startswith("embed.") else "another shape")
            raise ConfigError(f"fusion.encoder_checkpoint={p}: {theirs} is {list(meta.size)} there but "
                              f"{list(state[key].shape)} here: {what}; use a task=climate run on this run's "
                              "data.paths, data.variables, data.levels and task.patch_size")


def load_encoder(model: nn.Module, path: str | Path) -> dict[str, Any]:
    """Read the climate run's trunk into ``model.fusion``'s encoder (materialized, possibly
    sharded); every rank calls it. Returns what was loaded (for summary.json)."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        set_model_state_dict,
    )

    from optbench.checkpoint.base import read_model_tensors

    p = resolve_encoder_checkpoint(path)
    state = get_model_state_dict(model)
    names = checkpoint_names(state)
    _check_shapes(p, names, state)
    to_read = {theirs: state[key] for key, theirs in names.items()}
    read_model_tensors(p, to_read, what=f"fusion.encoder_checkpoint={p}")
    set_model_state_dict(model, {key: to_read[theirs] for key, theirs in names.items()},
                         options=StateDictOptions(strict=False))
    numel = sum(t.numel() for t in to_read.values())
    log.info("Loaded the climate encoder (%d tensors, %s values) from %s", len(to_read), f"{numel:,}", p)
    return {"path": str(p), "tensors": len(to_read), "numel": int(numel)}
