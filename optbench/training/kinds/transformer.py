"""Kind ``transformer``: optbench's own decoder (``optbench.model.transformer``), every ``model=``
preset that is not ``hf`` or ``module`` (the typed config is ``ModelConfig`` itself). The task brings
the input embedding and the output head; a ``fusion`` is built into it (registered after the
decoder, so its names and initial weights are the plain model's)."""

from __future__ import annotations

from typing import Any

from torch import nn

from optbench.config import ModelConfig
from optbench.model.export import as_arcee
from optbench.model.meta import on_meta
from optbench.model.transformer import Transformer
from optbench.training.attention import build_attention
from optbench.training.kinds.decode import own_step
from optbench.training.kinds.spec import ModelSpec


def build(cfg: Any, task: Any) -> nn.Module:
    attention = build_attention(cfg.attention.name)
    with on_meta():
        return Transformer(
            cfg.model,
            embed=task.build_embed(),
            head=task.build_head(),
            causal=task.causal,
            max_seq_len=task.tokens_per_sample(),
            attention=attention,
            fusion=task.build_fusion(attention=attention) if cfg.fusion.name != "none" else None,
        )


SPEC = ModelSpec(kind="transformer", config_type=ModelConfig, build=build, export=as_arcee, decode_step=own_step)
