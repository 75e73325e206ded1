"""The attention kernels a model can be built with: ``sdpa``, ``math`` and ``flex``.

``flex`` is FlexAttention (torch.nn.attention.flex_attention) with a block mask: causal for tasks
that predict the next token, none (full attention) for tasks with ``causal=False``. FlexAttention
is only fast when compiled (eager it materializes the full score matrix), so the kernel is always
``torch.compile``-d, whatever ``compile=`` says about the blocks; under a compiled block Dynamo
inlines it.

On this torch (2.13) FlexAttention has no backward on CPU: its forward runs on CPU without grad,
but any input that requires grad raises "FlexAttention does not support backward on CPU" (see
pytorch/pytorch#169646). Training with it needs CUDA; ``optbench.training.preflight`` refuses it on CPU.
"""

from __future__ import annotations

import logging

import torch

from optbench.model.transformer import AttentionFn, math_attention, sdpa_attention

log = logging.getLogger(__name__)


def _causal(batch: torch.Tensor, head: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
    return q_idx >= kv_idx


class FlexAttention:
    """An AttentionFn calling compiled ``flex_attention`` with a block mask built once per
    (sequence length, device) and reused by every block and step."""

    def __init__(self) -> None:
        from torch.nn.attention.flex_attention import flex_attention

        self._flex = torch.compile(flex_attention)
        self._masks: dict[tuple[int, int, str], object] = {}

    def block_mask(self, q_len: int, kv_len: int, device: torch.device):
        from torch.nn.attention.flex_attention import create_block_mask

        key = (q_len, kv_len, str(device))
        if key not in self._masks:
            self._masks[key] = create_block_mask(_causal, None, None, q_len, kv_len, device=device)
        return self._masks[key]

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
        mask = self.block_mask(q.shape[-2], k.shape[-2], q.device) if causal else None
        return self._flex(q, k, v, block_mask=mask)


def build_attention(kernel: str) -> AttentionFn:
    """The attention function for ``attention`` group (``attention.name``): sdpa, math or flex."""
    if kernel == "sdpa":
        return sdpa_attention
    if kernel == "math":
        return math_attention
    if kernel == "flex":
        log.info("Applied FlexAttention (compiled flex_attention, block mask from the task's causality)")
        return FlexAttention()
    raise AssertionError(f"unknown attention kernel {kernel}")  # the schema refuses it first


def kernel_name(fn: object) -> str:
    """The ``attention`` name of an attention callable, or "unknown" for one optbench did not build."""
    if fn is sdpa_attention:
        return "sdpa"
    if fn is math_attention:
        return "math"
    if isinstance(fn, FlexAttention):
        return "flex"
    return "unknown"


def describe_attention(model: torch.nn.Module) -> str:
    """summary.json ``applied.attention``: the kernel the model's attention modules really hold
    (read from each ``Attention.attention``, through any checkpoint/compile/FSDP wrapping); "unknown"
    when the model has none or a callable optbench does not know, "mixed: a,b" when blocks differ.
    A model kind whose attention is chosen elsewhere says so itself (``ModelSpec.applied_attention``)."""
    from optbench.model.transformer import Attention

    kernels = sorted({kernel_name(m.attention) for m in model.modules() if isinstance(m, Attention)})
    if not kernels:
        return "unknown"
    return kernels[0] if len(kernels) == 1 else "mixed: " + ",".join(kernels)
