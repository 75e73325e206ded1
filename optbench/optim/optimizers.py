"""Optimizers and learning-rate schedules."""

from __future__ import annotations

import logging
import math
from typing import Any

import torch
from torch import nn

from optbench.config import CPUOffloadOptimizerConfig, MuonOptimizerConfig, OptimizerConfig, TrainConfig
from optbench.optim.decay import param_groups

log = logging.getLogger(__name__)


def build_optimizer(model: nn.Module, *, cfg: OptimizerConfig, lr: float) -> torch.optim.Optimizer:
    """The optimizer ``cfg`` names: AdamW (foreach or fused kernel), torchao's CPUOffloadOptimizer
    around AdamW (``CPUOffloadOptimizerConfig``) or Muon + AdamW (``MuonOptimizerConfig``)."""
    if isinstance(cfg, CPUOffloadOptimizerConfig):
        from optbench.optim.offload import build_cpu_offload

        return build_cpu_offload(model, cfg=cfg, lr=lr)
    if isinstance(cfg, MuonOptimizerConfig):
        from optbench.optim.muon import build_muon

        return build_muon(model, cfg=cfg, lr=lr)
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


def _kernel(optimizer: torch.optim.Optimizer) -> str:
    defaults = optimizer.defaults
    if defaults.get("fused"):
        return "fused"
    return "foreach" if defaults.get("foreach") else "for-loop"


def _tensors(optimizer: torch.optim.Optimizer) -> dict[str, int]:
    params = [p for g in optimizer.param_groups for p in g["params"]]
    return {"tensors": len(params), "numel": sum(p.numel() for p in params)}


def describe_optimizer(optimizer: torch.optim.Optimizer, *, cfg: OptimizerConfig) -> dict[str, Any]:
    """What was really built, read back from the optimizer object (for summary.json ``applied``)."""
    applied: dict[str, Any] = {"name": cfg.name, "class": f"{type(optimizer).__module__}.{type(optimizer).__qualname__}"}
    if isinstance(cfg, CPUOffloadOptimizerConfig):
        inner = next(iter(optimizer.optim_dict.values()), optimizer.d_opt)
        offloaded = list(optimizer.param_d2h_map)
        applied.update(
            inner=f"{type(inner).__name__} ({_kernel(inner)})" if inner is not None else None,
            offload_gradients=cfg.offload_gradients,
            offloaded={"tensors": len(offloaded), "numel": sum(p.numel() for p in offloaded)},
            on_device={"tensors": sum(len(g["params"]) for g in optimizer.d_param_groups),
                       "numel": sum(p.numel() for g in optimizer.d_param_groups for p in g["params"])},
        )
        return applied
    if isinstance(cfg, MuonOptimizerConfig):
        muon, adamw = optimizer.optimizers["muon"], optimizer.optimizers["adamw"]
        group = muon.param_groups[0]
        applied["muon"] = {**_tensors(muon), "momentum": group["momentum"], "nesterov": group["nesterov"],
                           "ns_steps": group["ns_steps"], "adjust_lr_fn": group["adjust_lr_fn"]}
        applied["adamw"] = {**_tensors(adamw), "impl": _kernel(adamw)}
        return applied
    applied.update(impl=_kernel(optimizer), **_tensors(optimizer))
    return applied


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
