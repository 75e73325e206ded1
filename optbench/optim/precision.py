"""The precision policy: the autocast context, the loss scaler and the TF32 flags of a run."""

from __future__ import annotations

import contextlib
import logging

import torch

from optbench.config import PrecisionConfig

log = logging.getLogger(__name__)

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def compute_dtype(cfg: PrecisionConfig) -> str:
    """The dtype matmuls really run in, which names the peak MFU is measured against."""
    if cfg.autocast is not None:
        return cfg.autocast
    return "tf32" if cfg.tf32 else "float32"


def apply_tf32(cfg: PrecisionConfig, *, device: torch.device) -> bool:
    """Set the TF32 matmul/cuDNN flags from the policy (explicitly off when the policy says fp32).
    Returns whether TF32 is in effect (only CUDA has TF32 units)."""
    enabled = cfg.tf32 and device.type == "cuda"
    torch.backends.cuda.matmul.allow_tf32 = enabled
    torch.backends.cudnn.allow_tf32 = enabled
    if enabled:
        log.info("Applied TF32 matmuls")
    return enabled


def maybe_autocast(cfg: PrecisionConfig, *, device: torch.device) -> contextlib.AbstractContextManager:
    """autocast to the policy's dtype, or a no-op context for fp32/tf32."""
    if cfg.autocast is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=DTYPES[cfg.autocast])


def build_grad_scaler(cfg: PrecisionConfig, *, device: torch.device) -> torch.amp.GradScaler | None:
    """A dynamic loss scaler for fp16, else None."""
    if not cfg.grad_scaler:
        return None
    return torch.amp.GradScaler(device.type)
