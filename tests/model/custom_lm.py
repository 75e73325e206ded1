"""A user's own causal LM, for ``model=module`` (``+model.module._target_=tests.model.custom_lm.build``):
names optbench never saw (``tok``, ``stack``, ``final``, ``unembed``), its own ``init_weights``."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Mixer(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.out = nn.Linear(width, width)
        self.ff = nn.Sequential(nn.LayerNorm(width), nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, w = x.shape
        q, k, v = self.qkv(self.ln(x)).view(b, s, 3, self.heads, w // self.heads).permute(2, 0, 3, 1, 4)
        x = x + self.out(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, w))
        return x + self.ff(x)


class CustomLM(nn.Module):
    def __init__(self, vocab: int, width: int, depth: int, heads: int, max_seq_len: int | None = None) -> None:
        super().__init__()
        if max_seq_len is not None:  # the longest sequence it takes (a learned position table would have one)
            self.max_seq_len = max_seq_len
        self.tok = nn.Embedding(vocab, width)
        self.stack = nn.ModuleList(Mixer(width, heads) for _ in range(depth))
        self.final = nn.LayerNorm(width)
        self.unembed = nn.Linear(width, vocab, bias=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.tok(input_ids)
        for block in self.stack:
            h = block(h)
        return self.unembed(self.final(h))

    @torch.no_grad()
    def init_weights(self) -> None:
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)
                if getattr(module, "bias", None) is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.LayerNorm):
                nn.init.ones_(module.weight)
                nn.init.zeros_(module.bias)


def build(vocab: int = 96, width: int = 32, depth: int = 2, heads: int = 4, max_seq_len: int | None = None) -> CustomLM:
    return CustomLM(vocab, width, depth, heads, max_seq_len)
