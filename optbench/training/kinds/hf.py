"""Kind ``hf``: a Hugging Face causal LM (``model=hf``, the ``hf_*`` presets; ``optbench.model.hf``),
its safetensors (``model.hf.weights``, ``optbench.model.weights``), and a climate fusion hooked into
it (``optbench.model.hf_fusion``)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from optbench.config import HFModelConfig
from optbench.errors import ConfigError
from optbench.logs import quiet_imports
from optbench.model.decoder import decoder_parts
from optbench.model.hf import LogitsAdapter, build_hf_model, describe_hf_attention, describe_hf_model
from optbench.model.meta import on_meta
from optbench.model.weights import check_weights, load_weights
from optbench.training.attention import build_attention
from optbench.training.kinds.decode import transformers_step
from optbench.training.kinds.spec import ModelSpec


def build(cfg: Any, task: Any) -> nn.Module:
    """The transformers model, with the task's fusion (``optbench.model.hf_fusion``) when there is one;
    the task's token embedding and head are unused (the model has its own)."""
    attention = build_attention(cfg.attention.name)
    prefix = task.context_tokens() if cfg.fusion.name == "prefix" else 0  # climate tokens before the text
    with quiet_imports():  # transformers' first import of its modeling code (and of torchao)
        model = build_hf_model(cfg.model, attention=cfg.attention.name, seq_len=task.tokens_per_sample() + prefix)
    if cfg.fusion.name != "none":
        from optbench.model.hf_fusion import attach_fusion

        with on_meta():
            fusion = task.build_fusion(attention=attention, rope=True)
        attach_fusion(model, fusion, init_std=cfg.model.init_std)
    return model


def _weights_config(cfg: Any) -> str:
    return cfg.model.hf.config or cfg.model.name


def load(model: nn.Module, cfg: Any) -> dict[str, Any]:
    """``model.hf.weights``: the safetensors read into the materialized model (each rank its own
    shards), as ``{"weights": what was loaded}``; ``{}`` without any."""
    if cfg.model.hf.weights is None:
        return {}
    return {"weights": load_weights(model, cfg.model.hf.weights, config=_weights_config(cfg))}


def describe(model: nn.Module, cfg: Any, task: Any) -> dict[str, Any]:
    """``summary.json`` ``model.hf``: what transformers built, read back from the model."""
    return {"hf": describe_hf_model(model, model_cfg=cfg.model)}


def preflight(cfg: Any) -> list[str]:
    """Built on the meta device as the run would build it (its attention kernel through
    ``attn_implementation``, its position table against the sequence length), its blocks holding
    the nn.Linear layers float8 converts, its safetensors matching it tensor for tensor."""
    reasons = []
    if cfg.task.name not in ("lm", "climate_text"):
        reasons.append(f"model={cfg.model.name} is a token language model with its own embedding and head; "
                       f"task={cfg.task.name} brings others: use task=lm or task=climate_text")
    try:
        with quiet_imports():
            model = build_hf_model(cfg.model, attention=cfg.attention.name, seq_len=cfg.train.seq_len)
    except ConfigError as exc:
        return [*reasons, str(exc)]
    blocks = decoder_parts(model).layers
    inside = [m for n, m in model.named_modules() if n.startswith(blocks + ".")]
    if cfg.precision.float8_recipe is not None and not any(isinstance(m, torch.nn.Linear) for m in inside):
        kinds = sorted({type(m).__name__ for m in inside if getattr(m, "weight", None) is not None
                        and m.weight.ndim == 2})
        reasons.append(f"precision={cfg.precision.name}: torchao converts nn.Linear layers to float8, and "
                       f"{type(model).__name__}'s blocks ({blocks}) hold none (their matmuls are {', '.join(kinds)}); "
                       "use precision=bf16 with this architecture")
    if cfg.model.hf.weights is not None:
        try:
            check_weights(model, cfg.model.hf.weights, config=_weights_config(cfg))
        except ConfigError as exc:
            reasons.append(str(exc))
    return reasons


def unadapted(model: nn.Module, cfg: Any = None) -> nn.Module:
    """The transformers class under optbench's ``LogitsAdapter`` (``optbench.model.hf``)."""
    model.__class__ = next(c for c in type(model).__mro__[1:] if not issubclass(c, LogitsAdapter))
    return model


SPEC = ModelSpec(kind="hf", config_type=HFModelConfig, build=build, load_weights=load, describe=describe,
                 preflight=preflight, applied_attention=describe_hf_attention, export=unadapted,
                 decode_step=transformers_step)
