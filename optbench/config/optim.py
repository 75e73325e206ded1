"""Schemas of the optimizations: optimizer, compile, checkpointing, attention, parallel, nccl,
dataloader, loss_freq and fusion."""

from __future__ import annotations

from dataclasses import dataclass, field

from optbench.config.checks import non_negative, one_of, positive
from optbench.errors import ConfigError


# ------------------------------------------------------------------------------------ optimizer
@dataclass
class OptimizerConfig:
    """AdamW; ``impl`` picks torch's multi-tensor (foreach) or fused kernel.

    Every kind uses AdamW for at least some parameters, so its fields live here; a kind with more
    knobs subclasses this (``CPUOffloadOptimizerConfig``, ``MuonOptimizerConfig``) and is selected
    by the preset's ``base_<kind>`` schema."""

    name: str = "adamw"
    impl: str = "foreach"
    weight_decay: float = 0.1
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8

    def __post_init__(self) -> None:
        one_of("optimizer.impl", self.impl, ("foreach", "fused"))
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            raise ConfigError(f"optimizer.betas must be two numbers in [0, 1), got {self.betas}")
        non_negative(**{"optimizer.weight_decay": self.weight_decay})
        positive(**{"optimizer.eps": self.eps})

    def offloads(self) -> tuple[bool, bool]:
        """(optimizer states live on the host, device gradients are freed as they are copied there)."""
        return False, False

    def state_bytes(self, *, params: int, matrices: int) -> int:
        """Bytes of optimizer state for ``params`` parameters, ``matrices`` of them in the blocks'
        weight matrices: AdamW keeps exp_avg and exp_avg_sq in fp32 (8 B/param)."""
        return 8 * params


@dataclass
class CPUOffloadOptimizerConfig(OptimizerConfig):
    """torchao's ``CPUOffloadOptimizer`` around AdamW (ZeRO-Offload for one GPU): optimizer state
    and the step live on the CPU. ``offload_gradients`` also frees device gradients after their copy
    (not compatible with gradient accumulation); tensors under ``minimal_size`` elements stay on
    the device."""

    name: str = "cpu_offload"
    impl: str = "fused"
    offload_gradients: bool = False
    minimal_size: int = 4096

    def __post_init__(self) -> None:
        super().__post_init__()
        positive(**{"optimizer.minimal_size": self.minimal_size})

    def offloads(self) -> tuple[bool, bool]:
        return True, self.offload_gradients


MUON_LR_ADJUSTMENTS = ("original", "match_rms_adamw")


@dataclass
class MuonOptimizerConfig(OptimizerConfig):
    """``torch.optim.Muon`` for the 2-D weight matrices of the transformer trunk, AdamW (the fields
    inherited from OptimizerConfig) for everything else: embeddings, head, norms. With
    ``adjust_lr_fn=match_rms_adamw`` Muon reuses AdamW's learning rate and weight decay."""

    name: str = "muon"
    momentum: float = 0.95
    nesterov: bool = True
    ns_steps: int = 5
    adjust_lr_fn: str = "match_rms_adamw"

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0.0 <= self.momentum < 1.0:
            raise ConfigError(f"optimizer.momentum must be in [0, 1), got {self.momentum}")
        positive(**{"optimizer.ns_steps": self.ns_steps})
        one_of("optimizer.adjust_lr_fn", self.adjust_lr_fn, MUON_LR_ADJUSTMENTS)

    def state_bytes(self, *, params: int, matrices: int) -> int:
        """Muon keeps one fp32 momentum for the blocks' matrices, AdamW two states for the rest."""
        return 4 * matrices + 8 * (params - matrices)


# -------------------------------------------------------------------------- optimization groups
COMPILE_MODES = ("off", "default", "reduce-overhead", "max-autotune")
CHECKPOINTING_MODES = ("none", "selective", "full")
ATTENTION_KERNELS = ("sdpa", "flex", "math")
PARALLEL_MODES = ("single", "ddp", "fsdp2")


@dataclass
class CompileConfig:
    """torch.compile per transformer block; ``mode`` is torch.compile's mode (off = eager)."""

    mode: str = "off"
    fullgraph: bool = False

    @property
    def name(self) -> str:
        """The preset's name: the mode it selects (one source of truth, not a second field)."""
        return self.mode

    def __post_init__(self) -> None:
        one_of("compile.mode", self.mode, COMPILE_MODES)


@dataclass
class CheckpointingConfig:
    """Activation checkpointing (non-reentrant): ``full`` wraps every block, ``selective`` every
    ``every``-th block, ``none`` keeps all activations."""

    mode: str = "none"
    every: int = 2

    @property
    def name(self) -> str:
        """The preset's name: the mode it selects (one source of truth, not a second field)."""
        return self.mode

    def __post_init__(self) -> None:
        one_of("checkpointing.mode", self.mode, CHECKPOINTING_MODES)
        positive(**{"checkpointing.every": self.every})


@dataclass
class AttentionConfig:
    """The attention kernel: ``sdpa`` (F.scaled_dot_product_attention), ``flex`` (FlexAttention
    with a block mask) or ``math`` (explicit softmax(QK^T)V, the reference)."""

    kernel: str = "sdpa"

    @property
    def name(self) -> str:
        """The preset's name: the kernel it selects (one source of truth, not a second field)."""
        return self.kernel

    def __post_init__(self) -> None:
        one_of("attention.kernel", self.kernel, ATTENTION_KERNELS)


@dataclass
class ParallelConfig:
    """Data parallelism. ``nproc_per_node`` local workers (self-launched unless under torchrun);
    ``backend`` auto picks nccl on CUDA and gloo on CPU."""

    mode: str = "single"
    nproc_per_node: int = 1
    backend: str = "auto"
    reshard_after_forward: bool = True
    # FSDP2's own CPU offload (fully_shard(offload_policy=CPUOffloadPolicy())): sharded parameters,
    # gradients and optimizer state live on the CPU and the optimizer steps there.
    cpu_offload: bool = False

    @property
    def name(self) -> str:
        """The preset's name: the mode it selects (one source of truth, not a second field)."""
        return self.mode

    def __post_init__(self) -> None:
        one_of("parallel.mode", self.mode, PARALLEL_MODES)
        if self.cpu_offload and self.mode != "fsdp2":
            raise ConfigError(
                f"parallel.cpu_offload=true is FSDP2's CPUOffloadPolicy; it needs parallel=fsdp2, not "
                f"parallel={self.mode}"
            )
        one_of("parallel.backend", self.backend, ("auto", "gloo", "nccl"))
        if self.mode == "single" and self.nproc_per_node != 1:
            raise ConfigError(
                f"parallel.mode=single runs one process but parallel.nproc_per_node={self.nproc_per_node}; "
                "use parallel=ddp or parallel=fsdp2 for several workers"
            )


@dataclass
class NCCLConfig:
    """Environment variables for NCCL (the plan's phase-1 tuning); applied only where NCCL runs."""

    name: str = "default"
    env: dict[str, str] = field(default_factory=dict)


# ----------------------------------------------------------------------------------- dataloader
@dataclass
class DataLoaderConfig:
    """torch DataLoader knobs. ``prefetch_factor`` and ``persistent_workers`` only apply with
    ``num_workers > 0``."""

    name: str = "baseline"
    num_workers: int = 0
    pin_memory: bool = False
    persistent_workers: bool = False
    prefetch_factor: int | None = None

    def __post_init__(self) -> None:
        non_negative(**{"dataloader.num_workers": self.num_workers})
        if self.num_workers == 0 and (self.persistent_workers or self.prefetch_factor is not None):
            raise ConfigError(
                "dataloader.persistent_workers and dataloader.prefetch_factor need "
                "dataloader.num_workers > 0; set num_workers or reset them (false / null)"
            )
        if self.prefetch_factor is not None:
            positive(**{"dataloader.prefetch_factor": self.prefetch_factor})


# ------------------------------------------------------------------------------------ loss_freq
@dataclass
class LossFreqConfig:
    """Auxiliary losses are computed on steps where ``step % every == 0`` only; ``num_queries`` is
    how many points a task samples for its auxiliary loss (the plan's decoder queries)."""

    name: str = "every_step"
    every: int = 1
    num_queries: int = 2048

    def __post_init__(self) -> None:
        positive(**{"loss_freq.every": self.every, "loss_freq.num_queries": self.num_queries})


# --------------------------------------------------------------------------------------- fusion
FUSION_KINDS = ("none", "add", "cross_attention", "gated")


@dataclass
class FusionConfig:
    """How the climate tokens reach the decoder (``task=climate_text``); see ``optbench.model.fusion``.

    ``kind``: ``none``; ``add`` (mean-pooled climate tokens, projected and added to every text
    embedding through a learned per-channel gate); ``cross_attention`` (a cross-attention + MLP
    layer with residual connections before every ``every``-th decoder layer); ``gated`` (the same
    layers with Flamingo's tanh gates, initialized at 0, so the untrained model is the base model).
    ``encoder_layers``: bidirectional transformer blocks over the climate patch tokens.
    ``freeze_base``: the decoder (embedding, blocks, norm, head) gets no gradients and no optimizer
    state. ``base_checkpoint``: an optbench checkpoint directory of a ``task=lm`` run whose model
    initializes the decoder."""

    name: str = "none"
    kind: str = "none"
    every: int = 2
    encoder_layers: int = 1
    freeze_base: bool = False
    base_checkpoint: str | None = None

    def __post_init__(self) -> None:
        if self.kind not in FUSION_KINDS:
            raise ConfigError(f"fusion.kind={self.kind} is unknown; use one of {', '.join(FUSION_KINDS)}")
        positive(**{"fusion.every": self.every})
        non_negative(**{"fusion.encoder_layers": self.encoder_layers})
