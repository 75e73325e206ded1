"""Activation checkpointing: recompute a block's activations in the backward pass instead of
keeping them."""

from __future__ import annotations

import logging

from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper

log = logging.getLogger(__name__)


def apply_ac(layers: nn.ModuleDict, *, mode: str, every: int) -> list[str]:
    """Wrap blocks of ``layers`` in non-reentrant activation checkpointing, in place.

    ``mode=full`` wraps every block, ``mode=selective`` every ``every``-th block (0, every, 2*every,
    ...), ``mode=none`` nothing. Preconditions: ``layers`` holds plain (not yet compiled or
    data-parallel-wrapped) blocks. Returns the names of the wrapped blocks.
    """
    if mode == "none":
        return []
    wrapped = []
    for index, (name, block) in enumerate(list(layers.named_children())):
        if mode == "full" or (mode == "selective" and index % every == 0):
            layers.register_module(
                name, checkpoint_wrapper(block, checkpoint_impl=CheckpointImpl.NO_REENTRANT)
            )
            wrapped.append(name)
    log.info("Applied activation checkpointing (%s) to blocks %s", mode, ",".join(wrapped))
    return wrapped
