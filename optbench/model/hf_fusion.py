"""The plan's climate fusion over a Hugging Face decoder (``task=climate_text model=hf``).

The climate encoder and fusion layers are ``optbench.model.fusion.Fusion``, registered on the
transformers model as ``model.fusion`` — after every module of the base, so the base's parameter
names (transformers' own: its safetensors load unchanged) and, for a seed, its initial weights are
those of the plain model. The decoder's own code runs the layers, so the fusion goes in through it:

- ``cross_attention`` / ``gated``: a forward pre-hook on each decoder layer that has a fusion block
  (0, every, 2*every, ... of the layers ``optbench.model.decoder`` finds structurally) runs that
  block on the layer's input hidden states, ``h = fusion.layers[i](h, c)``, before the layer: the
  same place as in optbench's own ``Transformer``. The hook looks the block up when it runs, so
  activation checkpointing, compile and FSDP2 wrap it like any block; and it sits on the decoder
  layer itself, so whatever wraps the layer runs it (a checkpointed layer recomputes its fusion
  block in the backward, with the same climate).
- ``add``: the mean-pooled, projected climate is added to the token embeddings, which the model
  then takes as ``inputs_embeds``.
- ``prefix``: the projected climate tokens go before the token embeddings in ``inputs_embeds``
  (positions 0 .. tokens-1, the text after them); the logits of the climate positions are dropped.

``c`` (the encoded climate, ``(B, tokens, dim)``) is computed once per forward from ``context`` and
kept on ``model.fusion.context`` for the hooks until the next forward (the backward of a checkpointed
layer reads it again). ``model(input_ids)`` without a context runs the base alone (the hooks do
nothing): the eval's "base" loss, and for ``gated`` at initialization exactly the same logits as
with a climate (tanh(0) = 0).

The fusion's parameters are initialized as optbench's own (``init_module_weights``) after
transformers' initialization of the base, then the encoder's RoPE tables.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn

from optbench.model.decoder import blocks_of
from optbench.model.transformer import init_module_weights


class FusionAdapter:
    """Mixed in front of an HF model's (already ``LogitsAdapter``-ed) class: ``forward(input_ids,
    context=None)`` and an ``init_weights`` that initializes the fusion too."""

    def forward(self, input_ids: torch.Tensor, context: torch.Tensor | None = None, **kwargs: Any) -> torch.Tensor:
        fusion = self.fusion  # type: ignore[attr-defined]
        if context is None:
            fusion.context = None
            return super().forward(input_ids, **kwargs)  # type: ignore[misc]
        c = fusion.encode(context, fusion.rope_cos, fusion.rope_sin)
        fusion.context = c
        if fusion.kind in ("add", "prefix"):
            embeds = self.get_input_embeddings()(input_ids)  # type: ignore[attr-defined]
            embeds = fusion.prefix_input(fusion.add_input(embeds, c), c)
            return fusion.text_part(super().forward(None, inputs_embeds=embeds, **kwargs))  # type: ignore[misc]
        return super().forward(input_ids, **kwargs)  # type: ignore[misc]

    @torch.no_grad()
    def init_weights(self) -> None:
        super().init_weights()  # type: ignore[misc]
        fusion = self.fusion  # type: ignore[attr-defined]
        init_module_weights(fusion, std=fusion.init_std, layers=fusion.decoder_layers)
        fusion.init_rope()


@functools.cache
def fused_class(cls: type) -> type:
    """``cls`` with ``FusionAdapter`` in front, under the same name."""
    return type(cls.__name__, (FusionAdapter, cls), {"__module__": cls.__module__})


def _before_layer(fusion: nn.Module, name: str):
    """The pre-hook of decoder layer ``name``: its fusion block on the layer's hidden states."""

    def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        c = fusion.context
        if c is None:
            return None
        block = fusion.layers[name]
        if args:
            return (block(args[0], c), *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": block(kwargs["hidden_states"], c)}

    return hook


def attach_fusion(model: nn.Module, fusion: nn.Module, *, init_std: float) -> nn.Module:
    """Register ``fusion`` (built with ``rope=True``) on the HF ``model`` (from ``build_hf_model``,
    on the meta device) and hook its blocks in before their decoder layers; returns the model."""
    blocks = dict(blocks_of(model))
    missing = [name for name in fusion.layers if name not in blocks]
    assert not missing, f"fusion blocks {missing} have no decoder layer among {list(blocks)}"
    model.fusion = fusion
    fusion.init_std, fusion.decoder_layers = init_std, len(blocks)
    for name in fusion.layers:
        blocks[name].register_forward_pre_hook(_before_layer(fusion, name), with_kwargs=True)
    model.__class__ = fused_class(type(model))
    return model
