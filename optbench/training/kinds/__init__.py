"""Model kinds: one ``ModelSpec`` per kind of model optbench trains, in one table (like torchtitan's
``register_train_spec``). Everything that depends on the kind of model — how it is built on the meta
device, its block groups (what activation checkpointing, compile and FSDP2 wrap, for training and for
the estimate's fake model alike), its parameter and FLOP counts, its weights, what ``summary.json``
says about it, its preflight rules, what the estimate needs — is read from its spec, never decided
by ``isinstance`` elsewhere (``tests/test_structure.py`` checks)::

    from optbench.training.kinds import ModelSpec, model_spec, register_model

    spec = model_spec(cfg)                 # the run's: cfg.model's kind, fused when cfg.fusion names one
    model = spec.build(cfg, task)          # on the meta device
    spec.block_groups(model)               # {"layers": ModuleDict, ...}

The kinds: ``transformer`` (optbench's own, ``ModelConfig``), ``hf`` (``HFModelConfig``), ``module``
(``ModuleModelConfig``), ``energy_flow`` (plan 003's pipeline, ``EnergyFlowModelConfig``; no decoder), and
``fused(base)`` over ``transformer`` or ``hf``. To add a kind: a typed
model config (a dataclass subclassing ``optbench.config.ModelConfig``, registered as a Hydra schema
with its presets), one module here defining ``SPEC = ModelSpec(kind=..., config_type=..., build=...,
...)`` (``spec.py`` documents every field and its default), and one line below registering it. A kind
defined elsewhere (a test's) calls ``register_model(spec)`` itself.
"""

from __future__ import annotations

from optbench.training.kinds import energy_flow, hf, module, transformer
from optbench.training.kinds.registry import (
    kind_spec,
    model_spec,
    register_model,
    registered,
    unregister_model,
)
from optbench.training.kinds.spec import ModelSpec

for _kind in (transformer, hf, module, energy_flow):
    register_model(_kind.SPEC)

__all__ = ["ModelSpec", "kind_spec", "model_spec", "register_model", "registered", "unregister_model"]
