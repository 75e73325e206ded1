"""What a training run and ``optbench estimate`` do with a fused model (``task=climate_text``):
load its base decoder from a checkpoint, and say what it is (trainable/frozen parameters, the
FLOPs autograd really computes). Kept apart from ``optbench.model.fusion`` (the layers), which
``optbench.training.build`` imports: this module needs the builder and the checkpoint loader, two
layers above the model."""

from __future__ import annotations

from typing import Any

from torch import nn

from optbench.model.fusion import count_parameters, measured_flops_per_token


def apply_base_checkpoint(model: nn.Module, *, cfg: Any, task: Any) -> dict[str, Any]:
    """After ``materialize``: load ``fusion.base_checkpoint`` into the decoder and
    ``fusion.encoder_checkpoint`` into the climate encoder (every rank); returns
    ``applied.fusion`` for summary.json."""
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
    return applied


def describe_fused_model(model: nn.Module, *, cfg: Any, task: Any) -> dict[str, Any]:
    """``summary.model`` of a fused model, beside the counts every run records: the frozen share and
    the training FLOPs per text token autograd really computes (counted on a copy of the model made of
    FakeTensors: nothing is allocated, the run's model is left alone), and the forward's."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from optbench.training.build import build_model

    counts = count_parameters(model)
    copy = build_model(cfg, task)
    # FakeTensors, not the meta device: a transformers model reads values meta tensors lack (its mask
    # code checks a tensor's values unless it is tracing, which a FakeTensor counts as)
    with FakeTensorMode(allow_non_fake_inputs=True):
        copy.to_empty(device="cpu")
        flops = measured_flops_per_token(copy, forward=lambda m: task.forward(m, task.meta_batch(1, device="cpu")),
                                         tokens_per_sample=task.tokens_per_sample())
    return {"frozen_share": counts["frozen_share"], "flops_per_token": round(flops["training"]),
            "forward_flops_per_token": round(flops["forward"]),
            "flops_source": "torch FlopCounterMode over one training step (matmuls and attention)"}
