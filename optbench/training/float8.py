"""float8 training with torchao.float8 (``precision.float8_recipe``: tensorwise or rowwise).

``apply_float8`` swaps every ``nn.Linear`` inside the transformer blocks for torchao's
``Float8Linear``: its forward matmul and both backward matmuls cast their operands to float8
(e4m3 forward, e5m2 gradients for tensorwise) with dynamic scales, one per tensor (tensorwise) or
one per row (rowwise), and accumulate in higher precision. The embedding and the output head stay
in bf16, as torchtitan does (the head's logits are the most precision-sensitive matmul). It runs on
the meta-device model, before activation checkpointing, compile and FSDP2 wrap the blocks.

Preconditions (``optbench.training.preflight`` refuses a run that breaks them, naming the fix): CUDA compute
capability >= 8.9 (float8 tensor cores: H100/H200/L4/Ada), and every dimension of a float8 matmul
divisible by 16: the model width, the MLP width, and the tokens per micro-batch (the inner dimension
of the weight-gradient matmul).

MFU: float8 tensor cores peak at twice the bf16 rate, but optbench reports float8 runs against the
dense bf16 peak (``compute_dtype`` is bfloat16), so a float8 speedup shows as MFU above what bf16
reaches; ``applied.float8.mfu_peak`` says so in every summary.
"""

from __future__ import annotations

import logging
from typing import Any

from torch import nn

from optbench.errors import ConfigError
from optbench.logs import quiet_imports

log = logging.getLogger(__name__)

ALIGN = 16
MFU_PEAK_NOTE = ("dense bf16 peak (float8 tensor cores peak at 2x bf16; MFU is against the bf16 peak, "
                 "so float8's gain shows as MFU above bf16's, not inflated by the faster peak)")


def block_linear_filter(blocks: str = "layers"):
    """A torchao module filter converting the Linears inside ``blocks`` (the dotted path of the
    decoder's block container), nothing else."""

    def keep(module: nn.Module, fqn: str) -> bool:
        return isinstance(module, nn.Linear) and fqn.startswith(blocks + ".")

    return keep


def apply_float8(model: nn.Module, *, recipe: str, blocks: str = "layers") -> dict[str, Any]:
    """Swap the Linears inside ``blocks`` for torchao ``Float8Linear`` with ``recipe``'s scaling
    (in place, on any device, the meta device included). Returns what was applied, for ``summary.json``."""
    with quiet_imports():  # torchao's first import: its failed loads of kernels built for other CUDA/Pythons
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
        from torchao.float8.float8_linear import Float8Linear

    config = Float8LinearConfig.from_recipe_name(recipe)
    convert_to_float8_training(model, module_filter_fn=block_linear_filter(blocks), config=config)
    converted = [name for name, m in model.named_modules() if isinstance(m, Float8Linear)]
    if not converted:
        raise ConfigError(f"precision.float8_recipe is set but the model has no nn.Linear inside its blocks ({blocks}) "
                          "to convert; use precision=bf16")
    log.info("Applied float8 training (torchao, %s scaling) to %d Linears", recipe, len(converted))
    return {"recipe": recipe, "converted_linears": len(converted), "kept_high_precision": ["embed", "head"],
            "mfu_peak": MFU_PEAK_NOTE}


def misaligned_dims(*, dim: int, ffn_dim: int, tokens_per_micro_batch: int | None) -> list[str]:
    """The float8 matmul dimensions not divisible by 16, each with the nearest values that are."""
    problems = []
    for key, value in (("model.dim", dim), ("model.ffn_dim", ffn_dim)):
        if value % ALIGN:
            problems.append(f"{key}={value} (use {_nearest(value)})")
    if tokens_per_micro_batch is not None and tokens_per_micro_batch % ALIGN:
        problems.append(f"train.batch_size x tokens per sample = {tokens_per_micro_batch} (make it a multiple "
                        f"of {ALIGN}, e.g. {_nearest(tokens_per_micro_batch)})")
    return problems


def _nearest(value: int) -> str:
    low = value // ALIGN * ALIGN
    return f"{low} or {low + ALIGN}" if low else str(ALIGN)
