"""The fused model (``task=climate_text``, ``fusion=add|cross_attention|gated|prefix``): a base kind
(``transformer`` or ``hf``: its ``build`` puts the task's climate encoder and fusion layers on the
model as ``model.fusion``, ``optbench.model.fusion``) seen through ``fused(base)``, the base's spec
with what fusion changes:

- ``build``: the base's, then ``fusion.freeze_base`` freezes the decoder (stored in bf16 with
  ``fusion.base_dtype=bf16``) and ``fusion.freeze_encoder``
  the climate encoder, before anything wraps the model;
- ``block_groups``: the base's, then the climate encoder's (``fusion.encoder``) and the fusion
  layers' (``fusion.layers``) blocks;
- ``load_weights``: the base's (``model.hf.weights``), then the decoder from a ``task=lm`` checkpoint
  (``fusion.base_checkpoint``, ``optbench.checkpoint.base``) and the encoder from a ``task=climate``
  one (``fusion.encoder_checkpoint``, ``optbench.training.climate_encoder``): ``applied.fusion``;
- ``describe`` / ``estimate_counts``: the frozen share and the training FLOPs per text token autograd
  really computes (a frozen base computes no weight gradients), counted on a FakeTensor copy;
- ``stackable`` as the base: the estimate's unit is then a fusion block and the decoder layers up
  to the next one (``optbench.estimate.tracer.stacking_plan``).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import torch
from torch import nn

from optbench.model.counts import count_matmul_params, count_parameters
from optbench.model.fusion import counted_flops, freeze_base, freeze_encoder, per_token
from optbench.training.kinds.spec import ModelSpec


def fused(base: ModelSpec) -> ModelSpec:
    """``base``'s spec for a model with a climate fusion (see the module docstring)."""
    return dataclasses.replace(
        base, kind="fused", build=functools.partial(_build, base), block_groups=functools.partial(_groups, base),
        load_weights=functools.partial(_load, base), describe=functools.partial(_describe, base),
        estimate_counts=functools.partial(_estimate_counts, base), export=None)


def _build(base: ModelSpec, cfg: Any, task: Any) -> nn.Module:
    model = base.build(cfg, task)
    if cfg.fusion.freeze_base:
        freeze_base(model, dtype=torch.bfloat16 if cfg.fusion.base_dtype == "bf16" else None)
    if cfg.fusion.freeze_encoder:
        freeze_encoder(model)
    return model


def _groups(base: ModelSpec, model: nn.Module) -> dict[str, nn.Module]:
    return {**base.block_groups(model), **model.fusion.block_groups()}


def _load(base: ModelSpec, model: nn.Module, cfg: Any) -> dict[str, Any]:
    """After ``materialize``: the base's own weights, then ``fusion.base_checkpoint`` into the decoder
    and ``fusion.encoder_checkpoint`` into the climate encoder (every rank); ``applied.fusion``."""
    loaded = base.load_weights(model, cfg)
    fusion = cfg.fusion
    applied: dict[str, Any] = {
        "name": fusion.name, "every": fusion.every if fusion.name != "add" else None,
        "fusion_layers": len(model.fusion.layers), "encoder_layers": len(model.fusion.encoder),
        "context_tokens": model.fusion.num_tokens, "freeze_base": fusion.freeze_base, "base_checkpoint": None,
        "freeze_encoder": fusion.freeze_encoder, "encoder_checkpoint": None,
    }
    if fusion.base_checkpoint is not None:
        from optbench.checkpoint.base import load_base

        applied["base_checkpoint"] = load_base(model, fusion.base_checkpoint)
    if fusion.encoder_checkpoint is not None:
        from optbench.training.climate_encoder import load_encoder

        applied["encoder_checkpoint"] = load_encoder(model, fusion.encoder_checkpoint)
    return {**loaded, "fusion": applied}


def _measured_flops(base: ModelSpec, cfg: Any, task: Any) -> dict[str, float]:
    """Per text token, forward and training FLOPs autograd computes, on a FakeTensor copy of the model
    (nothing allocated, the run's model left alone)."""
    return per_token(_counted(base, cfg, task), tokens_per_sample=task.tokens_per_sample())


def _counted(base: ModelSpec, cfg: Any, task: Any) -> tuple[int, int]:
    """(forward, training) FLOPs of one sample, counted on a FakeTensor copy of ``cfg``'s model."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    copy = _build(base, cfg, task)
    # FakeTensors, not the meta device: a transformers model reads values meta tensors lack (its mask
    # code checks a tensor's values unless it is tracing, which a FakeTensor counts as); under the
    # run's autocast (a bf16 base, fusion.base_dtype, only runs in it): the same matmuls
    autocast = cfg.precision.autocast
    with FakeTensorMode(allow_non_fake_inputs=True), torch.autocast("cpu", dtype=getattr(torch, autocast or "bfloat16"),
                                                                    enabled=autocast is not None):
        copy.to_empty(device="cpu")
        return counted_flops(copy, forward=lambda m: task.forward(m, task.meta_batch(1, device="cpu")))


def _copy(cfg: Any, *, layers: int, every: int) -> Any:
    return dataclasses.replace(cfg, model=cfg.model.with_layers(layers),
                               fusion=dataclasses.replace(cfg.fusion, every=every))


def _stacked_flops(base: ModelSpec, model: nn.Module, cfg: Any, task: Any) -> dict[str, float] | None:
    """``_measured_flops`` from short copies, or None where they would not tell it exactly.

    FLOPs are a sum over the step's ops, and the decoder's layers are alike (same modules and
    shapes, ``block_period`` 1), as are the fusion blocks after the first (whose input, the frozen
    embedding's output, needs no gradient); so with ``d`` one more decoder layer and ``f`` one more
    fusion block, counted on copies of 1 layer (fusion before it), 2 layers (one fusion block) and
    2 layers (two), the ``L``-layer model with ``n`` fusion blocks has ``one + (L-1) d + (n-1) f``.
    ``model`` (``cfg``'s, built) shows whether its blocks are alike; fusion=add|prefix has no
    fusion blocks."""
    from optbench.tasks import build_task

    layers = cfg.model.layers
    decoder, blocks = base.main_blocks(model)[1], list(model.fusion.layers.children())
    if layers < 3 or cfg.model.block_period() != 1 or not (_alike(decoder.children()) and _alike(blocks[1:])):
        return None
    shapes = [(1, 1), (2, 2)] + ([(2, 1)] if blocks else [])
    one, two, *fused_two = [_counted(base, copy, build_task(copy))
                            for copy in (_copy(cfg, layers=n, every=e) for n, e in shapes)]
    totals = []
    for i in range(2):  # forward, training
        layer = two[i] - one[i]
        block = fused_two[0][i] - two[i] if blocks else 0
        totals.append(one[i] + (layers - 1) * layer + max(len(blocks) - 1, 0) * block)
    return per_token((totals[0], totals[1]), tokens_per_sample=task.tokens_per_sample())


def _alike(modules: Any) -> bool:
    """Whether the modules are copies of one another: the same submodules, parameters and buffers
    (names, classes, shapes, dtypes, which require gradients)."""
    def signature(module: nn.Module) -> tuple:
        return (tuple((name, type(m).__name__) for name, m in module.named_modules()),
                tuple((name, tuple(p.shape), p.dtype, p.requires_grad) for name, p in module.named_parameters()),
                tuple((name, tuple(b.shape), b.dtype) for name, b in module.named_buffers()))

    return len({signature(m) for m in modules}) <= 1


def _describe(base: ModelSpec, model: nn.Module, cfg: Any, task: Any) -> dict[str, Any]:
    """``summary.model`` of a fused model: the base's, the frozen share and the FLOPs per text token
    really computed (training and forward)."""
    flops = _measured_flops(base, cfg, task)
    return {**base.describe(model, cfg, task), "frozen_share": count_parameters(model)["frozen_share"],
            "flops_per_token": round(flops["training"]), "forward_flops_per_token": round(flops["forward"]),
            "flops_source": "torch FlopCounterMode over one training step (matmuls and attention)"}


def _estimate_counts(base: ModelSpec, model: nn.Module, cfg: Any, task: Any) -> dict[str, Any]:
    """The estimate's counts: a frozen base has no gradients and no optimizer states; the matrices
    the optimizer updates are the decoder's (unless frozen) and every fusion block's."""
    block = next(iter(base.main_blocks(model)[1].children()))
    decoder = 0 if cfg.fusion.freeze_base else count_matmul_params(block) * cfg.model.layers
    fusion_blocks = sum(count_matmul_params(g) for g in model.fusion.block_groups().values())
    return {"trainable_params": count_parameters(model)["trainable"], "trainable_matrices": decoder + fusion_blocks,
            "flops_per_token": int(round((_stacked_flops(base, model, cfg, task) or _measured_flops(base, cfg, task))["training"])),
            "flops_source": "FlopCounterMode over one training step"}
