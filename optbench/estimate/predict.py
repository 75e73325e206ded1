"""The prediction ``optbench estimate`` prints and ``optbench train`` records beside what it
measures (``summary.json`` ``predicted``): step time, tokens/s, MFU and where the time goes, for
this machine (the per-op benchmark) or a named GPU (a roofline with measured efficiencies).
``optbench.estimate.speed`` sums the ops; this module assembles the rest of the step around them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from optbench.config import Config
from optbench.estimate.memtrace import StepTrace
from optbench.estimate.ops import OpCall, StepOps
from optbench.estimate.speed import (
    BREAKDOWN,
    CATEGORIES,
    Costs,
    Link,
    combine,
    ddp_allreduce_s,
    exposed_communication,
    step_figures,
)

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Prediction:
    """What the step is predicted from: the traced ops of the typical step (and of the heavy one,
    which computes the auxiliary loss, when ``loss_freq.every`` > 1), how each op is costed, the
    link collectives use, the peak MFU is against, the data wait, and a compiled block's time."""

    cfg: Config
    world_size: int
    flops_per_token: int
    seq_len: int
    costs: Costs
    link: Link | None
    peak_flops: float | None
    peak_source: str
    data: dict[str, Any]
    compiled: Any = None  # optbench.estimate.compiled_time.CompiledBlocks, or None
    gradient_bytes: int = 0  # DDP's all-reduce (trainable parameters' gradients)


def traces_for(cfg: Config, trace: Callable[..., StepTrace], micro_batch: int, *,
               first: StepTrace | None = None) -> tuple[StepOps, StepOps | None]:
    """The op logs the prediction needs: the typical step's, and the heavy step's when the
    auxiliary loss runs only every ``loss_freq.every`` steps (``first``: a trace already made with
    the auxiliary loss and ops recorded, reused)."""
    heavy = first if first is not None and first.ops is not None else None
    if cfg.loss_freq.every <= 1:
        return (heavy or trace(micro_batch, ops=True)).ops, None
    heavy = heavy or trace(micro_batch, ops=True)
    return trace(micro_batch, ops=True, with_aux=False).ops, heavy.ops


def step_calls(typical: StepOps, heavy: StepOps | None) -> list[OpCall]:
    """The ops the per-op benchmark times for a step, in the order the step runs them (collectives
    are modeled, not run)."""
    return [call for ops in (typical, heavy) if ops is not None for log in ops.logs for *_, call, _ in log.calls
            if call.kind != "collective"]


def predict(p: Prediction, *, typical: StepOps, heavy: StepOps | None) -> dict[str, Any]:
    """The predicted step (the typical one, what a run's median measures) and the mean step."""
    started = time.perf_counter()
    cfg = p.cfg
    figures = [_step(p, ops) for ops in (typical, heavy) if ops is not None]
    step, mean = figures[0], combine(figures[0], figures[1] if len(figures) > 1 else None, every=cfg.loss_freq.every)
    _add_data(p, step)
    _add_data(p, mean)
    tokens = cfg.train.batch_size * cfg.train.grad_accum * p.seq_len * p.world_size
    seconds = sum(step[k] for k in BREAKDOWN)
    mean_s = sum(mean[k] for k in BREAKDOWN)
    per_device = tokens / p.world_size / seconds
    mfu = None if p.peak_flops is None else per_device * p.flops_per_token / p.peak_flops
    return {
        "device": p.costs.device, "method": p.costs.method,
        "step_time_s": seconds, "step_time_mean_s": mean_s,
        "tokens_per_s": tokens / seconds, "tokens_per_s_mean": tokens / mean_s,
        "tokens_per_s_per_device": per_device, "mfu": mfu, "peak_flops": p.peak_flops, "peak_source": p.peak_source,
        "breakdown_s": {k: step[k] for k in BREAKDOWN},
        "communication": None if p.link is None else {
            "total_s": step["communication_total"], "exposed_s": step["communication"],
            "bytes": int(step["collective_bytes"]), "link": p.link.source},
        "data": p.data,
        "compiled_blocks": None if p.compiled is None else p.compiled.describe(),
        "ops": int(step["ops"]),
        "predicted_in_s": time.perf_counter() - started,
    }


def _step(p: Prediction, ops: StepOps) -> dict[str, float]:
    """Seconds by category of one step (without data) from its op logs."""
    cfg = p.cfg
    compiled = None
    if cfg.compile.name != "none":
        compiled = "measured" if p.compiled is not None else "fused"
    figures = step_figures(ops, costs=p.costs, accum=cfg.train.grad_accum, world=p.world_size, link=p.link,
                           compiled=compiled)
    if p.compiled is not None:  # every micro-step runs the compiled blocks
        figures["other ops"] += cfg.train.grad_accum * p.compiled.other_seconds(layers=cfg.model.layers)
    comm = figures["communication"]
    if cfg.parallel.name == "ddp" and p.link is not None:
        comm += ddp_allreduce_s(gradient_bytes=p.gradient_bytes, world=p.world_size, link=p.link)
        figures["collective_bytes"] += p.gradient_bytes
    last = p.link.seconds("all_reduce", min(p.gradient_bytes, 25 * 2**20), p.world_size) if p.link else 0.0
    figures["communication_total"] = comm
    figures["communication"] = exposed_communication(figures, comm_s=comm, overlaps=p.costs.overlaps_communication,
                                                     last_s=last)
    return figures


def _add_data(p: Prediction, figures: dict[str, float]) -> None:
    """The data wait per step: the main process's batch time without workers; with workers, what
    the workers' share of it exceeds the step's compute by."""
    per_batch = p.data.get("seconds_per_batch")
    accum = p.cfg.train.grad_accum
    if per_batch is None:
        figures["data"] = 0.0
        return
    workers = p.cfg.dataloader.num_workers
    compute = sum(figures[k] for k in CATEGORIES)
    figures["data"] = accum * per_batch if workers == 0 else max(0.0, accum * per_batch / workers - compute)


# ------------------------------------------------------------------------------------ data wait
_DATA: dict[str, dict[str, Any]] = {}


def measure_data_once(cfg: Config) -> dict[str, Any]:
    """``measure_data`` once per data, task, batch and loader in this process (the planner
    predicts many configs of one data)."""
    key = repr((cfg.data, cfg.task, cfg.model.vocab_size, cfg.train.batch_size, cfg.train.seq_len,
                cfg.train.seed, cfg.dataloader.num_workers))
    if key not in _DATA:
        _DATA[key] = measure_data(cfg)
    return _DATA[key]


def measure_data(cfg: Config, *, batches: int = 5) -> dict[str, Any]:
    """Seconds the main process spends on one micro-batch of the configured data without workers
    (the median of ``batches`` after the first: a step waits for a typical batch),
    the training loader's own sampling and collation; the global RNG is left as it was."""
    from optbench.distributed import Machine
    from optbench.errors import ConfigError
    from optbench.tasks import build_task
    from optbench.training.build import build_train_loader

    local = dataclasses.replace(cfg, dataloader=dataclasses.replace(cfg.dataloader, num_workers=0,
                                                                    persistent_workers=False, prefetch_factor=None))
    machine = Machine(device=torch.device("cpu"), cuda_available=False, cuda_devices=0, cpu_threads=1)
    try:
        with torch.random.fork_rng(devices=[]), _quiet():
            train_set, _ = build_task(local).build_datasets()
            loader = iter(build_train_loader(train_set, cfg=local, machine=machine))
            next(loader)
            times = []
            for _ in range(batches):
                start = time.perf_counter()
                next(loader)
                times.append(time.perf_counter() - start)
    except (ConfigError, OSError) as exc:
        return {"seconds_per_batch": None, "source": f"not measured: {exc}"}
    workers = cfg.dataloader.num_workers
    return {"seconds_per_batch": statistics.median(times), "num_workers": workers,
            "source": f"measured here: median of {batches} batches of data={cfg.data.name} without workers"
                      + (f"; with {workers} workers the wait is what their share exceeds the compute by"
                         if workers else "")}


@contextlib.contextmanager
def _quiet() -> Any:
    package = logging.getLogger("optbench")
    level = package.level
    package.setLevel(logging.WARNING)
    try:
        yield
    finally:
        package.setLevel(level)


# ------------------------------------------------------------------------------- the two targets
def on_this_machine(cfg: Config, *, device: torch.device, world_size: int, threads: int | None = None,
                    link: Link | None = None) -> Prediction:
    """How this machine costs ``cfg``'s step: the per-op benchmark at the run's thread count, gloo
    (CPU) or the card's NVLink (CUDA) between ranks, the measured CPU ceiling or the card's peak."""
    from optbench.distributed import threads_per_worker
    from optbench.estimate.links import gpu_link, machine_link
    from optbench.estimate.op_timings import MachineCosts
    from optbench.measure import gpu_peak_key, peak_flops
    from optbench.training.precision import compute_dtype

    if threads is None:
        threads = torch.get_num_threads() if world_size == 1 or "OMP_NUM_THREADS" in os.environ \
            else threads_per_worker(world_size)
    costs = MachineCosts(device, threads=threads)
    if world_size > 1 and link is None:
        key = gpu_peak_key(torch.cuda.get_device_name(device)) if device.type == "cuda" else None
        link = gpu_link(key, stated_gbps=cfg.estimate.link_gbps) if key in NVLINK_KEYS else \
            machine_link(world_size, stated_gbps=cfg.estimate.link_gbps)
    peak = peak_flops(device, compute_dtype(cfg.precision))
    return Prediction(cfg=cfg, world_size=world_size, flops_per_token=0, seq_len=0, costs=costs, link=link,
                      peak_flops=peak.flops, peak_source=peak.source, data={})


def on_gpu(cfg: Config, *, key: str, world_size: int) -> Prediction:
    """A projection onto ``key`` (a GPU_PEAKS card): the roofline, its NVLink, its datasheet peak."""
    from optbench.estimate.links import gpu_link
    from optbench.estimate.roofline import RooflineCosts
    from optbench.measure import GPU_PEAKS
    from optbench.training.precision import compute_dtype

    dtype = compute_dtype(cfg.precision)
    link = gpu_link(key, stated_gbps=cfg.estimate.link_gbps) if world_size > 1 else None
    return Prediction(cfg=cfg, world_size=world_size, flops_per_token=0, seq_len=0,
                      costs=RooflineCosts(key, cfg=cfg), link=link, peak_flops=GPU_PEAKS[key][dtype],
                      peak_source=f"datasheet {key} dense {dtype}", data={})


NVLINK_KEYS = ("H100 SXM", "H200", "A100")


def complete(p: Prediction, *, typical: StepOps, heavy: StepOps | None, flops_per_token: int, seq_len: int,
             trainable_params: int, device: torch.device | None) -> dict[str, Any]:
    """Fill in what the ops do not say (the data wait, DDP's gradient bytes, a compiled block's
    time on this machine) and predict."""
    p.flops_per_token, p.seq_len = flops_per_token, seq_len
    p.gradient_bytes = 4 * trainable_params if p.cfg.parallel.name == "ddp" else 0
    p.data = measure_data_once(p.cfg)
    prepare = getattr(p.costs, "prepare", None)  # this machine's per-op benchmark: the step's ops interleaved,
    if prepare is not None:  # before anything asks for an op's seconds
        prepare(step_calls(typical, heavy))
    if device is not None and p.cfg.compile.name != "none":
        from optbench.estimate.compiled_time import time_compiled_blocks

        with _threads_of(p.costs):
            p.compiled = time_compiled_blocks(p.cfg, log=typical.logs[-1], device=device)
    return predict(p, typical=typical, heavy=heavy)


@contextlib.contextmanager
def _threads_of(costs: Costs) -> Any:
    threads = getattr(costs, "threads", None)
    before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


# ------------------------------------------------------------------ optbench estimate's speed
def predict_on_gpu(cfg: Config, *, trace: Any, first: Any, counts: Any, world_size: int, gpu: str) -> dict[str, Any]:
    """The step projected onto ``gpu`` (a GPU_PEAKS card) from the traced ops."""
    typical, heavy = traces_for(cfg, trace, cfg.train.batch_size, first=first)
    prediction = on_gpu(cfg, key=gpu, world_size=world_size)
    return complete(prediction, typical=typical, heavy=heavy, flops_per_token=counts.flops_per_token,
                    seq_len=counts.seq_len, trainable_params=counts.trainable, device=None)


def predict_here(cfg: Config, *, counts: Any, world_size: int) -> dict[str, Any]:
    """The step on this machine's CPU: the ops of a step traced as a CPU runs it, each benchmarked here."""
    from optbench.estimate.tracer import step_tracer

    cpu = torch.device("cpu")
    with step_tracer(cfg, world_size=world_size, target="cpu", stacked=cfg.estimate.stacked) as trace:
        typical, heavy = traces_for(cfg, trace, cfg.train.batch_size)
    prediction = on_this_machine(cfg, device=cpu, world_size=world_size)
    return complete(prediction, typical=typical, heavy=heavy, flops_per_token=counts.flops_per_token,
                    seq_len=counts.seq_len, trainable_params=counts.trainable, device=cpu)


def speed_lines(speed: dict[str, Any], *, world_size: int) -> list[str]:
    """The predicted step: time, tokens/s, MFU, where the time goes, how it was predicted."""
    if "error" in speed:
        return [f"  speed        {speed['error']}"]
    mfu = "" if speed["mfu"] is None else f", {speed['mfu']:.1%} MFU of {speed['peak_flops'] / 1e12:,.1f} TFLOP/s"
    total = speed["step_time_s"]
    parts = ", ".join(f"{k} {v / total:.0%}" for k, v in speed["breakdown_s"].items() if v / total >= 0.005)
    lines = [f"  speed        {speed['step_time_s']:.4g} s per optimizer step, {speed['tokens_per_s']:,.0f} tokens/s "
             f"on {world_size} device(s){mfu} ({speed['device']})",
             f"               {parts}"]
    if abs(speed["step_time_mean_s"] - total) > 1e-9:
        lines.append(f"               mean step {speed['step_time_mean_s']:.4g} s (the auxiliary loss every "
                     "few steps)")
    lines.append(f"               predicted by {speed['method']}")
    return lines
