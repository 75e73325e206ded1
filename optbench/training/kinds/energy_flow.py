"""Kind ``energy_flow``: plan 003's energy-flow pipeline (``model=energy_tiny|energy_cpu|
energy_experiment|energy_rtx5090``, ``EnergyFlowModelConfig``; ``optbench.model.energy_flow``, trained
by ``task=energy_flow``; docs/energy-flow.md). No decoder: its one block is the flow processor
(``blocks``), a "token" is a sample (``tokens_per_sample`` 1), and it counts its own FLOPs. The
task's forms of the plan's optimizations (``task.flows``, ``task.stop``) are built into the
processor; its rules refuse, one line each, every group that cannot apply to it."""

from __future__ import annotations

from typing import Any

from torch import nn

from optbench.config import EmbeddingsDataConfig, EnergyFlowModelConfig, EnergySyntheticDataConfig
from optbench.model.energy_flow import FLOPS_SOURCE, EnergyFlowModel, FlowProcessor, flow_processor
from optbench.model.meta import on_meta
from optbench.training.kinds.spec import ModelSpec


def build(cfg: Any, task: Any) -> nn.Module:
    """The model on the meta device; the task's forms (flows, stop) come from ``cfg.task``."""
    model_cfg, task_cfg = cfg.model, cfg.task
    forms = {key: getattr(task_cfg, key) for key in ("flows", "stop", "threshold", "patience") if hasattr(task_cfg, key)}
    with on_meta():
        processor = FlowProcessor(
            width=model_cfg.lattice_width, height=model_cfg.lattice_height, depth=model_cfg.lattice_depth,
            flows_per_sample=max(1, model_cfg.flows_per_sample(cfg.train.batch_size)), cell_dim=model_cfg.cell_dim,
            energy_dim=model_cfg.energy_dim, neuron_dim=model_cfg.neuron_dim, hidden=model_cfg.carrier_hidden_size,
            layers=model_cfg.carrier_num_layers, max_steps=model_cfg.max_steps, **forms)
        return EnergyFlowModel(embed_dim=model_cfg.embed_dim, processor=processor)


def block_groups(model: nn.Module) -> dict[str, nn.Module]:
    """One group of one block: the flow processor (``blocks``)."""
    return {"blocks": model.blocks}


def flops_per_token(model: nn.Module, seq_len: int) -> int:
    """Training FLOPs per sample at the ``max_steps`` bound (``EnergyFlowModel.flops_per_token``)."""
    return getattr(model, "module", model).flops_per_token(seq_len=seq_len)


def describe(model: nn.Module, cfg: Any, task: Any) -> dict[str, Any]:
    """summary.json ``model.energy_flow``: the lattice, the flows per sample and the parameters by part
    (the plan's FlowProcessor / EnergyCarrier / readout split), and what a token is."""
    processor = flow_processor(model)
    inner = getattr(model, "module", model)
    parts = {"mapper": inner.mapper, "flow_processor": processor, "energy_carrier": processor.carrier,
             "readout": inner.readout}
    return {"flops_source": FLOPS_SOURCE, "energy_flow": {
        "lattice": [processor.width, processor.height, processor.depth],
        "flows_per_sample": processor.flows_per_sample, "max_steps": processor.max_steps,
        "params_by_part": {name: sum(p.numel() for p in part.parameters()) for name, part in parts.items()},
        "throughput_unit": "one sample is one token: tokens/s is samples/s, FLOPs/token are FLOPs/sample"}}


def estimate_counts(model: nn.Module, cfg: Any, task: Any) -> dict[str, Any]:
    return {"flops_source": FLOPS_SOURCE}


def preflight(cfg: Any) -> list[str]:
    """Every option that cannot apply to an energy-flow model, one message each naming the fix."""
    if cfg.task.name != "energy_flow":
        return [f"model={cfg.model.name} is the energy-flow pipeline's; use task=energy_flow with it, or another model"]
    reasons = []
    if not isinstance(cfg.data, (EmbeddingsDataConfig, EnergySyntheticDataConfig)):
        reasons.append(f"task=energy_flow reads teacher embeddings, not data={cfg.data.name}: use data=energy_synthetic "
                       "or data=embeddings data.path=OUT (`optbench data embed PAIRS.jsonl OUT --encoder DIR` writes one)")
    return reasons + _lattice_fits(cfg) + [message for message in _groups_that_do_not_apply(cfg) if message]


def _lattice_fits(cfg: Any) -> list[str]:
    model, batch = cfg.model, cfg.train.batch_size
    per_sample = model.flows_per_sample(batch)
    if per_sample == 0:
        return [f"model.max_active_flows={model.max_active_flows} leaves no flow for each of train.batch_size={batch} "
                f"samples; raise model.max_active_flows to at least {batch} or lower train.batch_size"]
    if per_sample > model.surface_cells:
        return [f"a {model.lattice_width}x{model.lattice_height} lattice surface has {model.surface_cells} cells but "
                f"model.max_active_flows={model.max_active_flows} over train.batch_size={batch} starts {per_sample} "
                f"flows per sample, one per cell; lower model.max_active_flows to at most "
                f"{model.surface_cells * batch} or widen model.lattice_width/lattice_height"]
    return []


def _groups_that_do_not_apply(cfg: Any) -> list[str | None]:
    loop = getattr(cfg.task, "flows", None) == "loop"
    load = getattr(cfg.data, "load", None)
    return [
        f"precision={cfg.precision.name}: float8 converts a transformer's block Linears; the energy-flow carrier's "
        "matmuls are [flows x hidden] per step, not float8-shaped: use precision=bf16" if cfg.precision.float8_recipe
        else None,
        f"attention={cfg.attention.name}: the energy-flow model has no attention; leave attention=sdpa"
        if cfg.attention.name != "sdpa" else None,
        f"loss_freq={cfg.loss_freq.name}: task=energy_flow has no auxiliary loss to thin out; use loss_freq=every_step"
        if cfg.loss_freq.name != "every_step" else None,
        f"compile={cfg.compile.name} with task.flows=loop would trace one graph of flows x steps copies of the step; "
        "compile the vectorized form (flows=vectorized) or use compile=none" if loop and cfg.compile.name != "none"
        else None,
        f"data.load=device with dataloader.num_workers={cfg.dataloader.num_workers}: every worker would hold the "
        "whole dataset; use data.load=memmap (streamed) or dataloader=baseline"
        if load == "device" and cfg.dataloader.num_workers > 0 else None,
    ]


# plan 003, "RTX 5090 Memory Usage Assessment": its totals for its two configurations
PLAN_MEMORY_CLAIMS = {"energy_experiment": "~222 MB (model 72 MB, gradients 72 MB, activations 3.2 MB, batch 16)",
                      "energy_rtx5090": "~1.28 GB (model 340 MB, gradients 340 MB, activations 100 MB, dataset "
                                        "cache 500 MB, batch 64)"}


def estimate_notes(cfg: Any) -> list[str]:
    """What ``optbench estimate`` says of an energy-flow model beside its figures."""
    model = cfg.model
    notes = [f"model={model.name}: the traced step runs the max_steps={model.max_steps} bound (adaptive stopping "
             "depends on values FakeTensors do not have; a run records the steps it used in applied.task); the "
             "closed form is the transformer's and does not model this model's activations: read the traced column",
             "inputs, buffers include the whole dataset a run keeps on the device under data.load=device "
             "(dataloader=baseline), and the text bridge's bank of target embeddings (bridge=per_sample|batched)"]
    if model.name in PLAN_MEMORY_CLAIMS:
        notes.append(f"plan 003 claims {PLAN_MEMORY_CLAIMS[model.name]} for this configuration, no optimizer "
                     "states counted")
    return notes


SPEC = ModelSpec(kind="energy_flow", config_type=EnergyFlowModelConfig, build=build, block_groups=block_groups,
                 flops_per_token=flops_per_token, describe=describe, preflight=preflight,
                 applied_attention=lambda model: "none", estimate_counts=estimate_counts,
                 estimate_notes=estimate_notes, stackable=False)
