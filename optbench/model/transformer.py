"""The transformer: a pre-norm decoder trunk with RoPE, a pluggable attention kernel (optbench.training.attention) and a two-matrix GELU MLP.

The task supplies the input embedding and the output head (tokens for ``lm``, grid patches for
``climate``); the trunk is shared. No optimization code lives here: activation checkpointing,
compile and data-parallel wrapping are applied from the outside by ``optbench.training.parallelize``, per
block of ``model.layers``; the attention kernel is a function the caller may pass in.

Build on the meta device, parallelize, then ``to_empty(device=...)`` and ``init_weights()``:

    with torch.device("meta"):
        model = Transformer(cfg.model, embed=..., head=..., causal=True, max_seq_len=256)
    model.to_empty(device="cpu")
    model.init_weights()
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from optbench.config import ModelConfig
from optbench.model.decoder import DecoderParts

# the decoder's modules: what fusion.freeze_base freezes and a base checkpoint initializes
BASE_MODULES = ("embed", "layers", "norm", "head")


@torch.no_grad()
def init_module_weights(root: nn.Module, *, std: float, layers: int) -> None:
    """optbench's initialization of every module under ``root`` (in place; the global torch RNG):
    Linear weights ~ N(0, std), residual output projections (``attn.wo``, ``mlp.w2``) scaled by
    1/sqrt(2 * layers) (GPT-2), biases zero, embeddings ~ N(0, std), RMSNorms one, other leaf
    modules their own ``reset_parameters``."""
    out_std = std / math.sqrt(2 * layers)
    for name, module in root.named_modules():
        if isinstance(module, nn.Linear):
            is_residual_out = name.endswith("attn.wo") or name.endswith("mlp.w2")
            nn.init.normal_(module.weight, mean=0.0, std=out_std if is_residual_out else std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=std)
        elif isinstance(module, nn.RMSNorm):
            nn.init.ones_(module.weight)
        elif hasattr(module, "reset_parameters") and module is not root and not list(module.children()):
            module.reset_parameters()

AttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, bool], torch.Tensor]


def sdpa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` on (batch, heads, seq, head_dim) tensors."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal)


def math_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
    """The reference path: explicit softmax(q k^T / sqrt(d)) v with an additive causal mask."""
    scores = (q @ k.transpose(-2, -1)) * q.shape[-1] ** -0.5
    if causal:
        seq = q.shape[-2]
        mask = torch.ones(seq, seq, dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(mask, float("-inf"))
    return torch.softmax(scores.float(), dim=-1).type_as(q) @ v


def rope_tables(head_dim: int, max_seq_len: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables of shape (max_seq_len, head_dim // 2), in fp32."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float64), inv_freq)
    return angles.cos().float(), angles.sin().float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs of channels of x (batch, seq, heads, head_dim) by position-dependent angles:
    each pair (x1, x2) as the complex number x1 + i x2 times cos + i sin, one complex multiply
    (forward and backward); the same result as the real form (x1 cos - x2 sin, x1 sin + x2 cos),
    which cost four products and a stack (7x the time on a CPU)."""
    pairs = torch.view_as_complex(x.float().unflatten(-1, (-1, 2)))
    rotation = torch.complex(cos.float(), sin.float())[None, :, None, :]
    return torch.view_as_real(pairs * rotation).flatten(-2).type_as(x)


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int, *, causal: bool, attention: AttentionFn) -> None:
        super().__init__()
        self.heads = heads
        self.head_dim = dim // heads
        self.causal = causal
        self.attention = attention
        self.wq = nn.Linear(dim, dim, bias=False)
        self.wk = nn.Linear(dim, dim, bias=False)
        self.wv = nn.Linear(dim, dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        shape = (batch, seq, self.heads, self.head_dim)
        q = apply_rope(self.wq(x).view(shape), cos, sin)
        k = apply_rope(self.wk(x).view(shape), cos, sin)
        v = self.wv(x).view(shape)
        out = self.attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), self.causal)
        return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))


class MLP(nn.Module):
    def __init__(self, dim: int, ffn_dim: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, ffn_dim, bias=False)
        self.w2 = nn.Linear(ffn_dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.gelu(self.w1(x)))


class Block(nn.Module):
    """Pre-norm residual block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, cfg: ModelConfig, *, causal: bool, attention: AttentionFn) -> None:
        super().__init__()
        self.attn_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.attn = Attention(cfg.dim, cfg.heads, causal=causal, attention=attention)
        self.mlp_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.mlp = MLP(cfg.dim, cfg.ffn_dim)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


class Transformer(nn.Module):
    """embed -> blocks -> final norm -> head. ``layers`` is a ModuleDict keyed "0", "1", ... so
    per-block wrappers keep parameter names stable (as torchtitan does)."""

    def __init__(
        self,
        cfg: ModelConfig,
        *,
        embed: nn.Module,
        head: nn.Module,
        causal: bool,
        max_seq_len: int,
        attention: AttentionFn = sdpa_attention,
        fusion: nn.Module | None = None,
    ) -> None:
        super().__init__()
        self.cfg = cfg
        self.max_seq_len = max_seq_len
        self.embed = embed
        self.layers = nn.ModuleDict(
            {str(i): Block(cfg, causal=causal, attention=attention) for i in range(cfg.layers)}
        )
        self.norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.head = head
        self.decoder_parts = DecoderParts(embed="embed", layers="layers", norm="norm", head="head",
                                          attention_width=cfg.dim)
        # optbench.model.fusion.Fusion (task=climate_text), registered after the decoder so that the
        # decoder's parameter names and, for a seed, its initial weights are the plain model's
        self.fusion = fusion
        half = cfg.head_dim // 2
        self.rope_len = max(max_seq_len + fusion.prefix_tokens(), fusion.num_tokens) if fusion is not None \
            else max_seq_len
        self.register_buffer("rope_cos", torch.empty(self.rope_len, half), persistent=False)
        self.register_buffer("rope_sin", torch.empty(self.rope_len, half), persistent=False)

    def forward(self, inputs: torch.Tensor, context: torch.Tensor | None = None) -> torch.Tensor:
        """Logits (or the task's head output) for ``inputs``; with ``context`` (the climate input
        of a fused model) the fusion layers read it, without it the decoder runs alone."""
        h = self.embed(inputs)
        seq = h.shape[1]
        if seq > self.max_seq_len:
            raise ValueError(f"sequence of {seq} tokens exceeds the model's max_seq_len={self.max_seq_len}")
        cos, sin = self.rope_cos[:seq], self.rope_sin[:seq]
        if context is None or self.fusion is None:
            for block in self.layers.values():
                h = block(h, cos, sin)
            return self.head(self.norm(h))
        fusion = self.fusion
        c = fusion.encode(context, self.rope_cos, self.rope_sin)
        h = fusion.prefix_input(fusion.add_input(h, c), c)
        cos, sin = self.rope_cos[: h.shape[1]], self.rope_sin[: h.shape[1]]
        for name, block in self.layers.items():
            if name in fusion.layers:
                h = fusion.layers[name](h, c)
            h = block(h, cos, sin)
        return self.head(self.norm(fusion.text_part(h)))

    @torch.no_grad()
    def init_weights(self) -> None:
        """Initialize every parameter and buffer in place (after ``to_empty``); uses the global
        torch RNG, so seed it first. Linear weights ~ N(0, init_std), residual output projections
        scaled by 1/sqrt(2 * layers) (GPT-2), norms to one, RoPE tables recomputed."""
        init_module_weights(self, std=self.cfg.init_std, layers=self.cfg.layers)
        cos, sin = rope_tables(self.cfg.head_dim, self.rope_len, self.cfg.rope_theta)
        self.rope_cos.copy_(cos)
        self.rope_sin.copy_(sin)
