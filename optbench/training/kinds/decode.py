"""Incremental decoding with a key/value cache, per model kind (``ModelSpec.decode_step``, which
``optbench generate`` calls): each new token runs through the model once.

A kind's ``decode_step(model, context)`` returns ``step(tokens) -> logits``: called first with the prompt
``(B, P)`` and then with each new token ``(B, 1)``, it returns the logits of the positions it was
given, the same (up to float rounding) as the uncached ``model(all_tokens, context=context)[:, -n:]``
(tested). The climate is encoded once, at the first call.

- ``own_step``, kind ``transformer`` (with or without ``model.fusion``): its modules run here, each
  decoder layer's keys and values (after RoPE at their absolute positions) kept per layer; the
  prompt goes through the run's attention kernel causally, a later single token attends to every
  cached position. The fusion's per-position parts (``add``, the cross-attention blocks, which read
  the encoded climate, never other text positions) run on the new positions only; ``prefix``'s
  climate tokens enter with the prompt and stay in the cache.
- ``transformers_step``, kind ``hf``: its own ``DynamicCache`` through its own forward (the
  fusion's hooks run on the new positions' hidden states, as in the uncached forward).
- ``recompute_step`` (every other kind, ``ModelSpec``'s default): the whole sequence again for every
  token (the same logits, slower).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

Step = Callable[[torch.Tensor], torch.Tensor]


def recompute_step(model: nn.Module, context: torch.Tensor | None) -> Step:
    seen: list[torch.Tensor] = []

    def step(tokens: torch.Tensor) -> torch.Tensor:
        seen.append(tokens)
        full = torch.cat(seen, dim=1)
        out = model(full) if context is None else model(full, context=context)
        return out[:, -tokens.shape[1]:]

    return step


def _attend(block: nn.Module, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
            cache: dict[str, torch.Tensor], first: bool) -> torch.Tensor:
    """``block``'s self-attention of the new positions ``x`` over the cache and themselves."""
    from optbench.model.transformer import apply_rope

    attn = block.attn
    batch, seq, _ = x.shape
    shape = (batch, seq, attn.heads, attn.head_dim)
    q = apply_rope(attn.wq(x).view(shape), cos, sin).transpose(1, 2)
    k = apply_rope(attn.wk(x).view(shape), cos, sin).transpose(1, 2)
    v = attn.wv(x).view(shape).transpose(1, 2)
    if "k" in cache:
        k, v = torch.cat([cache["k"], k], dim=2), torch.cat([cache["v"], v], dim=2)
    cache["k"], cache["v"] = k, v
    # the prompt: causal among itself; a later token: every cached position is before it
    out = attn.attention(q, k, v, first and attn.causal)
    return attn.wo(out.transpose(1, 2).reshape(batch, seq, -1))


def own_step(model: nn.Module, context: torch.Tensor | None) -> Step:
    fusion = model.fusion if context is not None else None
    caches: dict[str, dict[str, torch.Tensor]] = {name: {} for name in model.layers}
    state: dict[str, object] = {"pos": 0, "c": None}

    def step(tokens: torch.Tensor) -> torch.Tensor:
        first = state["pos"] == 0
        h = model.embed(tokens)
        if fusion is not None:
            if first:
                state["c"] = fusion.encode(context, model.rope_cos, model.rope_sin)
            c = state["c"]
            h = fusion.add_input(h, c)
            if first:
                h = fusion.prefix_input(h, c)
        pos, seq = int(state["pos"]), h.shape[1]
        if pos + seq > model.rope_len:
            raise ValueError(f"sequence of {pos + seq} positions exceeds the model's {model.rope_len}")
        cos, sin = model.rope_cos[pos: pos + seq], model.rope_sin[pos: pos + seq]
        for name, block in model.layers.items():
            if fusion is not None and name in fusion.layers:
                h = fusion.layers[name](h, state["c"])
            h = h + _attend(block, block.attn_norm(h), cos, sin, caches[name], first)
            h = h + block.mlp(block.mlp_norm(h))
        state["pos"] = pos + seq
        if fusion is not None and first:
            h = fusion.text_part(h)
        return model.head(model.norm(h))

    return step


def transformers_step(model: nn.Module, context: torch.Tensor | None) -> Step:
    from transformers import DynamicCache

    from optbench.model.hf import LogitsAdapter
    from optbench.model.hf_fusion import FusionAdapter

    # the transformers class itself (under optbench's adapters, which return logits without a cache)
    plain = next(c for c in type(model).__mro__ if not issubclass(c, (LogitsAdapter, FusionAdapter)))
    fusion = getattr(model, "fusion", None)
    cache = DynamicCache()
    state: dict[str, bool] = {"first": True}

    def step(tokens: torch.Tensor) -> torch.Tensor:
        first = state["first"]
        state["first"] = False
        if fusion is not None:
            if first:
                fusion.context = None if context is None else fusion.encode(context, fusion.rope_cos,
                                                                             fusion.rope_sin)
            c = fusion.context
            if c is not None and fusion.kind in ("add", "prefix"):
                embeds = fusion.add_input(model.get_input_embeddings()(tokens), c)
                if first:
                    embeds = fusion.prefix_input(embeds, c)
                out = plain.forward(model, inputs_embeds=embeds, cache=cache, use_cache=True,
                                    return_dict=True).logits
                return fusion.text_part(out) if first else out
        return plain.forward(model, input_ids=tokens, cache=cache, use_cache=True, return_dict=True).logits

    return step
