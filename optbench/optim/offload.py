"""torchao's CPUOffloadOptimizer: optimizer state and the optimizer step on the CPU (ZeRO-Offload
for a single GPU).

torchao is imported here, lazily: its import takes seconds (the notes it logs about kernels it
cannot load are dropped, ``optbench.logs.quiet_imports``), and only a CUDA/XPU run that asked for
``optimizer=cpu_offload`` needs it.
Its documented limits (torchao/optim/README.md), enforced before launch by ``optbench.training.preflight``:
CUDA or XPU only; single-GPU ("for multi-GPU training, you can use FSDP's built-in CPU offload");
no gradient clipping (gradients are copied to the CPU as soon as backward produces them, before any
clipping could act); ``offload_gradients=True`` is not compatible with gradient accumulation.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from optbench.config import CPUOffloadOptimizerConfig
from optbench.errors import ConfigError
from optbench.logs import quiet_imports
from optbench.optim.decay import param_groups

log = logging.getLogger(__name__)


def build_cpu_offload(model: nn.Module, *, cfg: CPUOffloadOptimizerConfig, lr: float) -> torch.optim.Optimizer:
    """``CPUOffloadOptimizer`` wrapping AdamW (fused or foreach, as ``cfg.impl`` says) with the same
    decay groups as plain AdamW. Precondition: the model is materialized on a CUDA/XPU device with
    its final weights (torchao copies them to pinned CPU memory here)."""
    try:
        with quiet_imports():  # torchao's first import: its failed loads of kernels built for other CUDA/Pythons
            from torchao.optim import CPUOffloadOptimizer
    except ImportError as exc:
        raise ConfigError(f"optimizer=cpu_offload needs torchao ({exc}): pip install torchao") from exc

    fused = cfg.impl == "fused"
    optimizer = CPUOffloadOptimizer(
        param_groups(model, weight_decay=cfg.weight_decay),
        torch.optim.AdamW,
        offload_gradients=cfg.offload_gradients,
        minimal_size=cfg.minimal_size,
        lr=lr,
        betas=(cfg.betas[0], cfg.betas[1]),
        eps=cfg.eps,
        fused=fused,
        foreach=not fused,
    )
    log.info(
        "Applied torchao CPUOffloadOptimizer (AdamW %s, offload_gradients=%s): %d tensors offloaded, %d kept on device",
        cfg.impl, cfg.offload_gradients, len(optimizer.param_d2h_map),
        sum(len(g["params"]) for g in optimizer.d_param_groups),
    )
    return optimizer
