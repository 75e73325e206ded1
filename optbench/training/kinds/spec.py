"""``ModelSpec``: everything optbench needs to know about one kind of model, in one value.

Each field is a plain function (or a value); the defaults are those of a causal decoder seen through
``optbench.model.decoder``'s block interface (``model.decoder_parts``), so a decoder kind states only
how it is built. A kind that is no decoder (no token embedding, blocks of its own) gives its own
``block_groups`` and ``flops_per_token``. ``cfg`` is the typed ``optbench.config.Config``, ``task``
the run's ``optbench.tasks.Task``; ``model`` is what ``build`` returned (possibly wrapped since).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn

from optbench.model.counts import count_parameters
from optbench.model.decoder import decoder_parts, flops_per_token, layers_of
from optbench.training.attention import describe_attention
from optbench.training.kinds.decode import Step, recompute_step


def decoder_block_groups(model: nn.Module) -> dict[str, nn.Module]:
    """The decoder's block container, by its dotted path (``layers``, ``model.layers``, ``transformer.h``)."""
    return {decoder_parts(model).layers: layers_of(model)}


def decoder_flops_per_token(model: nn.Module, seq_len: int) -> int:
    """6 N_matmul + 12 L w T (``optbench.model.decoder.flops_per_token``)."""
    return flops_per_token(model, seq_len=seq_len)


def no_weights(model: nn.Module, cfg: Any) -> dict[str, Any]:
    return {}


def nothing_more(model: nn.Module, cfg: Any, task: Any) -> dict[str, Any]:
    return {}


def no_reasons(cfg: Any) -> list[str]:
    return []


@dataclass(frozen=True)
class ModelSpec:
    """One model kind (see ``optbench.training.kinds`` for the registry and how to add one).

    - ``kind``: its name (``transformer``, ``hf``, ``module``, ``fused``, ...).
    - ``config_type``: the typed model config class (``cfg.model``'s exact class) that selects it.
    - ``build(cfg, task) -> nn.Module``: the model on the meta device, nothing allocated; it must have
      ``init_weights()`` (every parameter and buffer, in place, from the global torch RNG), which
      ``optbench.training.build.materialize`` calls after ``to_empty``.
    - ``block_groups(model) -> {dotted path: container}``: the containers (``ModuleDict``/``ModuleList``)
      of the blocks activation checkpointing, compile and FSDP2 wrap one by one, in the order FSDP2
      shards them (then the root). The first group is the model's main stack: float8 converts its
      Linears, ``summary.json`` ``applied.*.blocks`` counts it, the estimate's per-block records and
      the closed form read it. ``optbench.training.parallelize`` applies every group for training and
      for the estimate's fake model alike.
    - ``count_parameters(model) -> {"total", "trainable", "frozen", "frozen_share", "matmul"}``.
    - ``flops_per_token(model, seq_len) -> int``: training FLOPs per token (the MFU's numerator).
    - ``load_weights(model, cfg) -> dict``: after ``materialize``, read the weights the config names
      into the (possibly sharded) model; returns ``summary.json`` ``applied`` entries (``{}``: none).
    - ``describe(model, cfg, task) -> dict``: fields of ``summary.json`` ``model`` this kind adds or
      overrides (``hf``: what transformers built; a fused model's measured FLOPs).
    - ``preflight(cfg) -> list[str]``: why this kind cannot run the config (one message per reason,
      naming the fix); run with every other preflight rule, before anything heavy is built.
    - ``applied_attention(model) -> str``: ``summary.json`` ``applied.attention``.
    - ``estimate_counts(model, cfg, task) -> dict``: fields of ``optbench.estimate.command.Counts``
      this kind overrides (a fused model's trainable parameters and matrices, measured FLOPs).
    - ``export(model, cfg) -> nn.Module``: the trained model as a transformers ``PreTrainedModel`` that
      ``optbench export`` writes with ``save_pretrained`` (None: the kind has no such counterpart).
    - ``estimate_notes(cfg) -> list[str]``: what ``optbench estimate`` says of this kind beside its figures
      (what the trace cannot follow, a plan's own numbers to compare with).
    - ``decode_step(model, context) -> step``: ``optbench generate``'s decoding step (new token ids
      ``(B, n)`` -> their logits, earlier positions cached; ``optbench.training.kinds.decode``;
      default: the whole sequence again per token).
    - ``stackable``: whether the estimate may trace two short copies and stack them block by block
      (the main group's blocks alike, nothing between them, ``cfg.model.with_layers`` sets its depth).
    """

    kind: str
    config_type: type
    build: Callable[[Any, Any], nn.Module]
    block_groups: Callable[[nn.Module], dict[str, nn.Module]] = decoder_block_groups
    count_parameters: Callable[[nn.Module], dict[str, Any]] = count_parameters
    flops_per_token: Callable[[nn.Module, int], int] = decoder_flops_per_token
    load_weights: Callable[[nn.Module, Any], dict[str, Any]] = no_weights
    describe: Callable[[nn.Module, Any, Any], dict[str, Any]] = nothing_more
    preflight: Callable[[Any], list[str]] = no_reasons
    applied_attention: Callable[[nn.Module], str] = describe_attention
    estimate_counts: Callable[[nn.Module, Any, Any], dict[str, Any]] = nothing_more
    estimate_notes: Callable[[Any], list[str]] = no_reasons
    stackable: bool = True
    export: Callable[[nn.Module, Any], nn.Module] | None = None
    decode_step: Callable[[nn.Module, Any], Step] = recompute_step

    def main_blocks(self, model: nn.Module) -> tuple[str, nn.Module]:
        """The first block group: (its dotted path, its container)."""
        return next(iter(self.block_groups(model).items()))
