"""Schemas of the optimizers (the ``optimizer`` group; ``optbench.optim``)."""

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
