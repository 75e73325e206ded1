"""Schemas of the model shape and the numerics (the ``model`` and ``precision`` groups)."""

from __future__ import annotations

from dataclasses import dataclass

from optbench.config.checks import one_of, positive
from optbench.errors import ConfigError

PRECISIONS = ("fp32", "tf32", "fp16", "bf16", "float8", "float8_rowwise")
FLOAT8_RECIPES = ("tensorwise", "rowwise")  # torchao.float8 recipe names


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

    def with_layers(self, layers: int) -> ModelConfig:
        """The same model with ``layers`` blocks (the estimate's short copies)."""
        import dataclasses

        return dataclasses.replace(self, layers=layers)


# ------------------------------------------------------------------------------------ precision
@dataclass
class PrecisionConfig:
    """Numerics of the training step.

    ``autocast`` is the dtype autocast runs matmuls in (null = no autocast); ``tf32`` allows TF32
    matmuls on CUDA; ``grad_scaler`` enables loss scaling (fp16 needs it).
    """

    name: str = "fp32"
    autocast: str | None = None
    tf32: bool = False
    grad_scaler: bool = False
    # float8 training (torchao.float8): the transformer blocks' Linears run their matmuls in float8
    # with this scaling recipe; null = no float8. Needs autocast=bfloat16 for everything else.
    float8_recipe: str | None = None

    def __post_init__(self) -> None:
        one_of("precision", self.name, PRECISIONS)
        one_of("precision.autocast", self.autocast, (None, "bfloat16", "float16"))
        if self.float8_recipe is not None:
            one_of("precision.float8_recipe", self.float8_recipe, FLOAT8_RECIPES)
            if self.autocast != "bfloat16":
                raise ConfigError(f"precision.float8_recipe={self.float8_recipe} runs the rest of the model in "
                                  "bf16 autocast; set precision.autocast=bfloat16 (precision=float8 does)")
        if self.autocast == "float16" and not self.grad_scaler:
            raise ConfigError(
                "precision.autocast=float16 without precision.grad_scaler=true underflows gradients; "
                "use precision=fp16 (which enables the scaler) or precision=bf16"
            )
