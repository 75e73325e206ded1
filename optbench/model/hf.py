"""Hugging Face causal LMs as optbench models (``model=hf``, ``model=hf_*`` presets).

Interface (what the rest of optbench, and item 6's fusion, rely on)::

    model = build_hf_model(cfg.model, attention="sdpa", seq_len=256)   # on the meta device
    model(input_ids) -> logits              # (batch, seq, vocab); no KV cache, no loss inside
    model.decoder_parts                     # optbench.model.decoder.DecoderParts: embed/layers/norm/head paths
    model.config                            # the transformers config it was built from
    model.to_empty(device=...); torch.manual_seed(seed); model.init_weights()   # materialize
    load_weights(model, directory)          # optbench.model.weights: safetensors, each rank its shards

The model *is* the ``transformers`` model (``AutoModelForCausalLM.from_config``), built on the
meta device in fp32 (the precision group decides what runs in lower precision), with its class
swapped for a subclass of the same name that changes two methods (FSDP2 swaps classes the same way):
``forward(input_ids)`` returns the logits, and ``init_weights()`` runs transformers' own
initialization again after ``to_empty`` (it skips modules it already initialized). Parameter names
are transformers' own, so ``state_dict()`` keys are the safetensors keys and DCP checkpoints of
single, DDP and FSDP2 runs are interchangeable.

The attention kernel is chosen through the model's own switch, ``attn_implementation``:
``attention=sdpa`` -> ``"sdpa"``, ``math`` -> ``"eager"`` (explicit softmax), ``flex`` ->
``"flex_attention"``. An architecture that cannot use the kernel is refused (transformers raises; the
kernel it ends up with is read back and must be the one asked for), never silently replaced.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import torch
from torch import nn

from optbench.config.hf import HFModelConfig, load_hf_config
from optbench.errors import ConfigError
from optbench.model.decoder import find_parts
from optbench.model.meta import on_meta

log = logging.getLogger(__name__)

# attention.name -> transformers' attn_implementation
ATTN_IMPLEMENTATION = {"sdpa": "sdpa", "math": "eager", "flex": "flex_attention"}
KERNEL_OF = {v: k for k, v in ATTN_IMPLEMENTATION.items()}


class LogitsAdapter:
    """Mixed in front of a transformers causal LM class (see the module docstring)."""

    def forward(self, input_ids: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        out = super().forward(input_ids=input_ids, use_cache=False, return_dict=True, **kwargs)  # type: ignore[misc]
        return out.logits

    @torch.no_grad()
    def init_weights(self) -> None:
        """transformers' own initialization of every parameter and buffer (non-persistent ones
        such as RoPE's inverse frequencies included), then its weight tying. The markers it leaves
        on initialized modules are cleared first, so it runs in full after ``to_empty``."""
        for obj in [*self.modules(), *self.parameters(), *self.buffers()]:  # type: ignore[attr-defined]
            if getattr(obj, "_is_hf_initialized", False):
                del obj._is_hf_initialized
        super().init_weights()  # type: ignore[misc]


@functools.cache
def adapted_class(cls: type) -> type:
    """``cls`` with ``LogitsAdapter`` in front, under the same name (the memory trace and the logs
    name modules by their class)."""
    return type(cls.__name__, (LogitsAdapter, cls), {"__module__": cls.__module__})


def build_hf_model(model_cfg: HFModelConfig, *, attention: str, seq_len: int) -> nn.Module:
    """The causal LM ``model_cfg`` describes, on the meta device, with ``attention``'s kernel."""
    from transformers import AutoModelForCausalLM

    config = load_hf_config(model_cfg.hf)
    check_positions(config, seq_len=seq_len)
    impl = ATTN_IMPLEMENTATION[attention]
    try:
        with on_meta():
            model = AutoModelForCausalLM.from_config(config, attn_implementation=impl, dtype=torch.float32)
    except (ValueError, ImportError) as exc:
        fix = "attention=math (transformers' eager attention)" if impl != "eager" else "another architecture"
        raise ConfigError(f"attention={attention}: {config.model_type} cannot run attn_implementation={impl} "
                          f"({str(exc).splitlines()[0].split('. ')[0]}); use {fix}") from exc
    got = model.config._attn_implementation
    if got != impl:
        raise ConfigError(f"attention={attention}: transformers built {type(model).__name__} with "
                          f"attn_implementation={got} instead of {impl}; use attention={KERNEL_OF.get(got, 'sdpa')}")
    model.__class__ = adapted_class(type(model))
    text = config.get_text_config()
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    model.decoder_parts = find_parts(
        model, layers_path=model_cfg.hf.layers_path, attention_width=text.num_attention_heads * head_dim,
        embed=model.get_input_embeddings(), head=model.get_output_embeddings())
    return model


def check_positions(config: Any, *, seq_len: int) -> None:
    """Refuse sequences longer than the model's position table (learned positions would index past
    it; rotary ones would run outside what the model was made for)."""
    limit = getattr(config.get_text_config(), "max_position_embeddings", None)
    if limit is not None and seq_len > limit:
        raise ConfigError(f"train.seq_len={seq_len} exceeds the model's max_position_embeddings={limit}; lower "
                          f"train.seq_len, or raise model.hf.config_overrides.max_position_embeddings")


def check_module_positions(model: nn.Module, *, target: str, seq_len: int) -> None:
    """Refuse sequences longer than a ``model=module`` model says it takes: its ``max_seq_len``, or
    its config's ``max_position_embeddings``, where it has one."""
    for name, limit in (("max_seq_len", getattr(model, "max_seq_len", None)),
                        ("max_position_embeddings", getattr(getattr(model, "config", None), "max_position_embeddings",
                                                            None))):
        if isinstance(limit, int) and seq_len > limit:
            raise ConfigError(f"train.seq_len={seq_len} exceeds the model's {name}={limit} ({target}); lower "
                              "train.seq_len")


def describe_hf_model(model: nn.Module, *, model_cfg: HFModelConfig) -> dict[str, Any]:
    """summary.json ``model.hf``: what was built, read back from the model."""
    parts = model.decoder_parts
    embed = model.get_input_embeddings()
    head = model.get_output_embeddings()
    return {
        "class": type(model).__name__, "model_type": model.config.model_type,
        "config": model_cfg.hf.config, "weights": model_cfg.hf.weights,
        "layers_path": parts.layers, "blocks": len(model.get_submodule(parts.layers)), "embed": parts.embed,
        "norm": parts.norm, "head": parts.head,
        "tied_head": head is not None and head.weight is embed.weight,
        "attn_implementation": model.config._attn_implementation,
        "num_parameters": model.num_parameters(),
    }


def describe_hf_attention(model: nn.Module) -> str:
    """``applied.attention`` of an HF model: the kernel its config really runs."""
    return KERNEL_OF.get(model.config._attn_implementation, model.config._attn_implementation)
