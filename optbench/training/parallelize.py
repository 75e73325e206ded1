"""The ONE place that knows the order in which optimizations are applied to a model.

Order (as in torchtitan's parallelize_llama), each step per transformer block:
  0. float8 Linears           - a module swap (torchao), so every wrapper below wraps the float8 block;
  1. activation checkpointing  - wraps a block, so it must see the plain block;
  2. torch.compile             - compiles the (possibly checkpoint-wrapped) block;
  3. data parallelism          - FSDP2 shards / DDP wraps the compiled blocks, then the root.
Runs on the meta-device model, before ``to_empty`` and ``init_weights``. Returns what was applied,
which ``summary.json`` records verbatim (whether Inductor captured CUDA graphs is known only after
steps ran: ``applied.compile.cudagraphs`` is read back after the loop, ``CompileTimer.describe``).
"""

from __future__ import annotations

import logging
from typing import Any

from torch import nn

from optbench.config import Config
from optbench.distributed import Machine
from optbench.model.decoder import decoder_parts, layers_of
from optbench.training.ac import apply_ac
from optbench.training.compile import apply_compile
from optbench.training.data_parallel import apply_ddp, apply_fsdp, build_mp_policy

log = logging.getLogger(__name__)


def block_groups(model: nn.Module) -> dict[str, nn.Module]:
    """The model's blocks, by group: the decoder's (``optbench.model.decoder``: optbench's
    ``model.layers``, a transformers model's ``model.layers``/``transformer.h``/...) and, in a fused
    model (``optbench.model.fusion``), the climate encoder's and the fusion layers' blocks."""
    fusion = model.fusion if isinstance(getattr(model, "fusion", None), nn.Module) else None
    return {"layers": layers_of(model), **(fusion.block_groups() if fusion is not None else {})}


def parallelize(model: nn.Module, *, cfg: Config, machine: Machine) -> dict[str, Any]:
    groups = block_groups(model)

    # 0. float8 training: swap the blocks' Linears before anything wraps them
    float8 = None
    if cfg.precision.float8_recipe is not None:
        from optbench.training.float8 import apply_float8

        float8 = apply_float8(model, recipe=cfg.precision.float8_recipe, blocks=decoder_parts(model).layers)

    # 1. activation checkpointing (every group's blocks alike; ``every`` counts within a group)
    checkpointed = {name: apply_ac(group, mode=cfg.checkpointing.mode, every=cfg.checkpointing.every)
                    for name, group in groups.items()}

    # 2. torch.compile, per (possibly checkpoint-wrapped) block
    compiled = {name: apply_compile(group, mode=cfg.compile.mode, fullgraph=cfg.compile.fullgraph)
                for name, group in groups.items()}
    # FSDP2 shards every block of every group (an iteration container, not part of the model)
    blocks = nn.ModuleDict({f"{name}_{key}".replace(".", "_"): block for name, group in groups.items()
                            for key, block in group.named_children()})

    applied: dict[str, Any] = {
        "activation_checkpointing": {"mode": cfg.checkpointing.mode, "blocks": len(checkpointed["layers"])},
        "compile": {
            "mode": cfg.compile.mode,
            "fullgraph": cfg.compile.fullgraph,
            "blocks": len(compiled["layers"]),
        },
        "parallel": {"mode": "single", "world_size": 1},
        "float8": float8,
    }
    if len(groups) > 1:  # a fused model: its encoder and fusion blocks went through the same steps
        fusion_groups = [name for name in groups if name != "layers"]
        applied["activation_checkpointing"]["fusion_blocks"] = sum(len(checkpointed[g]) for g in fusion_groups)
        applied["compile"]["fusion_blocks"] = sum(len(compiled[g]) for g in fusion_groups)

    # 3. data parallelism (needs the process group): FSDP2 per block then the root, or DDP
    if cfg.parallel.mode == "fsdp2":
        applied["parallel"] = apply_fsdp(
            model, blocks=blocks, world_size=machine.world_size, device_type=machine.device.type,
            mp_policy=build_mp_policy(cfg.precision), reshard_after_forward=cfg.parallel.reshard_after_forward,
            cpu_offload=cfg.parallel.cpu_offload,
        )
    elif cfg.parallel.mode == "ddp":
        applied["parallel"] = apply_ddp(
            model, world_size=machine.world_size, device=machine.device, compiled=cfg.compile.mode != "off",
        )
    return applied
