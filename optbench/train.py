"""``train(cfg) -> RunResult``: one measured training run; ``train_step`` is one optimizer step.

Flow: typed config -> compatibility check -> task and data -> model on the meta device ->
``parallelize`` -> ``to_empty`` + ``init_weights`` -> loop -> eval -> ``summary.json``.
Every outcome, failures included, ends with a summary whose ``status`` says what happened.
"""

from __future__ import annotations

import logging
import math
import random
import sys
import time
import traceback
from collections.abc import Iterator
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn
from torch.utils.data import DataLoader, Dataset, IterableDataset

from optbench import compat
from optbench.config import Config, to_config
from optbench.data.loader import describe_loader, loader_kwargs
from optbench.data.sampler import ShardedSampler
from optbench.distributed import Machine, detect_machine
from optbench.errors import ConfigError, DivergedError, IncompatibleError
from optbench.metrics import StepClock, peak_flops, peak_rss_bytes, spread
from optbench.model import (
    Transformer,
    count_matmul_params,
    count_params,
    flops_per_token,
)
from optbench.optim.attention import build_attention
from optbench.optim.compile import CompileTimer
from optbench.optim.optimizers import build_optimizer, build_scheduler, describe_optimizer
from optbench.optim.precision import apply_tf32, build_grad_scaler, compute_dtype, maybe_autocast
from optbench.outputs import RunOutputs, config_hash, new_summary
from optbench.parallelize import parallelize
from optbench.tasks import Batch, Task, build_task

log = logging.getLogger(__name__)

EXIT_CODES = {"completed": 0, "diverged": 1, "failed": 1, "incompatible": 2, "interrupted": 130}


@dataclass
class RunResult:
    status: str
    error: str | None
    run_dir: Path
    summary: dict[str, Any]
    user_error: bool = False  # a bad value or impossible combination: exit 2, one line
    traceback: str | None = None  # shown for user errors only with HYDRA_FULL_ERROR=1

    @property
    def exit_code(self) -> int:
        return 2 if self.user_error else EXIT_CODES[self.status]


@dataclass
class StepStats:
    loss: float
    grad_norm: float
    aux: dict[str, float] = field(default_factory=dict)
    skipped: bool = False  # fp16: the scaler found inf/nan gradients and skipped the update
    data_wait_s: float = 0.0


# ------------------------------------------------------------------------------------- building
def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def build_model(cfg: Config, task: Task) -> Transformer:
    """The full model on the meta device: nothing is allocated."""
    with torch.device("meta"):
        return Transformer(
            cfg.model,
            embed=task.build_embed(),
            head=task.build_head(),
            causal=task.causal,
            max_seq_len=task.tokens_per_sample(),
            attention=build_attention(cfg.attention.kernel),
        )


def materialize(model: nn.Module, *, device: torch.device, seed: int) -> None:
    """Allocate on ``device`` and initialize deterministically from ``seed``."""
    model.to_empty(device=device)
    torch.manual_seed(seed)
    model.init_weights()


def build_train_loader(dataset: Dataset, *, cfg: Config, machine: Machine, start: int = 0) -> DataLoader:
    dl = cfg.dataloader
    if isinstance(dataset, IterableDataset):
        # a streaming dataset (data=netcdf) shards itself over ranks and workers and yields whole
        # batches read in blocks; start = samples this rank already consumed (for resume)
        stream = dataset.shard(rank=0, world_size=1, seed=cfg.train.seed, start=start,
                               batch_size=cfg.train.batch_size)
        return DataLoader(stream, batch_size=None, **loader_kwargs(dl, device=machine.device))
    sampler = ShardedSampler(len(dataset), seed=cfg.train.seed, shuffle=True, start=start)
    return DataLoader(
        dataset,
        batch_size=cfg.train.batch_size,
        sampler=sampler,
        drop_last=True,
        **loader_kwargs(dl, device=machine.device),
    )


def fixed_eval_batches(dataset: Dataset, *, cfg: Config) -> list[Batch]:
    """The same held-out batches for every evaluation of the run (and of every run)."""
    count = min(cfg.train.eval_batches * cfg.train.batch_size, len(dataset))
    loader = DataLoader(torch.utils.data.Subset(dataset, range(count)), batch_size=cfg.train.batch_size)
    return list(loader)


def to_device(batch: Batch, device: torch.device) -> Batch:
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


# ----------------------------------------------------------------------------------------- step
def train_step(
    model: nn.Module,
    *,
    task: Task,
    optimizer: torch.optim.Optimizer,
    batches: Iterator[Batch],
    device: torch.device,
    cfg: Config,
    step: int,
    scaler: torch.amp.GradScaler | None = None,
    with_aux: bool = False,
    memory_tracker: Any = None,
) -> StepStats:
    """One optimizer step over ``train.grad_accum`` micro-batches drawn from ``batches``.

    Raises DivergedError *before* the optimizer update when the loss or the gradient norm is not
    finite (with fp16 loss scaling a non-finite gradient is an overflow the scaler skips instead).
    """
    accum = cfg.train.grad_accum
    main_sum = torch.zeros((), device=device)
    aux_sums: dict[str, torch.Tensor] = {}
    data_wait = 0.0
    for micro in range(accum):
        if memory_tracker is not None and micro:
            memory_tracker.reset_mod_stats()  # MemTracker allows one forward per module; peak is kept
        fetch_start = time.perf_counter()
        batch = to_device(next(batches), device)
        data_wait += time.perf_counter() - fetch_start
        batch = task.augment(batch, step=step, micro=micro)
        with maybe_autocast(cfg.precision, device=device):
            outputs = model(task.inputs(batch))
            losses = task.losses(outputs, batch, with_aux=with_aux)
        loss = losses.total / accum
        (scaler.scale(loss) if scaler is not None else loss).backward()
        main_sum += losses.main.detach()
        for name, value in losses.aux.items():
            aux_sums[name] = aux_sums.get(name, 0.0) + value.detach()

    if scaler is not None:
        scaler.unscale_(optimizer)
    params = [p for p in model.parameters() if p.grad is not None]
    if cfg.train.clip_grad is not None:
        grad_norm = torch.nn.utils.clip_grad_norm_(params, cfg.train.clip_grad)
    else:
        grad_norm = torch.nn.utils.get_total_norm([p.grad for p in params])
    loss_value, norm_value = torch.stack([main_sum / accum, grad_norm.float()]).tolist()
    if not math.isfinite(loss_value):
        optimizer.zero_grad(set_to_none=True)
        raise DivergedError(step, "loss", loss_value)
    skipped = False
    if scaler is not None:
        scale_before = scaler.get_scale()
        scaler.step(optimizer)
        scaler.update()
        skipped = scaler.get_scale() < scale_before
    else:
        if not math.isfinite(norm_value):
            optimizer.zero_grad(set_to_none=True)
            raise DivergedError(step, "gradient norm", norm_value)
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    aux = {name: float(value) / accum for name, value in aux_sums.items()}
    return StepStats(loss=loss_value, grad_norm=norm_value, aux=aux, skipped=skipped, data_wait_s=data_wait)


@torch.no_grad()
def evaluate(model: nn.Module, *, task: Task, batches: list[Batch], device: torch.device, cfg: Config) -> dict:
    """Mean main loss over the fixed eval batches, and the task's metrics from its sums over them."""
    model.eval()
    total = 0.0
    sums: dict[str, Any] = {}
    for batch in batches:
        batch = to_device(batch, device)
        with maybe_autocast(cfg.precision, device=device):
            outputs = model(task.inputs(batch))
            losses = task.losses(outputs, batch, with_aux=False)
        total += float(losses.main)
        for key, value in task.eval_metrics(outputs, batch).items():
            sums[key] = sums[key] + value if key in sums else value
    model.train()
    n = max(1, len(batches))
    return {"loss": total / n, **task.finalize_eval_metrics(sums)}


# ------------------------------------------------------------------------------------- progress
class Progress:
    """A rich progress bar on a terminal; plain log lines every ``log_every`` steps otherwise."""

    def __init__(self, *, total: int, mode: str, log_every: int) -> None:
        use_bar = mode == "bar" or (mode == "auto" and sys.stderr.isatty())
        self.log_every = log_every
        self.total = total
        self._bar = None
        if use_bar:
            from rich.progress import BarColumn, TextColumn, TimeRemainingColumn
            from rich.progress import Progress as RichProgress

            self._bar = RichProgress(
                TextColumn("step {task.completed}/{task.total}"),
                BarColumn(),
                TextColumn("{task.fields[info]}"),
                TimeRemainingColumn(),
                transient=False,
            )
            self._task = self._bar.add_task("train", total=total, info="")
            self._bar.start()

    def update(self, step: int, info: str) -> None:
        if self._bar is not None:
            self._bar.update(self._task, completed=step + 1, info=info)
        if (step + 1) % self.log_every == 0 or step + 1 == self.total:
            log.info("step %d/%d %s", step + 1, self.total, info)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()


# ------------------------------------------------------------------------------------------ run
def _resolved_dict(cfg: DictConfig | Config) -> dict[str, Any]:
    container = OmegaConf.structured(cfg) if isinstance(cfg, Config) else cfg
    resolved = OmegaConf.to_container(container, resolve=True, throw_on_missing=False)
    assert isinstance(resolved, dict)
    resolved.pop("hydra", None)
    return resolved


def _current_overrides() -> list[str]:
    from hydra.core.hydra_config import HydraConfig

    if HydraConfig.initialized():
        return list(HydraConfig.get().overrides.task)
    return []


def train(
    cfg: DictConfig | Config, *, run_dir: str | Path | None = None, overrides: list[str] | None = None
) -> RunResult:
    """Train once as ``cfg`` says and write the run's outputs into ``run_dir`` (default: the Hydra
    run directory, else the working directory). Never raises for a user error or a diverged or
    interrupted run: the RunResult and summary.json say what happened."""
    if run_dir is None:
        from hydra.core.hydra_config import HydraConfig

        run_dir = HydraConfig.get().runtime.output_dir if HydraConfig.initialized() else Path.cwd()
    run_dir = Path(run_dir)
    summary = new_summary(overrides=overrides if overrides is not None else _current_overrides())
    outputs = RunOutputs(run_dir)
    started = time.perf_counter()
    user_error = False
    trace: str | None = None
    try:
        resolved = _resolved_dict(cfg)
        summary["config"] = resolved
        summary["config_hash"] = config_hash(resolved)
        config = to_config(cfg)
        _run(config, outputs=outputs, summary=summary)
        summary["status"] = "completed"
    except IncompatibleError as exc:
        summary.update(status="incompatible", error=str(exc))
        user_error, trace = True, traceback.format_exc()
    except ConfigError as exc:
        summary.update(status="failed", error=str(exc))
        user_error, trace = True, traceback.format_exc()
    except DivergedError as exc:
        summary.update(status="diverged", error=str(exc))
    except KeyboardInterrupt:
        summary.update(status="interrupted", error="interrupted by the user (SIGINT)")
    except Exception as exc:  # a bug or an environment failure: keep the traceback in the log
        summary.update(status="failed", error=f"{type(exc).__name__}: {exc}".splitlines()[0])
        log.error("run failed:\n%s", traceback.format_exc())
    finally:
        summary["wall_s"] = time.perf_counter() - started
        summary["finished_at"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
        summary["memory"]["peak_rss_bytes"] = peak_rss_bytes()
        outputs.write_summary(summary)
        outputs.close()
    if summary["status"] != "completed":
        log.error("%s: %s", summary["status"], summary["error"])
    return RunResult(
        summary["status"], summary["error"], run_dir, summary, user_error=user_error, traceback=trace
    )


def _run(cfg: Config, *, outputs: RunOutputs, summary: dict[str, Any]) -> None:
    machine = detect_machine(cfg.train.device)
    summary["device"] = machine.describe()
    summary["task"] = cfg.task.name
    compat.check(cfg, machine)
    device = machine.device

    seed_everything(cfg.train.seed)
    task = build_task(cfg)
    train_set, eval_set = task.build_datasets()

    model = build_model(cfg, task)
    applied = parallelize(model, cfg=cfg, machine=machine)
    materialize(model, device=device, seed=cfg.train.seed)
    tf32 = apply_tf32(cfg.precision, device=device)
    optimizer = build_optimizer(model, cfg=cfg.optimizer, lr=cfg.train.lr)
    scheduler = build_scheduler(optimizer, cfg=cfg.train)
    scaler = build_grad_scaler(cfg.precision, device=device)

    seq_len = task.tokens_per_sample()
    fpt = flops_per_token(model, seq_len=seq_len)
    summary["model"].update(
        name=cfg.model.name, params=count_params(model), matmul_params=count_matmul_params(model),
        flops_per_token=fpt,
    )
    summary["applied"] = {
        "precision": {
            "name": cfg.precision.name,
            "autocast": cfg.precision.autocast,
            "tf32": tf32,
            "grad_scaler": scaler is not None,
        },
        "attention": cfg.attention.kernel,
        "optimizer": describe_optimizer(optimizer, cfg=cfg.optimizer),
        "dataloader": describe_loader(cfg.dataloader, device=device),
        "loss_freq": {"name": cfg.loss_freq.name, "every": cfg.loss_freq.every,
                      "num_queries": cfg.loss_freq.num_queries, **task.describe_aux()},
        **applied,
    }
    log.info(
        "model %s: %s parameters, %s FLOPs/token; device %s",
        cfg.model.name, f"{summary['model']['params']:,}", f"{fpt:,}", summary["device"],
    )

    outputs.open_streams()
    eval_batches = fixed_eval_batches(eval_set, cfg=cfg)
    loader = build_train_loader(train_set, cfg=cfg, machine=machine)
    _loop(cfg, model=model, task=task, optimizer=optimizer, scheduler=scheduler, scaler=scaler,
          loader=loader, eval_batches=eval_batches, device=device, outputs=outputs, summary=summary,
          tokens_per_step=cfg.train.batch_size * cfg.train.grad_accum * seq_len)


def _loop(
    cfg: Config,
    *,
    model: nn.Module,
    task: Task,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    scaler: torch.amp.GradScaler | None,
    loader: DataLoader,
    eval_batches: list[Batch],
    device: torch.device,
    outputs: RunOutputs,
    summary: dict[str, Any],
    tokens_per_step: int,
) -> None:
    train_cfg = cfg.train
    peak = peak_flops(device, compute_dtype(cfg.precision))
    clock = StepClock(device)
    batches = iter(loader)
    step_times: list[float] = []
    data_waits: list[float] = []
    losses: list[float] = []
    eval_result: dict[str, float] | None = None
    memory_peak: int | None = None
    memory_source = "not measured (train.track_memory=false)"
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    progress = Progress(total=train_cfg.steps, mode=train_cfg.progress, log_every=train_cfg.log_every)
    compile_timer = CompileTimer(enabled=cfg.compile.mode != "off" or cfg.attention.kernel == "flex")
    memory_step = _memory_step(warmup=train_cfg.timing_warmup, every=cfg.loss_freq.every)
    if train_cfg.track_memory and device.type == "cpu" and memory_step >= train_cfg.steps:
        memory_source = f"not measured (step {memory_step}, the first to compute the auxiliary loss, is past train.steps)"
    try:
        for step in range(train_cfg.steps):
            track = train_cfg.track_memory and device.type == "cpu" and step == memory_step
            timed = step >= train_cfg.timing_warmup and not track
            tracker = _cpu_memory_tracker(model, optimizer) if track else nullcontext()
            clock.start()
            with tracker, compile_timer.step(timed):
                stats = train_step(model, task=task, optimizer=optimizer, batches=batches, device=device,
                                   cfg=cfg, step=step, scaler=scaler,
                                   with_aux=step % cfg.loss_freq.every == 0,
                                   memory_tracker=tracker if track else None)
            elapsed = clock.stop()
            lr = scheduler.get_last_lr()[0]
            scheduler.step()
            if track:
                memory_peak = _tracked_peak(tracker, device)
                memory_source = f"torch MemTracker on real tensors, step {step} " + (
                    "(a warm-up step)" if step < train_cfg.timing_warmup
                    else "(the first step computing the auxiliary loss, excluded from timing)")
            losses.append(stats.loss)
            if timed:
                step_times.append(elapsed)
                data_waits.append(stats.data_wait_s)
            tokens_per_s = tokens_per_step / elapsed
            record = {
                "kind": "train", "step": step, "loss": stats.loss, "lr": lr, "grad_norm": stats.grad_norm,
                "step_time_s": elapsed, "tokens_per_s": tokens_per_s, "timed": timed,
                "data_wait_s": stats.data_wait_s, "aux_computed": bool(stats.aux), "aux": stats.aux,
                "skipped": stats.skipped,
            }
            if (step + 1) % train_cfg.log_every == 0 or step + 1 == train_cfg.steps:
                outputs.log_metrics(record)
                outputs.log_scalars(step, {
                    "loss/train": stats.loss, "lr": lr, "grad_norm": stats.grad_norm,
                    "throughput/tokens_per_s": tokens_per_s,
                    "throughput/mfu": _mfu(summary, tokens_per_s, peak.flops),
                    "memory/allocated_bytes": (
                        float(torch.cuda.memory_allocated(device)) if device.type == "cuda" else None
                    ),
                })
            summary["steps"] = step + 1
            progress.update(step, f"loss {stats.loss:.4f} | {tokens_per_s:,.0f} tok/s")
            is_last = step + 1 == train_cfg.steps
            if is_last or (train_cfg.eval_every and (step + 1) % train_cfg.eval_every == 0):
                eval_result = evaluate(model, task=task, batches=eval_batches, device=device, cfg=cfg)
                outputs.log_metrics({"kind": "eval", "step": step, **eval_result})
                outputs.log_scalars(step, {"loss/eval": eval_result["loss"],
                                           **{f"eval/{k}": v for k, v in eval_result.items() if k != "loss"}})
    finally:
        progress.close()
        if device.type == "cuda":
            memory_peak = torch.cuda.max_memory_allocated(device)
            memory_source = "torch.cuda.max_memory_allocated"
        _fill_results(summary, step_times=step_times, data_waits=data_waits, losses=losses,
                      eval_result=eval_result, tokens_per_step=tokens_per_step, peak=peak,
                      memory_peak=memory_peak, memory_source=memory_source, cfg=cfg)
        summary["throughput"]["compile_s"] = compile_timer.total()
        summary["applied"]["compile"].update(
            graphs=compile_timer.graphs(), compile_s_in_timed_steps=compile_timer.in_timed_steps
        )
    outputs.log_hparams(
        {k: v for k, v in _flatten(summary["config"]).items()},
        {"loss/final": summary["loss"]["final"], "loss/eval": summary["loss"]["eval"],
         "throughput/tokens_per_s": summary["throughput"]["tokens_per_s"]},
    )


def _memory_step(*, warmup: int, every: int) -> int:
    """The step MemTracker follows on CPU: the last warm-up step, or, when that step skips the
    auxiliary loss (loss_freq.every > 1), the next step that computes it, so the peak covers the
    run's heaviest kind of step (that step is then left out of the timing)."""
    step = max(warmup - 1, 0)
    while step % every:
        step += 1
    return step


def _cpu_memory_tracker(model: nn.Module, optimizer: torch.optim.Optimizer):
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    tracker.track_external(model, optimizer)
    return tracker


def _tracked_peak(tracker: Any, device: torch.device) -> int:
    snapshot = tracker.get_tracker_snapshot("peak")
    return int(snapshot[device]["Total"])


def _mfu(summary: dict[str, Any], tokens_per_s: float, peak: float | None) -> float | None:
    if peak is None:
        return None
    world = summary["world_size"] or 1
    return summary["model"]["flops_per_token"] * tokens_per_s / (peak * world)


def _fill_results(
    summary: dict[str, Any], *, step_times: list[float], data_waits: list[float], losses: list[float],
    eval_result: dict[str, float] | None, tokens_per_step: int, peak: Any, memory_peak: int | None,
    memory_source: str, cfg: Config,
) -> None:
    throughput = summary["throughput"]
    throughput.update(
        tokens_per_step=tokens_per_step, warmup_steps=cfg.train.timing_warmup,
        timed_steps=len(step_times), step_times_s=step_times,
        peak_flops=peak.flops, peak_source=peak.source,
    )
    if step_times:
        stats = spread(step_times)
        throughput["step_time_s"] = {k: stats[k] for k in ("median", "p10", "p90", "mean")}
        throughput["tokens_per_s"] = tokens_per_step / stats["median"]
        throughput["tokens_per_s_mean"] = tokens_per_step * len(step_times) / sum(step_times)
        throughput["mfu"] = _mfu(summary, throughput["tokens_per_s"], peak.flops)
        throughput["data_wait_frac"] = sum(data_waits) / sum(step_times)
    summary["memory"].update(peak_bytes=memory_peak, peak_source=memory_source)
    if losses:
        summary["loss"].update(first=losses[0], final=losses[-1])
    if eval_result is not None:
        summary["loss"]["eval"] = eval_result["loss"]
        summary["loss"]["eval_metrics"] = {k: v for k, v in eval_result.items() if k != "loss"}


def _flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(tree, dict):
        return {prefix: tree}
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        flat.update(_flatten(value, f"{prefix}.{key}" if prefix else str(key)))
    return flat
