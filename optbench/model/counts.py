"""Counting any model's parameters (works on the meta device and on FSDP2-sharded models: a
DTensor's ``numel`` is its global size): every parameter, the trainable and frozen ones, and the
ones that multiply activations in a matmul (what FLOPs/token counts)."""

from __future__ import annotations

from typing import Any

from torch import nn


def count_params(model: nn.Module) -> int:
    """Every parameter, counted once (tied ones once)."""
    return sum(p.numel() for p in model.parameters())


def is_matmul(module: nn.Module) -> bool:
    """A module whose weight multiplies activations: ``nn.Linear`` and transformers' ``Conv1D``
    (GPT-2's projections: a Linear with its weight stored transposed)."""
    weight = getattr(module, "weight", None)
    return isinstance(module, nn.Linear) or (type(module).__name__ == "Conv1D" and weight is not None
                                             and weight.ndim == 2)


def count_matmul_params(model: nn.Module) -> int:
    """Parameters that multiply activations in a matmul: every Linear/Conv1D weight (the head
    included, tied to the embedding or not: its matmul runs either way); embeddings, norms and
    biases excluded."""
    return sum(m.weight.numel() for m in model.modules() if is_matmul(m))


def count_parameters(model: nn.Module) -> dict[str, Any]:
    """``total``, ``trainable``, ``frozen`` and ``matmul`` parameters, and the ``frozen_share``."""
    total = count_params(model)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return {"total": total, "trainable": trainable, "frozen": total - trainable,
            "frozen_share": (total - trainable) / total if total else 0.0, "matmul": count_matmul_params(model)}
