"""Which parameters are decayed: shared by every optimizer built on AdamW."""

from __future__ import annotations

from torch import nn


def param_groups(model: nn.Module, *, weight_decay: float) -> list[dict]:
    """Weight decay on matrices (dim >= 2) only; norms, biases and other vectors are not decayed."""
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
