"""The DataLoader knobs of the ``dataloader`` group, as torch will really apply them.

``pin_memory`` page-locks batches so host-to-GPU copies can be asynchronous; without CUDA there is
no such copy, and torch's DataLoader would only warn and ignore it. optbench does not pass it there
and records it as not applied, with the reason, in ``summary.json`` (``applied.dataloader``): the
run is what it says it is, and a sweep on a CPU still runs the tuned loader's worker processes.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch.utils.data import DataLoader

from optbench.config import DataLoaderConfig

log = logging.getLogger(__name__)

PIN_MEMORY_NOT_APPLICABLE = "not applied: no CUDA device (pinned memory only speeds host-to-GPU copies)"


def loader_kwargs(cfg: DataLoaderConfig, *, device: torch.device) -> dict[str, Any]:
    """Keyword arguments for torch.utils.data.DataLoader."""
    return {
        "num_workers": cfg.num_workers,
        "pin_memory": cfg.pin_memory and device.type == "cuda",
        "persistent_workers": cfg.persistent_workers,
        "prefetch_factor": cfg.prefetch_factor,
    }


def describe_loader(loader: DataLoader, *, cfg: DataLoaderConfig) -> dict[str, Any]:
    """What the training loader really uses, for summary.json ``applied.dataloader``: read back from
    the DataLoader object built (its own attributes), not from the config; "unknown" for an attribute
    this torch's DataLoader does not have."""
    def read(name: str) -> Any:
        return getattr(loader, name, "unknown")

    applied: dict[str, Any] = {
        "name": cfg.name,
        "num_workers": read("num_workers"),
        "pin_memory": read("pin_memory"),
        "persistent_workers": read("persistent_workers"),
        "prefetch_factor": read("prefetch_factor"),
    }
    if cfg.pin_memory and applied["pin_memory"] is False:
        applied["pin_memory_note"] = PIN_MEMORY_NOT_APPLICABLE
        log.info("dataloader.pin_memory=true %s", PIN_MEMORY_NOT_APPLICABLE)
    if applied["num_workers"]:
        log.info("Applied DataLoader with %s worker processes, prefetch_factor=%s, persistent_workers=%s",
                 applied["num_workers"], applied["prefetch_factor"], applied["persistent_workers"])
    return applied
