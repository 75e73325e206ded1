"""Schemas of the model (``optbench.model``): the transformer's shape (the ``model`` group) and the
fusion layers that let it read climate tokens (the ``fusion`` group)."""

from __future__ import annotations

from dataclasses import dataclass

from optbench.config.checks import finite, non_negative, one_of, positive
from optbench.errors import ConfigError

FUSION_KINDS = ("none", "add", "cross_attention", "gated", "prefix")


# ---------------------------------------------------------------------------------------- model
@dataclass
class ModelConfig:
    """Shape of the transformer trunk plus the token vocabulary of the lm task."""

    name: str = "custom"
    dim: int = 128
    layers: int = 4
    heads: int = 4
    ffn_dim: int = 512
    vocab_size: int = 1024
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    init_std: float = 0.02

    def __post_init__(self) -> None:
        positive(
            **{
                "model.dim": self.dim,
                "model.layers": self.layers,
                "model.heads": self.heads,
                "model.ffn_dim": self.ffn_dim,
                "model.vocab_size": self.vocab_size,
            }
        )
        finite(**{"model.rope_theta": self.rope_theta, "model.norm_eps": self.norm_eps, "model.init_std": self.init_std})
        if self.dim % self.heads:
            divisors = [
                h
                for h in range(max(1, self.heads - 16), self.heads + 17)
                if self.dim % h == 0 and (self.dim // h) % 2 == 0
            ]
            raise ConfigError(
                f"model.dim={self.dim} is not divisible by model.heads={self.heads}; "
                f"pick heads that divide the width (e.g. {', '.join(map(str, divisors[-4:]))})"
            )
        if (self.dim // self.heads) % 2:
            raise ConfigError(
                f"head dim model.dim/model.heads={self.dim // self.heads} is odd; RoPE needs an even "
                "head dim"
            )

    @property
    def head_dim(self) -> int:
        return self.dim // self.heads

    def block_period(self) -> int:
        """Blocks that repeat as a unit: every block of this model is alike."""
        return 1

    def vocab_key(self) -> str:
        """The override that sets this model's vocabulary size (named in the data's vocabulary errors)."""
        return "model.vocab_size"

    def own_tokenizer(self) -> str | None:
        """The tokenizer this model brings (a tokenizer.json or a directory holding one), which a task
        that tokenizes texts uses when ``data.tokenizer`` is unset; None: it brings none (bytes)."""
        return None

    def with_layers(self, layers: int) -> ModelConfig:
        """The same model with ``layers`` blocks (the estimate's short copies)."""
        import dataclasses

        return dataclasses.replace(self, layers=layers)


# --------------------------------------------------------------------------------------- fusion
@dataclass
class FusionConfig:
    """How the climate tokens reach the decoder (``task=climate_text``); see ``optbench.model.fusion``.

    ``name``: ``none``; ``add`` (mean-pooled climate tokens, projected and added to every text
    embedding through a learned per-channel gate); ``cross_attention`` (a cross-attention + MLP
    layer with residual connections before every ``every``-th decoder layer); ``gated`` (the same
    layers with Flamingo's tanh gates, initialized at 0, so the untrained model is the base model);
    ``prefix`` (LLaVA-style: the climate tokens, projected by a two-layer MLP, placed before the
    text in the decoder's own sequence). ``encoder_layers``: bidirectional transformer blocks over
    the climate patch tokens. ``freeze_base``: the decoder (embedding, blocks, norm, head) gets no
    gradients and no optimizer state. ``base_checkpoint``: an optbench checkpoint directory of a
    ``task=lm`` run whose model initializes the decoder. ``encoder_checkpoint``: one of a
    ``task=climate`` run (the forecaster) whose trunk (patch embedding, first ``encoder_layers``
    blocks, final norm) initializes the climate encoder; ``freeze_encoder``: the climate encoder
    gets no gradients. ``base_dtype``: the frozen decoder's stored dtype, ``fp32`` or ``bf16`` (half
    the bytes, and no bf16 autocast copies of its weights; needs ``freeze_base=true`` and
    ``precision=bf16``)."""

    name: str = "none"
    every: int = 2
    encoder_layers: int = 1
    freeze_base: bool = False
    base_checkpoint: str | None = None
    encoder_checkpoint: str | None = None
    freeze_encoder: bool = False
    base_dtype: str = "fp32"

    def __post_init__(self) -> None:
        one_of("fusion", self.name, FUSION_KINDS)
        one_of("fusion.base_dtype", self.base_dtype, ("fp32", "bf16"))
        positive(**{"fusion.every": self.every})
        non_negative(**{"fusion.encoder_layers": self.encoder_layers})
