"""optbench's own decoder as the transformers architecture it is (``optbench export``, through the
``transformer`` kind's ``ModelSpec.export``): transformers' ``ArceeForCausalLM``, the architecture that
computes exactly what it computes: pre-norm RMSNorm blocks, rotary positions, a non-gated MLP
(``hidden_act=gelu``: the exact erf GELU), no biases, an untied head. optbench rotates channel pairs
(2i, 2i+1), transformers rotates (i, i + head_dim/2): the rows of each head's query and key
projections are reordered, which leaves every q.k product, hence the logits, as they were
(``tests/generate/test_export.py`` compares them)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


def rope_order(head_dim: int) -> torch.Tensor:
    """optbench's channel index of each of transformers' channels within a head: the pairs (2i, 2i+1)
    become (i, i + head_dim/2)."""
    return torch.cat([torch.arange(0, head_dim, 2), torch.arange(1, head_dim, 2)])


def as_arcee(model: nn.Module, cfg: Any) -> nn.Module:
    """optbench's decoder as an ``ArceeForCausalLM`` with the same weights (see the module docstring)."""
    from transformers import ArceeConfig, ArceeForCausalLM

    m = cfg.model
    config = ArceeConfig(vocab_size=m.vocab_size, hidden_size=m.dim, intermediate_size=m.ffn_dim,
                         num_hidden_layers=m.layers, num_attention_heads=m.heads, num_key_value_heads=m.heads,
                         head_dim=m.head_dim, hidden_act="gelu", max_position_embeddings=cfg.train.seq_len,
                         rms_norm_eps=m.norm_eps, rope_parameters={"rope_type": "default", "rope_theta": m.rope_theta},
                         tie_word_embeddings=False, attention_bias=False, mlp_bias=False,
                         bos_token_id=None, eos_token_id=None, pad_token_id=None)
    state = model.state_dict()
    order = torch.cat([h * m.head_dim + rope_order(m.head_dim) for h in range(m.heads)])
    mapped = {"model.embed_tokens.weight": state["embed.weight"], "model.norm.weight": state["norm.weight"],
              "lm_head.weight": state["head.weight"]}
    for i in range(m.layers):
        src, dst = f"layers.{i}.", f"model.layers.{i}."
        mapped.update({
            f"{dst}input_layernorm.weight": state[f"{src}attn_norm.weight"],
            f"{dst}self_attn.q_proj.weight": state[f"{src}attn.wq.weight"][order],
            f"{dst}self_attn.k_proj.weight": state[f"{src}attn.wk.weight"][order],
            f"{dst}self_attn.v_proj.weight": state[f"{src}attn.wv.weight"],
            f"{dst}self_attn.o_proj.weight": state[f"{src}attn.wo.weight"],
            f"{dst}post_attention_layernorm.weight": state[f"{src}mlp_norm.weight"],
            f"{dst}mlp.up_proj.weight": state[f"{src}mlp.w1.weight"],
            f"{dst}mlp.down_proj.weight": state[f"{src}mlp.w2.weight"],
        })
    arcee = ArceeForCausalLM(config)
    arcee.load_state_dict({k: v.detach().clone().contiguous() for k, v in mapped.items()}, strict=True)
    return arcee.eval()
