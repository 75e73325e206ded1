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
from optbench.training.ac import apply_ac
from optbench.training.compile import apply_compile
from optbench.training.data_parallel import apply_ddp, apply_fsdp, build_mp_policy
from optbench.training.kinds import model_spec

log = logging.getLogger(__name__)


def parallelize(model: nn.Module, *, cfg: Config, machine: Machine, mesh: Any = None) -> dict[str, Any]:
    """Apply the run's optimizations to every block group of ``model`` (``ModelSpec.block_groups``:
    a decoder's blocks, a fused model's encoder and fusion blocks too), in the order above. The
    estimate's fake model goes through here as well (compile off, ``parallel=fsdp2`` over its fake
    ``mesh``), so it is wrapped and sharded as the run's model is."""
    groups = model_spec(cfg).block_groups(model)
    main = next(iter(groups))

    # 0. float8 training: swap the blocks' Linears before anything wraps them
    float8 = None
    if cfg.precision.float8_recipe is not None:
        from optbench.training.float8 import apply_float8

        float8 = apply_float8(model, recipe=cfg.precision.float8_recipe, blocks=main)

    # 1. activation checkpointing (every group's blocks alike; ``every`` counts within a group)
    checkpointed = {name: apply_ac(group, mode=cfg.ac.name, every=cfg.ac.every)
                    for name, group in groups.items()}

    # 2. torch.compile, per (possibly checkpoint-wrapped) block
    compiled = {name: apply_compile(group, mode=cfg.compile.name, fullgraph=cfg.compile.fullgraph)
                for name, group in groups.items()}
    # FSDP2 shards every block of every group (an iteration container, not part of the model)
    blocks = nn.ModuleDict({f"{name}_{key}".replace(".", "_"): block for name, group in groups.items()
                            for key, block in group.named_children()})

    applied: dict[str, Any] = {
        "activation_checkpointing": {"mode": cfg.ac.name, "blocks": len(checkpointed[main])},
        "compile": {
            "mode": cfg.compile.name,
            "fullgraph": cfg.compile.fullgraph,
            "blocks": len(compiled[main]),
        },
        "parallel": {"mode": "single", "world_size": 1},
        "float8": float8,
    }
    for name in list(groups)[1:]:  # more groups (a fused model's encoder and fusion blocks): counted apart
        key = name.split(".")[0] + "_blocks"  # fusion.encoder, fusion.layers -> fusion_blocks
        for section, done in (("activation_checkpointing", checkpointed), ("compile", compiled)):
            applied[section][key] = applied[section].get(key, 0) + len(done[name])

    # 3. data parallelism (needs the process group): FSDP2 per block then the root, or DDP
    if cfg.parallel.name == "fsdp2":
        applied["parallel"] = apply_fsdp(
            model, blocks=blocks, world_size=machine.world_size, device_type=machine.device.type,
            mp_policy=build_mp_policy(cfg.precision), reshard_after_forward=cfg.parallel.reshard_after_forward,
            cpu_offload=cfg.parallel.cpu_offload, mesh=mesh,
        )
    elif cfg.parallel.name == "ddp":
        applied["parallel"] = apply_ddp(
            model, world_size=machine.world_size, device=machine.device, compiled=cfg.compile.name != "none",
        )
    return applied
