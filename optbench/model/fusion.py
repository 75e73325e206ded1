"""Climate-text fusion: a climate encoder and the layers through which the decoder reads it.

``Fusion`` is registered on the ``Transformer`` as ``model.fusion`` (after the base decoder, so the
decoder's parameter names, and its initialization for a given seed, are those of the plain model).
Its blocks live in two ``nn.ModuleDict``s that ``optbench.training.parallelize`` treats like the decoder's
``model.layers`` — activation checkpointing, compile and FSDP2 apply per block — and they are built
with the decoder's attention kernel; precision is the run's autocast. The kinds (``fusion.name``):

- ``add`` — the plan's "simple fusion": the climate tokens are mean-pooled, projected, scaled by a
  learned per-channel gate (initialized at 1) and added to every text embedding.
- ``cross_attention`` — the plan's "true cross-attention": before every ``every``-th decoder layer
  (0, every, 2*every, ...), a layer whose text queries attend to the climate tokens, then an MLP,
  each with a residual connection: ``h += xattn(norm(h), c)``; ``h += mlp(norm(h))``.
- ``gated`` — Flamingo's gated cross-attention (Alayrac et al. 2022; mlfoundations/open_flamingo's
  ``GatedCrossAttentionBlock``): the same layers with ``h += tanh(a) * xattn(...)`` and
  ``h += tanh(b) * mlp(...)``, ``a = b = 0`` at initialization, so the untrained fused model
  computes exactly (bit for bit) the base model's outputs.
- ``prefix`` — LLaVA-style (Liu et al. 2023; LLaVA-1.5's two-layer GELU projector): the climate
  tokens, projected into the decoder's width, are placed before the text in the decoder's own
  sequence; the text reads them through the decoder's causal self-attention, and the prefix
  positions' outputs are dropped before the head. No new decoder layers: over a frozen base only
  the encoder and the projection train.

The climate encoder is the climate task's patch embedding (``(B, history, C, H, W)`` -> patch
tokens + learned positions), ``encoder_layers`` bidirectional decoder-style blocks (RoPE over the
token index, as the climate task's trunk) and a final norm — the same modules, and parameter names
under ``fusion.``, as a ``task=climate`` run's ``embed``, ``layers`` and ``norm``: its trunk can
initialize the encoder (``fusion.encoder_checkpoint``, ``optbench.training.kinds.fused``) and
``freeze_encoder`` freezes it.

Over a Hugging Face decoder (``model=hf``), ``optbench.model.hf_fusion`` puts the same ``Fusion`` on
the transformers model as ``model.fusion``: the cross-attention blocks run before their decoder
layers, the encoder has its own RoPE tables (``rope=True``).

``freeze_base`` turns off ``requires_grad`` of the decoder (everything outside ``model.fusion``):
autograd then computes no weight gradients for it, the optimizer holds no state for it (only
parameters that require gradients are given to it) and DDP/FSDP2 reduce no gradients for it.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from optbench.config import FusionConfig, ModelConfig
from optbench.model.transformer import MLP, AttentionFn, Block, rope_tables

log = logging.getLogger(__name__)



class Gate(nn.Module):
    """``tanh(alpha) * x`` with a learned ``alpha`` of ``size`` values, initialized at ``init``
    (``init=0``: the gate is closed and ``x`` contributes exactly nothing). ``tanh=False`` is a
    plain learned scale ``alpha * x``."""

    def __init__(self, size: int, *, init: float, tanh: bool) -> None:
        super().__init__()
        self.init, self.tanh = init, tanh
        self.alpha = nn.Parameter(torch.empty(size))

    def reset_parameters(self) -> None:
        nn.init.constant_(self.alpha, self.init)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = self.alpha.tanh() if self.tanh else self.alpha
        return scale.to(x.dtype) * x


class CrossAttention(nn.Module):
    """Queries from the text, keys and values from the climate tokens (no mask, no RoPE: the
    climate tokens carry learned positions), through the run's attention kernel."""

    def __init__(self, dim: int, heads: int, *, attention: AttentionFn) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.attention = attention
        self.wq = nn.Linear(dim, dim, bias=False)
        self.wk = nn.Linear(dim, dim, bias=False)
        self.wv = nn.Linear(dim, dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        q = self.wq(x).view(batch, seq, self.heads, self.head_dim).transpose(1, 2)
        k = self.wk(context).view(batch, context.shape[1], self.heads, self.head_dim).transpose(1, 2)
        v = self.wv(context).view(batch, context.shape[1], self.heads, self.head_dim).transpose(1, 2)
        out = self.attention(q, k, v, False)
        return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))


class CrossAttentionBlock(nn.Module):
    """Pre-norm cross-attention then MLP, each with a residual connection; ``gated`` puts a tanh
    gate (initialized closed) on each branch."""

    def __init__(self, cfg: ModelConfig, *, gated: bool, attention: AttentionFn) -> None:
        super().__init__()
        self.attn_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.attn = CrossAttention(cfg.dim, cfg.heads, attention=attention)
        self.mlp_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.mlp = MLP(cfg.dim, cfg.ffn_dim)
        self.gated = gated
        if gated:
            self.attn_gate = Gate(1, init=0.0, tanh=True)
            self.mlp_gate = Gate(1, init=0.0, tanh=True)

    def forward(self, x: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        a = self.attn(self.attn_norm(x), context)
        x = x + (self.attn_gate(a) if self.gated else a)
        m = self.mlp(self.mlp_norm(x))
        return x + (self.mlp_gate(m) if self.gated else m)


class Fusion(nn.Module):
    """The climate encoder (``embed``, ``encoder`` blocks, ``norm``) and the fusion of ``kind``:
    ``add`` (``proj`` + ``gate``) or cross-attention blocks in ``layers``, keyed by the index of
    the decoder layer they precede."""

    def __init__(self, cfg: ModelConfig, fusion: FusionConfig, *, embed: nn.Module, num_tokens: int,
                 attention: AttentionFn, rope: bool = False) -> None:
        super().__init__()
        assert fusion.name != "none"
        self.kind = fusion.name
        self.num_tokens = num_tokens
        self.head_dim, self.rope_theta = cfg.head_dim, cfg.rope_theta
        # the encoded climate of the forward in progress, for fusion blocks that hooks run (model=hf)
        self.context: torch.Tensor | None = None
        self.embed = embed
        self.encoder = nn.ModuleDict(
            {str(i): Block(cfg, causal=False, attention=attention) for i in range(fusion.encoder_layers)})
        self.norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.layers = nn.ModuleDict()
        if fusion.name == "add":
            self.proj = nn.Linear(cfg.dim, cfg.dim, bias=False)
            self.gate = Gate(cfg.dim, init=1.0, tanh=False)
        elif fusion.name == "prefix":
            self.proj = nn.Sequential(nn.Linear(cfg.dim, cfg.dim), nn.GELU(), nn.Linear(cfg.dim, cfg.dim))
        else:
            for i in range(0, cfg.layers, fusion.every):
                self.layers[str(i)] = CrossAttentionBlock(cfg, gated=fusion.name == "gated", attention=attention)
        if rope:  # the encoder's own RoPE tables (optbench's Transformer lends its own)
            self.register_buffer("rope_cos", torch.empty(num_tokens, cfg.head_dim // 2), persistent=False)
            self.register_buffer("rope_sin", torch.empty(num_tokens, cfg.head_dim // 2), persistent=False)

    @torch.no_grad()
    def init_rope(self) -> None:
        cos, sin = rope_tables(self.head_dim, self.num_tokens, self.rope_theta)
        self.rope_cos.copy_(cos)
        self.rope_sin.copy_(sin)

    def encode(self, context: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """``(B, history, C, H, W)`` climate -> ``(B, tokens, dim)``."""
        c = self.embed(context)
        for block in self.encoder.values():
            c = block(c, cos[: c.shape[1]], sin[: c.shape[1]])
        return self.norm(c)

    def add_input(self, h: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        if self.kind != "add":
            return h
        return h + self.gate(self.proj(c.mean(dim=1)))[:, None, :]

    def prefix_input(self, h: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        """``prefix``: the projected climate tokens, then the text embeddings ``h``."""
        if self.kind != "prefix":
            return h
        return torch.cat([self.proj(c).to(h.dtype), h], dim=1)

    def text_part(self, h: torch.Tensor) -> torch.Tensor:
        """The text positions of the decoder's sequence (``prefix``: after the climate tokens)."""
        return h[:, self.num_tokens:] if self.kind == "prefix" else h

    def prefix_tokens(self) -> int:
        """Positions the fusion adds to the decoder's sequence."""
        return self.num_tokens if self.kind == "prefix" else 0

    def encoder_modules(self) -> dict[str, nn.Module]:
        """The climate encoder by the name its modules have in a ``task=climate`` run's model."""
        return {"embed": self.embed, "layers": self.encoder, "norm": self.norm}

    def block_groups(self) -> dict[str, nn.ModuleDict]:
        return {"fusion.encoder": self.encoder, "fusion.layers": self.layers}


# ------------------------------------------------------------------------------------ frozen base
def is_base_name(name: str) -> bool:
    """Whether the parameter or state-dict key ``name`` belongs to the base decoder: everything
    outside ``model.fusion`` (optbench's embed/layers/norm/head, a transformers model's own names)."""
    return name.split(".", 1)[0] != "fusion"


def base_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """The decoder's parameters (what ``freeze_base`` freezes and a base checkpoint holds)."""
    return [(name, p) for name, p in model.named_parameters() if is_base_name(name)]


def freeze_base(model: nn.Module, *, dtype: torch.dtype | None = None) -> int:
    """``requires_grad=False`` on the decoder's parameters (before data parallelism wraps the
    model, so DDP/FSDP2 see them frozen), stored in ``dtype`` if given (``fusion.base_dtype``;
    buffers such as RoPE tables keep theirs); returns how many values were frozen."""
    frozen = 0
    for _, p in base_parameters(model):
        p.requires_grad_(False)
        if dtype is not None:
            p.data = p.data.to(dtype)
        frozen += p.numel()
    if not any(p.requires_grad for p in model.parameters()):
        raise ValueError("fusion.freeze_base=true leaves nothing to train")
    log.info("Froze the base decoder: %s parameters without gradients or optimizer state", f"{frozen:,}")
    return frozen


def freeze_encoder(model: nn.Module) -> int:
    """``requires_grad=False`` on the climate encoder (``model.fusion``'s patch embedding, encoder
    blocks and norm); returns how many values were frozen."""
    frozen = 0
    for module in model.fusion.encoder_modules().values():
        for p in module.parameters():
            p.requires_grad_(False)
            frozen += p.numel()
    log.info("Froze the climate encoder: %s parameters without gradients or optimizer state", f"{frozen:,}")
    return frozen


# ---------------------------------------------------------------------------------------- FLOPs
def measured_flops_per_token(model: nn.Module, *, forward, tokens_per_sample: int) -> dict[str, float]:
    """Matmul and attention FLOPs of one training step per text token, counted by torch's
    ``FlopCounterMode`` while ``forward(model)`` (one sample, built by the caller on ``model``'s
    device — the meta device costs nothing) and its backward run: what autograd really computes,
    so frozen weights add no weight-gradient matmuls and layers below the first trainable one no
    input-gradient matmuls. Returns ``{"forward": ..., "training": ...}`` per token."""
    return per_token(counted_flops(model, forward=forward), tokens_per_sample=tokens_per_sample)


def counted_flops(model: nn.Module, *, forward) -> tuple[int, int]:
    """``measured_flops_per_token``'s counts for the whole sample: (forward, training) FLOPs, exact
    integers (a sum over the ops)."""
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        out = forward(model)
        forward_flops = counter.get_total_flops()
        F.mse_loss(out.float(), torch.zeros_like(out, dtype=torch.float32)).backward() if out.requires_grad else None
    total = counter.get_total_flops()
    for p in model.parameters():
        p.grad = None
    return forward_flops, total


def per_token(counts: tuple[int, int], *, tokens_per_sample: int) -> dict[str, float]:
    forward_flops, total = counts
    return {"forward": forward_flops / tokens_per_sample, "training": total / tokens_per_sample}


# ------------------------------------------------------------------------- memory tracking
class _NoHook:
    def remove(self) -> None:
        pass


class _FrozenParamsTolerant:
    """torch's ``MemTracker`` (2.13) installs a gradient hook on every parameter of each module it
    enters, and ``register_hook`` raises on a parameter that does not require gradients (a frozen
    base). A frozen parameter never has a gradient to count, so it gets a no-op handle instead;
    everything else is MemTracker's own accounting."""

    def _track_module_params_and_buffers(self, module: nn.Module, install_grad_hooks: bool = True) -> Any:
        if install_grad_hooks:
            for p in module.parameters():
                if not p.requires_grad and self._param_to_grad_hook_handles.get(p) is None:
                    self._param_to_grad_hook_handles[p] = (_NoHook(), _NoHook())
        return super()._track_module_params_and_buffers(module, install_grad_hooks)


def frozen_tolerant(tracker_class: type) -> type:
    """``tracker_class`` (MemTracker, FSDPMemTracker or a subclass) able to follow a model with frozen
    parameters."""
    return type(tracker_class.__name__, (_FrozenParamsTolerant, tracker_class), {})
