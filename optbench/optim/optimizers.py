"""Optimizers and learning-rate schedules."""

from __future__ import annotations

import logging
import math

import torch
from torch import nn

from optbench.config import OptimizerConfig, TrainConfig

log = logging.getLogger(__name__)


def param_groups(model: nn.Module, *, weight_decay: float) -> list[dict]:
    """Weight decay on matrices (dim >= 2) only; norms, biases and other vectors are not decayed."""
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def build_optimizer(model: nn.Module, *, cfg: OptimizerConfig, lr: float) -> torch.optim.Optimizer:
    """torch.optim.AdamW with the configured kernel (foreach or fused)."""
    fused = cfg.impl == "fused"
    optimizer = torch.optim.AdamW(
        param_groups(model, weight_decay=cfg.weight_decay),
        lr=lr,
        betas=(cfg.betas[0], cfg.betas[1]),
        eps=cfg.eps,
        foreach=not fused,
        fused=fused,
    )
    log.info("Applied optimizer AdamW (%s)", cfg.impl)
    return optimizer


def lr_factor(step: int, *, cfg: TrainConfig) -> float:
    """Linear warmup over ``warmup_steps``, then cosine decay to ``min_lr_ratio`` at ``steps``
    (``schedule=cosine``), or flat (``schedule=constant``, after the same warmup)."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant":
        return 1.0
    progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    cosine = 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
    return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * cosine


def build_scheduler(
    optimizer: torch.optim.Optimizer, *, cfg: TrainConfig
) -> torch.optim.lr_scheduler.LRScheduler:
    """warmup + cosine (default) or constant via LambdaLR; ``onecycle`` is torch's OneCycleLR with
    its peak at ``warmup_steps``."""
    if cfg.schedule == "onecycle":
        return torch.optim.lr_scheduler.OneCycleLR(
            optimizer,
            max_lr=cfg.lr,
            total_steps=cfg.steps,
            pct_start=max(cfg.warmup_steps, 1) / cfg.steps,
        )
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, cfg=cfg))
