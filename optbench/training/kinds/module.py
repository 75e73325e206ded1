"""Kind ``module``: the user's own causal LM (``model=module``): ``model.module`` is a Hydra node whose
``_target_`` returns an ``nn.Module`` with ``forward(input_ids) -> logits``; its blocks, embedding,
final norm and head are found structurally (``optbench.model.decoder.find_parts``)."""

from __future__ import annotations

import functools
from typing import Any

from torch import nn

from optbench.config import ModuleModelConfig
from optbench.errors import ConfigError
from optbench.model.decoder import find_parts
from optbench.model.hf import check_module_positions
from optbench.model.meta import on_meta
from optbench.training.kinds.spec import ModelSpec


def build(cfg: Any, task: Any) -> nn.Module:
    """The user's factory called on the meta device (Hydra's ``instantiate``), its parts found
    structurally, its shape checked against ``model.*``."""
    from hydra.utils import instantiate

    model_cfg = cfg.model
    target = model_cfg.module["_target_"]
    try:
        with on_meta():
            model = instantiate(model_cfg.module)
    except Exception as exc:  # the user's code: whatever it raised, named with its factory
        raise ConfigError(f"model.module._target_={target} failed: {type(exc).__name__}: {exc}") from exc
    if not isinstance(model, nn.Module):
        raise ConfigError(f"model.module._target_={target} returned a {type(model).__name__}, not an nn.Module")
    parts = find_parts(model, layers_path=model_cfg.layers_path, attention_width=model_cfg.dim)
    embed = model.get_submodule(parts.embed)
    found = {"vocab_size": embed.num_embeddings, "dim": embed.embedding_dim,
             "layers": len(list(model.get_submodule(parts.layers).children()))}
    for key, value in found.items():
        if getattr(model_cfg, key) != value:
            raise ConfigError(f"model.{key}={getattr(model_cfg, key)} but {target} built {value}; set model.{key}={value}")
    if not callable(getattr(model, "init_weights", None)):
        if any(True for _ in model.buffers()):
            raise ConfigError(f"{target}'s module has buffers but no init_weights(): after to_empty nothing would "
                              "recompute them; give it an init_weights() method")
        model.init_weights = functools.partial(_reset_parameters, model)
    model.decoder_parts = parts
    check_module_positions(model, target=target, seq_len=task.tokens_per_sample())
    return model


def _reset_parameters(model: nn.Module) -> None:
    for module in model.modules():
        reset = getattr(module, "reset_parameters", None)
        if callable(reset):
            reset()


def preflight(cfg: Any) -> list[str]:
    """A token LM of its own (task=lm only: a fusion needs hf's hooks) running its own attention."""
    reasons = []
    if cfg.task.name != "lm":
        reasons.append(f"model={cfg.model.name} is a token language model with its own embedding and head; "
                       f"task={cfg.task.name} brings others: use task=lm")
    if cfg.attention.name != "sdpa":
        reasons.append(f"attention={cfg.attention.name}: model=module runs its own attention, which optbench "
                       "cannot switch; leave attention=sdpa (the default; applied.attention says unknown)")
    return reasons


SPEC = ModelSpec(kind="module", config_type=ModuleModelConfig, build=build, preflight=preflight)
