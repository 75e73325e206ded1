"""Schemas of what ``optbench.training`` applies to the step: numerics (``precision``, float8),
activation checkpointing (``ac``), ``compile``, ``attention``, data parallelism (``parallel``,
``nccl``) and how often the auxiliary losses run (``loss_freq``).

Every group's choice is its ``name`` (the preset's own name), and a group whose default turns the
optimization off calls that default ``none``."""

from __future__ import annotations

from dataclasses import dataclass, field

from optbench.config.checks import one_of, positive
from optbench.errors import ConfigError

PRECISIONS = ("fp32", "tf32", "fp16", "bf16", "float8", "float8_rowwise")
FLOAT8_RECIPES = ("tensorwise", "rowwise")  # torchao.float8 recipe names
AC_MODES = ("none", "selective", "full")
COMPILE_MODES = ("none", "default", "reduce-overhead", "max-autotune")
ATTENTION_KERNELS = ("sdpa", "flex", "math")
PARALLEL_MODES = ("single", "ddp", "fsdp2")


# ------------------------------------------------------------------------------------ precision
@dataclass
class PrecisionConfig:
    """Numerics of the training step.

    ``autocast`` is the dtype autocast runs matmuls in (null = no autocast); ``tf32`` allows TF32
    matmuls on CUDA; ``grad_scaler`` enables loss scaling (fp16 needs it). ``float8_recipe``: the
    transformer blocks' Linears run their matmuls in float8 (torchao.float8) with this scaling
    recipe; null = no float8. It needs ``autocast=bfloat16`` for everything else.
    """

    name: str = "fp32"
    autocast: str | None = None
    tf32: bool = False
    grad_scaler: bool = False
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


# ------------------------------------------------------------------------------ ac, compile, attn
@dataclass
class ACConfig:
    """Activation checkpointing (non-reentrant), the ``ac`` group: ``full`` wraps every block,
    ``selective`` every ``every``-th block, ``none`` keeps all activations."""

    name: str = "none"
    every: int = 2

    def __post_init__(self) -> None:
        one_of("ac", self.name, AC_MODES)
        positive(**{"ac.every": self.every})


@dataclass
class CompileConfig:
    """torch.compile per transformer block; ``name`` is torch.compile's mode (``none``: eager)."""

    name: str = "none"
    fullgraph: bool = False

    def __post_init__(self) -> None:
        one_of("compile", self.name, COMPILE_MODES)


@dataclass
class AttentionConfig:
    """The attention kernel: ``sdpa`` (F.scaled_dot_product_attention), ``flex`` (FlexAttention
    with a block mask) or ``math`` (explicit softmax(QK^T)V, the reference)."""

    name: str = "sdpa"

    def __post_init__(self) -> None:
        one_of("attention", self.name, ATTENTION_KERNELS)


# ------------------------------------------------------------------------------------- parallel
@dataclass
class ParallelConfig:
    """Data parallelism: ``single``, ``ddp`` or ``fsdp2`` over ``nproc_per_node`` local workers
    (self-launched unless under torchrun); ``backend`` auto picks nccl on CUDA and gloo on CPU.
    ``cpu_offload``: FSDP2's own CPU offload (``fully_shard(offload_policy=CPUOffloadPolicy())``):
    sharded parameters, gradients and optimizer state live on the CPU and the optimizer steps there.
    ``start_method``: how self-launched workers start: forked from a warm process that keeps torch
    and optbench imported across launches (``forkserver``), or a fresh interpreter each (``spawn``)."""

    name: str = "single"
    nproc_per_node: int = 1
    backend: str = "auto"
    reshard_after_forward: bool = True
    cpu_offload: bool = False
    start_method: str = "forkserver"

    def __post_init__(self) -> None:
        one_of("parallel", self.name, PARALLEL_MODES)
        if self.cpu_offload and self.name != "fsdp2":
            raise ConfigError(
                f"parallel.cpu_offload=true is FSDP2's CPUOffloadPolicy; it needs parallel=fsdp2, not "
                f"parallel={self.name}"
            )
        one_of("parallel.backend", self.backend, ("auto", "gloo", "nccl"))
        one_of("parallel.start_method", self.start_method, ("forkserver", "spawn"))
        if self.name == "single" and self.nproc_per_node != 1:
            raise ConfigError(
                f"parallel=single runs one process but parallel.nproc_per_node={self.nproc_per_node}; "
                "use parallel=ddp or parallel=fsdp2 for several workers"
            )


@dataclass
class NCCLConfig:
    """Environment variables for NCCL (the phase-1 tuning); applied only where NCCL runs. ``default``
    sets none: NCCL runs either way, so its absence of tuning is NCCL's defaults, not "off"."""

    name: str = "default"
    env: dict[str, str] = field(default_factory=dict)


# ------------------------------------------------------------------------------------ loss_freq
@dataclass
class LossFreqConfig:
    """Auxiliary losses are computed on steps where ``step % every == 0`` only; ``num_queries`` is
    how many points a task samples for its auxiliary loss (the decoder queries)."""

    name: str = "every_step"
    every: int = 1
    num_queries: int = 2048

    def __post_init__(self) -> None:
        positive(**{"loss_freq.every": self.every, "loss_freq.num_queries": self.num_queries})
