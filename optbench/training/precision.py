"""The precision policy: the autocast context, the loss scaler and the TF32 flags of a run."""

from __future__ import annotations

import contextlib
import logging
from typing import Any

import torch

from optbench.config import PrecisionConfig

log = logging.getLogger(__name__)

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def compute_dtype(cfg: PrecisionConfig) -> str:
    """The dtype matmuls really run in, which names the peak MFU is measured against."""
    if cfg.autocast is not None:
        return cfg.autocast
    return "tf32" if cfg.tf32 else "float32"


def apply_tf32(cfg: PrecisionConfig, *, device: torch.device) -> bool | str:
    """Set the TF32 matmul/cuDNN flags from the policy (explicitly off when the policy says fp32).
    Returns whether TF32 is in effect, read back from torch (see ``tf32_in_effect``)."""
    enabled = cfg.tf32 and device.type == "cuda"
    torch.backends.cuda.matmul.allow_tf32 = enabled
    torch.backends.cudnn.allow_tf32 = enabled
    in_effect = tf32_in_effect(device)
    if in_effect is True:
        log.info("Applied TF32 matmuls")
    elif cfg.tf32 and device.type == "cuda":
        log.warning("precision.tf32=true but TF32 is not in effect on %s (%s)", device, in_effect)
    return in_effect


def tf32_in_effect(device: torch.device) -> bool | str:
    """Whether fp32 matmuls on ``device`` really run as TF32 now: torch's own flag
    (``torch.backends.cuda.matmul.allow_tf32``, which ``nn.Linear`` obeys) read back, and a device
    with TF32 units (CUDA, compute capability 8.0 or newer). "unknown" where torch cannot say."""
    try:
        allowed = bool(torch.backends.cuda.matmul.allow_tf32)
    except (AttributeError, RuntimeError):
        return "unknown"
    if not allowed or device.type != "cuda":
        return False  # CPUs have no TF32 units: an fp32 matmul there is fp32
    try:
        return torch.cuda.get_device_capability(device) >= (8, 0)
    except (AssertionError, RuntimeError):
        return "unknown"


def autocast_in_effect(cfg: PrecisionConfig, *, device: torch.device) -> str | None:
    """The dtype autocast really runs at inside the context each step enters (``maybe_autocast``),
    read from torch's autocast state in it; None when autocast is off there."""
    with maybe_autocast(cfg, device=device):
        if not torch.is_autocast_enabled(device.type):
            return None
        return str(torch.get_autocast_dtype(device.type)).removeprefix("torch.")


def describe_precision(cfg: PrecisionConfig, *, device: torch.device,
                       scaler: torch.amp.GradScaler | None) -> dict[str, Any]:
    """summary.json ``applied.precision``, read back from torch after the policy was applied: the
    autocast dtype in effect, TF32 in effect (``tf32_in_effect``), whether a loss scaler is enabled."""
    return {
        "name": cfg.name,
        "autocast": autocast_in_effect(cfg, device=device),
        "tf32": tf32_in_effect(device),
        "grad_scaler": scaler is not None and scaler.is_enabled(),
    }


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
