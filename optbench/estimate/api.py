"""The estimate's API: exact parameters, FLOPs/token and per-device peak memory of a training config,
before anyone rents a GPU (``optbench estimate`` prints ``estimate(cfg)``; ``optbench.estimate.format``
writes it as text, markdown or JSON).

* Parameters are counted on the model ``optbench train`` builds, on the meta device (nothing is
  allocated); FLOPs/token is the model kind's (``optbench.training.kinds``; a decoder's 6 N_matmul + 12 L d T).
* Peak memory per device is traced: one real training step of the configured model under
  FakeTensorMode inside torch's MemTracker (``optbench.estimate.memtrace``), by component. Beside it, the
  closed form a plan would write (bytes per parameter + activations per layer, Korthikanti et al.
  2022, derived for optbench's block) and how far apart the two are.
* A verdict against the device (``estimate.gpu``/``estimate.device_gb``), the largest micro-batch
  that fits (a convex search over traced micro-batches: the peak is convex in the micro-batch), and tokens/s per GPU at
  ``estimate.mfu`` of the GPU's dense peak for the precision's dtype.

Used by ``optbench estimate``/``plan``, the run's own estimate (``train_hook``), the OOM guard,
``optbench validate``'s projection and the benches.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from typing import Any

import torch

from optbench.config import Config
from optbench.errors import ConfigError
from optbench.estimate.cuda_libs import GPU_CAPABILITY, step_workspace_bytes
from optbench.estimate.fit import largest_micro_batch
from optbench.estimate.gpus import with_fits
from optbench.estimate.memtrace import COMPONENTS, DDP_GRADIENT_AS_BUCKET_VIEW, check_traceable
from optbench.estimate.predict import predict_here, predict_on_gpu
from optbench.estimate.tracer import step_tracer
from optbench.measure import GPU_PEAKS
from optbench.model.counts import count_matmul_params, count_params
from optbench.tasks import build_task
from optbench.training.build import build_model
from optbench.training.kinds import model_spec
from optbench.training.precision import compute_dtype
from optbench.training.preflight import gpu_cluster_reasons

log = logging.getLogger(__name__)

GIB = 2**30

# estimate.gpu -> (GPU_PEAKS key, memory in GiB as marketed: "80GB" H100/A100, "141GB" H200)
GPUS = {"h100": ("H100 SXM", 80.0), "a100": ("A100", 80.0), "h200": ("H200", 141.0)}


def gpu_workspaces(cfg: Config) -> int:
    """What cuBLAS holds through a step on ``estimate.gpu`` (Hopper's when the card is not named)."""
    return step_workspace_bytes(GPU_CAPABILITY.get(cfg.estimate.gpu, 9))


def device_workspaces(device_type: str) -> int:
    """What cuBLAS holds through a step on this machine's GPU (0 on a CPU)."""
    if device_type != "cuda" or not torch.cuda.is_available():
        return 0
    return step_workspace_bytes(torch.cuda.get_device_capability()[0])


# ------------------------------------------------------------------------------------- counting
@dataclass(frozen=True)
class Counts:
    params: int
    matmul_params: int
    flops_per_token: int
    block_params: int  # one transformer block
    block_matmul_params: int
    seq_len: int
    head_saved_fp32: int = 0  # bytes per token the task's head and loss keep for backward (fp32)
    head_saved_low: int = 0  # the same under autocast
    trainable_params: int | None = None  # None: every parameter (no frozen base)
    trainable_matrices: int | None = None  # matrices the optimizer updates (None: the decoder's blocks')
    flops_source: str = "6 N_matmul + 12 L d T"

    @property
    def trainable(self) -> int:
        return self.params if self.trainable_params is None else self.trainable_params


def count_model(cfg: Config) -> Counts:
    """Exact counts of the model ``optbench train`` would build, on the meta device (its kind's
    counts, ``optbench.training.kinds``; a fused model's trainable parameters and measured FLOPs)."""
    task = build_task(cfg)
    spec = model_spec(cfg)
    model = spec.build(cfg, task)
    block = next(iter(spec.main_blocks(model)[1].children()))
    seq_len = task.tokens_per_sample()
    counts = spec.count_parameters(model)
    return Counts(**{
        "params": counts["total"], "matmul_params": counts["matmul"],
        "flops_per_token": spec.flops_per_token(model, seq_len),
        "block_params": count_params(block), "block_matmul_params": count_matmul_params(block), "seq_len": seq_len,
        "head_saved_fp32": task.head_saved_bytes(1, low_precision=False),
        "head_saved_low": task.head_saved_bytes(1, low_precision=True), **spec.estimate_counts(model, cfg, task),
    })


def resolve_world_size(cfg: Config) -> int:
    """``estimate.world_size``, or the run's own: ``parallel.nproc_per_node`` (1 for single)."""
    single = cfg.parallel.name == "single"
    if cfg.estimate.world_size is None:
        world = 1 if single else cfg.parallel.nproc_per_node
    elif single and cfg.estimate.world_size > 1:
        raise ConfigError(
            f"estimate.world_size={cfg.estimate.world_size} with parallel=single: one process uses one "
            "device; add parallel=ddp or parallel=fsdp2"
        )
    else:
        world = cfg.estimate.world_size
    check_world_size(cfg, world_size=world, parallel=cfg.parallel.name)
    return world


def check_world_size(cfg: Config, *, world_size: int, parallel: str) -> None:
    """FSDP2 shards every parameter along its first dimension: past the largest one's rows some
    ranks would hold nothing of any parameter (and a fake mesh of that many ranks is built in
    memory, which for 10^9 ranks never finishes). Refuse such a world size, naming the bound."""
    if parallel != "fsdp2" or world_size <= 1:
        return
    model = build_model(cfg, build_task(cfg))
    rows = max(p.shape[0] for p in model.parameters() if p.ndim)
    if world_size > rows:
        raise ConfigError(
            f"estimate.world_size={world_size} cannot shard model={cfg.model.name} with FSDP2: its largest "
            f"parameter has {rows:,} rows, so ranks past {rows:,} would hold no part of any parameter; "
            f"use at most {rows:,} ranks")


# ---------------------------------------------------------------------------------- closed form
def optimizer_state_bytes(cfg: Config, *, counts: Counts, shard: int) -> int:
    """Bytes of optimizer state per device (the optimizer config knows its states per parameter)."""
    matrices = counts.block_matmul_params * cfg.model.layers if counts.trainable_matrices is None \
        else counts.trainable_matrices
    return cfg.optimizer.state_bytes(params=math.ceil(counts.trainable / shard), matrices=math.ceil(matrices / shard))


def activation_bytes(
    cfg: Config, *, counts: Counts, micro_batch: int, fsdp_mixed: bool, target: str = "cuda"
) -> int:
    """Saved activations of one micro-batch at the end of the forward pass, tensor by tensor for
    optbench's block (Korthikanti et al. 2022, "Reducing Activation Recomputation", style).

    c: bytes of autocast's low-precision dtype (4 without autocast); r: the residual stream (fp32,
    or the gathered dtype under FSDP2's MixedPrecisionPolicy). Per block: each RMSNorm keeps its
    input (r) and rstd (CUDA's fused kernel; on a CPU the decomposed norm keeps an fp32 copy of the
    input and the fp32 normalized tensor instead: 8 bytes per element); the linears keep their inputs (an fp32 norm output is cast once per consuming
    linear under autocast: 3 casts for q, k, v, 1 for the MLP); attention keeps q, k, v and its output
    (c, the output is also wo's input) and flash attention's logsumexp (fp32 per head and token); the
    MLP keeps its two ffn-wide tensors (c). A checkpointed block keeps only its input, and one block is
    recomputed at a time in the backward pass. Autocast also keeps a low-precision copy of every
    fp32 weight (2 B/matmul param) until the backward pass; the lm loss keeps the logits (the head's
    output, its fp32 copy, the log-softmax); other tasks' heads are not modeled.
    """
    m = cfg.model
    b, s, h, f, L = micro_batch, counts.seq_len, m.dim, m.ffn_dim, m.layers
    low = cfg.precision.autocast is not None
    c = 2 if low else 4
    r = 2 if low and fsdp_mixed else 4
    casts = low and not fsdp_mixed
    bsh, bsf, bs = b * s * h, b * s * f, b * s
    linear_inputs = 4 * c * bsh if casts else 2 * r * bsh
    attention = 4 * c * bsh + 4 * b * m.heads * s
    if cfg.attention.name == "math":  # scores, fp32 softmax, its cast back: (batch, heads, s, s)
        attention += b * m.heads * s * s * (c + 4 + c)
    norm = r if target == "cuda" else 8
    per_block = 2 * (norm * bsh + 4 * bs) + linear_inputs + attention + 2 * c * bsf
    mode, every = cfg.ac.name, cfg.ac.every
    wrapped = L if mode == "full" else math.ceil(L / every) if mode == "selective" else 0
    blocks = wrapped * r * bsh + (L - wrapped) * per_block + (per_block if wrapped else 0)
    weights = 2 * counts.matmul_params if casts else 0
    final = norm * bsh + (c * bsh if casts else 0)
    head = counts.head_saved_low if low else counts.head_saved_fp32
    return blocks + weights + final + bs * head


def closed_form(
    cfg: Config, *, counts: Counts, world_size: int, micro_batch: int, target: str = "cuda", workspaces: int = 0
) -> dict[str, Any]:
    """Per-device bytes a plan would write down: 4 B/param fp32 weights + 4 B/param fp32 gradients
    + optimizer states (/world size under FSDP2; DDP adds its gradient buckets) + activations
    (+ ``workspaces``, what cuBLAS holds on the device).
    FSDP's gathered blocks and every temporary are left out: that is what the trace adds."""
    fsdp = cfg.parallel.name == "fsdp2"
    shard = world_size if fsdp else 1
    local = math.ceil(counts.params / shard)
    local_trainable = math.ceil(counts.trainable / shard)  # a frozen base has no gradients
    host_states, host_grads = cfg.optimizer.offloads()
    states = optimizer_state_bytes(cfg, counts=counts, shard=shard)
    fsdp_offload = fsdp and cfg.parallel.cpu_offload  # parameters, gradients, states all on the host
    components = dict.fromkeys(COMPONENTS, 0)
    components["parameters"] = 0 if fsdp_offload else 4 * local
    components["gradients"] = 0 if host_grads or fsdp_offload else 4 * local_trainable
    components["optimizer_states"] = 0 if host_states or fsdp_offload else states
    components["activations"] = activation_bytes(
        cfg, counts=counts, micro_batch=micro_batch, fsdp_mixed=fsdp and cfg.precision.autocast is not None,
        target=target,
    )
    if cfg.parallel.name == "ddp" and not DDP_GRADIENT_AS_BUCKET_VIEW:
        components["ddp_buckets"] = 4 * counts.trainable
    components["cuda_workspaces"] = workspaces
    known = all(v is not None for v in components.values())
    host = 0
    if (host_states or fsdp_offload) and states is not None:
        host = 4 * local + 4 * local_trainable + states
    return {"components": components, "total": sum(components.values()) if known else None, "host_bytes": host}


# ------------------------------------------------------------------------------------ the device
def device_budget(cfg: Config) -> dict[str, Any] | None:
    """The device's memory and how much of it a step may use; None for gpu=none without device_gb."""
    est = cfg.estimate
    if est.gpu == "none" and est.device_gb is None:
        return None
    name, gib = GPUS[est.gpu] if est.gpu != "none" else ("custom device", 0.0)
    gib = est.device_gb if est.device_gb is not None else gib
    capacity = int(gib * GIB)
    return {"name": name, "capacity_bytes": capacity, "usable_bytes": int(capacity * (1 - est.headroom)),
            "headroom": est.headroom}


def fit_verdict(peak: int, device: dict[str, Any]) -> str:
    if peak <= device["usable_bytes"]:
        return "fits"
    if peak <= device["capacity_bytes"]:
        return "tight: fits only inside the headroom"
    return "does not fit"


def throughput(cfg: Config, *, counts: Counts, world_size: int) -> dict[str, Any] | None:
    """Tokens/s per GPU at ``estimate.mfu`` of the GPU's dense peak for the dtype matmuls run in.
    MFU counts model FLOPs: recomputation by activation checkpointing is not credited."""
    if cfg.estimate.gpu == "none":
        return None
    key = GPUS[cfg.estimate.gpu][0]
    dtype = compute_dtype(cfg.precision)
    peak = GPU_PEAKS[key][dtype]
    per_gpu = cfg.estimate.mfu * peak / counts.flops_per_token
    tokens_per_step = cfg.train.batch_size * cfg.train.grad_accum * counts.seq_len * world_size
    return {
        "mfu": cfg.estimate.mfu, "peak_flops": peak, "peak_source": f"datasheet {key} dense {dtype}",
        "tokens_per_s_per_gpu": per_gpu, "tokens_per_s_job": per_gpu * world_size,
        "step_time_s": tokens_per_step / (per_gpu * world_size),
    }


# ---------------------------------------------------------------------------------- the estimate
def estimate(cfg: Config) -> dict[str, Any]:
    """Everything ``optbench estimate`` prints, as a JSON-able dict."""
    started = time.perf_counter()
    world_size = resolve_world_size(cfg)
    check_traceable(cfg)
    counts = count_model(cfg)
    micro_batch = cfg.train.batch_size
    device = device_budget(cfg)
    search = None
    workspaces = gpu_workspaces(cfg)
    with step_tracer(cfg, world_size=world_size, target="cuda", stacked=cfg.estimate.stacked,
                     workspaces=workspaces) as tracer:
        methods: list[str] = []

        def traced(batch: int) -> Any:  # every trace's method: the search may change the way midway
            step = tracer(batch)
            methods.append(step.method)
            return step

        projecting = cfg.estimate.predict and cfg.estimate.gpu != "none"
        trace = tracer(micro_batch, ops=projecting)
        methods.append(trace.method)
        speed = predict_on_gpu(cfg, trace=tracer, first=trace, counts=counts, world_size=world_size,
                               gpu=GPUS[cfg.estimate.gpu][0]) if projecting else None
        if device is not None and cfg.estimate.search:
            search = largest_micro_batch(traced, first=trace, budget=device["usable_bytes"])
    if cfg.estimate.predict and cfg.estimate.gpu == "none":
        speed = predict_here(cfg, counts=counts, world_size=world_size)
    others = sorted(set(methods) - {trace.method})
    method = trace.method + (f"; the search's other traces: {'; '.join(others)}" if others else "")
    peak = trace.steady_peak()
    closed = closed_form(cfg, counts=counts, world_size=world_size, micro_batch=micro_batch, workspaces=workspaces)
    shard = world_size if cfg.parallel.name == "fsdp2" else 1
    return with_fits(cfg, world_size=world_size, device=device, workspaces=workspaces, verdict=fit_verdict, result={
        "config": _config_line(cfg, world_size=world_size, seq_len=counts.seq_len),
        "model": {
            "name": cfg.model.name, "params": counts.params, "matmul_params": counts.matmul_params,
            "params_per_device": math.ceil(counts.params / shard), "flops_per_token": counts.flops_per_token,
            "seq_len": counts.seq_len, "trainable_params": counts.trainable,
            "frozen_params": counts.params - counts.trainable, "flops_source": counts.flops_source,
        },
        "memory": _memory(cfg, trace=trace, closed=closed, method=method),
        "launch_blockers": gpu_cluster_reasons(cfg, world_size=world_size),
        "device": None if device is None else {**device, "verdict": fit_verdict(peak.total, device),
                                               "used_fraction": peak.total / device["capacity_bytes"]},
        "micro_batch_search": search,
        "throughput": throughput(cfg, counts=counts, world_size=world_size),
        "speed": speed,
        "notes": notes(cfg),
        "elapsed_s": time.perf_counter() - started,
    })


def _memory(cfg: Config, *, trace: Any, closed: dict[str, Any], method: str) -> dict[str, Any]:
    """The traced peak by component beside the closed form, and how it was traced."""
    peak = trace.steady_peak()
    return {
        "traced": {**{k: 0 if k in peak.host else v for k, v in peak.components.items()}, "total": peak.total},
        "traced_host": {k: peak.components[k] for k in sorted(peak.host)} or None,
        "peak_phase": peak.phase, "peak_module": peak.module,
        "closed_form": {**closed["components"], "total": closed["total"]},
        "closed_form_host": closed["host_bytes"],
        "closed_form_vs_traced": None if closed["total"] is None else (closed["total"] - peak.total) / peak.total,
        "host_bytes": trace.host_peak() if peak.host else closed["host_bytes"],
        "host_source": "traced (FSDP2 CPUOffloadPolicy)" if peak.host else (
            "modeled (torchao CPUOffloadOptimizer)" if closed["host_bytes"] else None),
        "method": "one training step under FakeTensorMode in torch "
                  + ("FSDPMemTracker on a fake process group" if cfg.parallel.name == "fsdp2" else "MemTracker")
                  + ", saving for backward what the CUDA kernels save; " + method,
    }


def _config_line(cfg: Config, *, world_size: int, seq_len: int) -> dict[str, Any]:
    return {
        "model": cfg.model.name, "task": cfg.task.name, "precision": cfg.precision.name,
        "parallel": cfg.parallel.name, "parallel_cpu_offload": cfg.parallel.cpu_offload, "world_size": world_size,
        "ac": cfg.ac.name,
        "optimizer": cfg.optimizer.name, "attention": cfg.attention.name, "compile": cfg.compile.name,
        "micro_batch": cfg.train.batch_size, "seq_len": seq_len, "grad_accum": cfg.train.grad_accum,
    }


def notes(cfg: Config) -> list[str]:
    """What the trace does not see, stated rather than hidden."""
    out = []
    if cfg.compile.name != "none":
        out.append(f"compile={cfg.compile.name}: each block traced as AOTAutograd compiles it (joint graph, "
                   "Inductor's decompositions and partitioner, no codegen): what the compiled step saves; the "
                   "results Inductor fuses away are not allocated")
    if cfg.parallel.name == "ddp" and not DDP_GRADIENT_AS_BUCKET_VIEW:
        out.append("DDP buckets are added, not traced: DDP's default gradient_as_bucket_view=False keeps "
                   "a second fp32 copy of every gradient")
    host_states, host_grads = cfg.optimizer.offloads()
    if host_states:
        out.append("optimizer=cpu_offload (torchao CPUOffloadOptimizer): states, an fp32 copy of the "
                   "parameters and the gradients of tensors from optimizer.minimal_size elements live in "
                   "pinned host memory (modeled, 16 B/param); smaller tensors keep an AdamW on the device"
                   + ("; device gradients are freed as they are copied" if host_grads else ""))
    if cfg.parallel.name == "fsdp2" and cfg.parallel.cpu_offload:
        out.append("parallel.cpu_offload (FSDP2 CPUOffloadPolicy): sharded parameters, gradients and optimizer "
                   "states traced as host memory, the optimizer step on the host; the per-block copies to "
                   "and from the GPU (one shard each) are not traced")
    if cfg.precision.grad_scaler:
        out.append("fp16's GradScaler bookkeeping is not traced (its unscale is in place)")
    if cfg.fusion.name != "none":
        out.append(f"fusion={cfg.fusion.name}: the climate encoder's and fusion layers' activations are traced, "
                   "not in the closed form")
    out += model_spec(cfg).estimate_notes(cfg)  # what the kind says of itself (energy_flow: plan 003's claims)
    out.append("allocated bytes, like torch.cuda.max_memory_allocated; the CUDA context, NCCL buffers "
               "and allocator fragmentation are what estimate.headroom reserves")
    return out
