"""``train(cfg) -> RunResult``: one measured training run; ``train_step`` is one optimizer step.

Flow: typed config -> compatibility check -> task and data -> model on the meta device ->
``parallelize`` -> ``to_empty`` + ``init_weights`` -> loop -> eval -> ``summary.json``.
Every outcome, failures included, ends with a summary whose ``status`` says what happened.
"""

from __future__ import annotations

import logging
import math
import random
import signal
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

from optbench import checkpoint, compat
from optbench.config import Config, to_config
from optbench.data.loader import describe_loader, loader_kwargs
from optbench.data.sampler import ShardedSampler
from optbench.distributed import (
    Machine,
    broadcast_object,
    destroy_process_group,
    env_rank,
    gather_objects,
    init_process_group,
    launch_local_workers,
    max_across_ranks,
    mean_across_ranks,
    setup_worker_logging,
)
from optbench.errors import ConfigError, DivergedError, IncompatibleError, Interrupted
from optbench.metrics import StepClock, peak_flops, peak_rss_bytes, spread
from optbench.model import (
    Transformer,
    count_matmul_params,
    count_params,
    flops_per_token,
)
from optbench.optim.attention import build_attention
from optbench.optim.compile import CompileTimer
from optbench.optim.data_parallel import (
    build_sharded_grad_scaler,
    full_tensor,
    is_sharded,
    maybe_full_tensor_init,
    set_gradient_sync,
)
from optbench.optim.optimizers import build_optimizer, build_scheduler, describe_optimizer
from optbench.optim.precision import apply_tf32, build_grad_scaler, compute_dtype, maybe_autocast
from optbench.outputs import RunOutputs, config_hash, new_summary, read_summary
from optbench.parallelize import parallelize
from optbench.preemption import StopRequest
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
    signal: int | None = None  # the signal that interrupted the run: exit status 128 + signal

    @property
    def exit_code(self) -> int:
        if self.user_error:
            return 2
        if self.status == "interrupted" and self.signal:
            return 128 + self.signal
        return EXIT_CODES[self.status]


class _WorkersDone(Exception):
    """Raised in the process that launched local workers once they are done: rank 0's result is
    the run's, and ``train`` records it like any other outcome."""

    def __init__(self, result: RunResult) -> None:
        super().__init__(result.status)
        self.result = result


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
    with maybe_full_tensor_init(model):  # FSDP2: the same weights as unsharded for the same seed
        model.init_weights()


def build_train_loader(dataset: Dataset, *, cfg: Config, machine: Machine, start: int = 0) -> DataLoader:
    dl = cfg.dataloader
    if isinstance(dataset, IterableDataset):
        # a streaming dataset (data=netcdf) shards itself over ranks and workers and yields whole
        # batches read in blocks; start = samples this rank already consumed (for resume)
        stream = dataset.shard(rank=machine.rank, world_size=machine.world_size, seed=cfg.train.seed,
                               start=start, batch_size=cfg.train.batch_size)
        return DataLoader(stream, batch_size=None, **loader_kwargs(dl, device=machine.device))
    sampler = ShardedSampler(len(dataset), seed=cfg.train.seed, shuffle=True, rank=machine.rank,
                             world_size=machine.world_size, start=start)
    return DataLoader(
        dataset,
        batch_size=cfg.train.batch_size,
        sampler=sampler,
        drop_last=True,
        **loader_kwargs(dl, device=machine.device),
        # its own generator (worker seeds): the global RNG stream, which a checkpoint restores, is
        # then the same whether the loader was created at step 0 or on resume
        generator=torch.Generator().manual_seed(cfg.train.seed),
    )


def fixed_eval_batches(dataset: Dataset, *, cfg: Config) -> list[Batch]:
    """The same held-out batches for every evaluation of the run (and of every run)."""
    count = min(cfg.train.eval_batches * cfg.train.batch_size, len(dataset))
    loader = DataLoader(torch.utils.data.Subset(dataset, range(count)), batch_size=cfg.train.batch_size,
                        generator=torch.Generator().manual_seed(cfg.train.seed))  # leaves the global RNG alone
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
        set_gradient_sync(model, micro == accum - 1)  # DDP/FSDP2 reduce gradients on the last micro-step
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
    # the global batch's mean loss (DDP/FSDP2 already average the gradients over ranks)
    means = mean_across_ranks(torch.stack([main_sum, *aux_sums.values()]) / accum)
    loss_value, norm_value = torch.stack([means[0], full_tensor(grad_norm).float()]).tolist()
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
    aux = dict(zip(aux_sums, means[1:].tolist(), strict=True))
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
    outputs = RunOutputs(run_dir, enabled=env_rank() == 0)  # only rank 0 writes
    started = time.perf_counter()
    user_error = False
    trace: str | None = None
    signum: int | None = None
    try:
        resolved = _resolved_dict(cfg)
        summary["config"] = resolved
        summary["config_hash"] = config_hash(resolved)
        config = to_config(cfg)
        _run(config, outputs=outputs, summary=summary)
        summary["status"] = "completed"
    except _WorkersDone as done:  # self-launched workers ran it: rank 0's result is the run's
        summary.update({k: v for k, v in done.result.summary.items() if k != "started_at"})
        user_error, trace, signum = done.result.user_error, done.result.traceback, done.result.signal
    except IncompatibleError as exc:
        summary.update(status="incompatible", error=str(exc))
        user_error, trace = True, traceback.format_exc()
    except ConfigError as exc:
        summary.update(status="failed", error=str(exc))
        user_error, trace = True, traceback.format_exc()
    except DivergedError as exc:
        summary.update(status="diverged", error=str(exc))
    except Interrupted as exc:
        summary.update(status="interrupted", error=str(exc))
        signum = exc.signum
    except KeyboardInterrupt:
        summary.update(status="interrupted", error="interrupted by the user (SIGINT)")
    except Exception as exc:  # a bug or an environment failure: keep the traceback in the log
        summary.update(status="failed", error=f"{type(exc).__name__}: {exc}".splitlines()[0])
        log.error("run failed:\n%s", traceback.format_exc())
    finally:
        summary["wall_s"] = time.perf_counter() - started
        summary["finished_at"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
        # the largest of this process and (distributed) every rank
        summary["memory"]["peak_rss_bytes"] = max(peak_rss_bytes(), summary["memory"]["peak_rss_bytes"] or 0)
        outputs.write_summary(summary)
        outputs.close()
        destroy_process_group()
    if summary["status"] != "completed":
        log.error("%s: %s", summary["status"], summary["error"])
    return RunResult(
        summary["status"], summary["error"], run_dir, summary, user_error=user_error, traceback=trace,
        signal=signum,
    )


def _run(cfg: Config, *, outputs: RunOutputs, summary: dict[str, Any]) -> None:
    summary["task"] = cfg.task.name
    machine = compat.preflight(
        cfg, seen=lambda m: summary.update(device=m.describe(), world_size=m.world_size))
    if machine.spawns_workers:
        _run_local_workers(cfg, machine=machine, run_dir=outputs.run_dir, summary=summary)
    process_group = init_process_group(machine, parallel=cfg.parallel, nccl=cfg.nccl)
    ckpt_root, resume_from = _checkpoint_plan(cfg, machine=machine, run_dir=outputs.run_dir)
    device = machine.device
    _record_estimate(cfg, summary=summary, device=device)

    seed_everything(cfg.train.seed)
    task = build_task(cfg)
    train_set, eval_set = task.build_datasets()

    model = build_model(cfg, task)
    applied = parallelize(model, cfg=cfg, machine=machine)
    applied["parallel"].update(process_group["parallel"])
    materialize(model, device=device, seed=cfg.train.seed)
    tf32 = apply_tf32(cfg.precision, device=device)
    optimizer = build_optimizer(model, cfg=cfg.optimizer, lr=cfg.train.lr)
    scheduler = build_scheduler(optimizer, cfg=cfg.train)
    scaler = build_grad_scaler(cfg.precision, device=device)
    if scaler is not None and cfg.parallel.mode == "fsdp2":
        scaler = build_sharded_grad_scaler(device=device)  # ranks agree on skipping an overflowed step

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
        "nccl": process_group["nccl"],
    }
    log.info(
        "model %s: %s parameters, %s FLOPs/token; device %s",
        cfg.model.name, f"{summary['model']['params']:,}", f"{fpt:,}", summary["device"],
    )

    saver = _Checkpointing(root=ckpt_root, every=cfg.train.save_every, keep_last=cfg.train.keep_last,
                           meta={"model": checkpoint.model_signature(cfg.model), "parallel": cfg.parallel.mode,
                                 "config_hash": summary["config_hash"]})
    if resume_from is not None:
        saver.resumed = checkpoint.load(resume_from, model=model, optimizer=optimizer, scheduler=scheduler,
                                        scaler=scaler)
    summary["applied"]["checkpoint"] = saver.describe(resume_from)

    outputs.open_streams(resume_step=saver.resumed.step)
    eval_batches = fixed_eval_batches(eval_set, cfg=cfg)
    loader = build_train_loader(train_set, cfg=cfg, machine=machine, start=saver.resumed.samples_per_rank)
    _loop(cfg, model=model, task=task, optimizer=optimizer, scheduler=scheduler, scaler=scaler,
          loader=loader, eval_batches=eval_batches, device=device, outputs=outputs, summary=summary,
          tokens_per_step=cfg.train.batch_size * cfg.train.grad_accum * seq_len * machine.world_size,
          saver=saver)


# ------------------------------------------------------------------------- ranks and checkpoints
def _rank_main(cfg: Config, run_dir: str, overrides: list[str]) -> RunResult:
    """One self-launched worker (started by torch elastic): the per-rank run; rank 0 writes the
    outputs. A failure that is not the user's exits non-zero so the launcher stops the others."""
    setup_worker_logging(env_rank())
    result = train(cfg, run_dir=run_dir, overrides=overrides)
    if result.status == "failed" and not result.user_error:
        raise RuntimeError(result.error)
    if result.status == "interrupted":  # exit as a stopped process (the launcher may be stopping too)
        raise SystemExit(result.exit_code)
    return result


def _run_local_workers(cfg: Config, *, machine: Machine, run_dir: Path, summary: dict[str, Any]) -> None:
    """parallel=ddp|fsdp2 outside torchrun, in the process the user started (config and machine
    already checked): bad resume input fails here, before any worker starts; then
    ``parallel.nproc_per_node`` workers run ``train`` through torch's elastic launch, and rank 0's
    result becomes this run's (raised as ``_WorkersDone``)."""
    root = checkpoint.checkpoint_root(cfg.train, run_dir=run_dir)
    checkpoint.find_resume(cfg.train, root=root, world_size=machine.world_size, model=cfg.model)
    written = run_dir / "summary.json"
    before = _file_stamp(written)
    outcome = launch_local_workers(_rank_main, cfg, str(run_dir), summary["overrides"], nproc=machine.world_size)
    if outcome.values is not None:
        raise _WorkersDone(outcome.values[0])
    if _file_stamp(written) != before:  # rank 0 recorded how it ended before the workers were stopped
        rank0 = read_summary(run_dir)
        if rank0["status"] == "failed" and outcome.failure:
            rank0["error"] = outcome.failure  # the first failure, which may be another rank's
        raise _WorkersDone(RunResult(rank0["status"], rank0["error"], run_dir, rank0,
                                     signal=outcome.signum or outcome.worker_signal))
    if outcome.signum is not None:
        raise Interrupted(f"stopped by {signal.Signals(outcome.signum).name} before the workers recorded "
                          "a result", signum=outcome.signum)
    raise RuntimeError(outcome.failure)


def _file_stamp(path: Path) -> tuple[int, int] | None:
    try:
        stat = path.stat()
    except FileNotFoundError:
        return None
    return stat.st_ino, stat.st_mtime_ns


def _checkpoint_plan(cfg: Config, *, machine: Machine, run_dir: Path) -> tuple[Path, Path | None]:
    """Rank 0 decides where checkpoints live and which one to resume from; every rank follows
    (under torchrun each rank's Hydra run directory may differ)."""
    plan: tuple[str, Any, Any]
    if machine.rank == 0:
        root = checkpoint.checkpoint_root(cfg.train, run_dir=run_dir).absolute()
        try:
            plan = ("ok", root, checkpoint.find_resume(cfg.train, root=root, world_size=machine.world_size,
                                                       model=cfg.model))
        except ConfigError as exc:
            plan = ("error", str(exc), None)
    else:
        plan = ("", None, None)
    kind, first, second = broadcast_object(plan)
    if kind == "error":
        raise ConfigError(first)
    return first, second


@dataclass
class _Checkpointing:
    """Where and when the loop saves, and what it resumed from."""

    root: Path
    every: int
    keep_last: int
    meta: dict[str, Any]
    resumed: checkpoint.Progress = field(default_factory=checkpoint.Progress)
    saved: list[str] = field(default_factory=list)

    def due(self, steps_done: int, *, total: int) -> bool:
        return self.every > 0 and (steps_done % self.every == 0 or steps_done == total)

    def describe(self, resumed_from: Path | None) -> dict[str, Any]:
        name = f"every_{self.every}" if self.every else "on_stop"
        if resumed_from is not None:
            name += f",resumed@{self.resumed.step}"
        return {"name": name, "dir": str(self.root), "save_every": self.every, "keep_last": self.keep_last,
                "resumed_from": str(resumed_from) if resumed_from else None,
                "resumed_step": self.resumed.step if resumed_from else None, "saved": self.saved}


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
    saver: _Checkpointing,
) -> None:
    train_cfg = cfg.train
    start = saver.resumed.step  # steps already done (a resumed run)
    peak = peak_flops(device, compute_dtype(cfg.precision))
    clock = StepClock(device)
    batches = iter(loader)
    step_times: list[float] = []
    data_waits: list[float] = []
    losses: list[float] = [saver.resumed.first_loss] if saver.resumed.first_loss is not None else []
    eval_result: dict[str, float] | None = None
    memory_peak: int | None = None
    memory_source = "not measured (train.track_memory=false)"
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    progress = Progress(total=train_cfg.steps, mode=train_cfg.progress if env_rank() == 0 else "log",
                        log_every=train_cfg.log_every)
    stop = StopRequest().install()
    ranks_agree = False  # every rank left the loop at the same point: collectives are safe
    compile_timer = CompileTimer(enabled=cfg.compile.mode != "off" or cfg.attention.kernel == "flex")
    memory_step = _memory_step(warmup=start + train_cfg.timing_warmup, every=cfg.loss_freq.every)
    if train_cfg.track_memory and device.type == "cpu" and memory_step >= train_cfg.steps:
        memory_source = f"not measured (step {memory_step}, the first to compute the auxiliary loss, is past train.steps)"
    try:
        for step in range(start, train_cfg.steps):
            track = train_cfg.track_memory and device.type == "cpu" and step == memory_step
            timed = step >= start + train_cfg.timing_warmup and not track
            tracker = _cpu_memory_tracker(model, optimizer) if track else nullcontext()
            clock.start()
            with tracker, compile_timer.step(timed):
                stats = train_step(model, task=task, optimizer=optimizer, batches=batches, device=device,
                                   cfg=cfg, step=step, scaler=scaler,
                                   with_aux=step % cfg.loss_freq.every == 0,
                                   memory_tracker=tracker if track else None)
            elapsed = clock.stop()
            # the job's step time is its slowest rank's; any rank's stop signal stops them all
            elapsed, stop_signal = max_across_ranks([elapsed, float(stop.signum or 0)], device=device)
            lr = scheduler.get_last_lr()[0]
            scheduler.step()
            if track:
                memory_peak = _tracked_peak(tracker, device)
                memory_source = f"torch {type(tracker).__name__} on real tensors, step {step} " + (
                    "(a warm-up step)" if step < start + train_cfg.timing_warmup
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
            stopping = bool(stop_signal) and not is_last
            if stopping or saver.due(step + 1, total=train_cfg.steps):
                path = _save(saver, step + 1, model=model, optimizer=optimizer, scheduler=scheduler,
                             scaler=scaler, losses=losses, cfg=cfg)
            if stopping:
                ranks_agree = True
                name = signal.Signals(int(stop_signal)).name
                raise Interrupted(f"stopped by {name} after step {step + 1} of {train_cfg.steps}; checkpoint "
                                  f"{path}; train.resume=auto in the same run directory continues it",
                                  signum=int(stop_signal))
        ranks_agree = True
    finally:
        progress.close()
        stop.restore()
        if device.type == "cuda":
            memory_peak = torch.cuda.max_memory_allocated(device)
            memory_source = "torch.cuda.max_memory_allocated"
        if ranks_agree:
            memory_peak, memory_source = _ranks_memory(summary, memory_peak, memory_source)
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


def _record_estimate(cfg: Config, *, summary: dict[str, Any], device: torch.device) -> None:
    """``memory.estimate_bytes``: the peak ``optbench estimate`` traces for this very config and device
    type (FakeTensors, nothing allocated, RNG untouched), before anything is seeded or timed."""
    from optbench.estimate import estimate_run_bytes

    summary["memory"]["estimate_bytes"] = estimate_run_bytes(
        cfg, world_size=summary["world_size"] or 1, device_type=device.type
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
    if is_sharded(model):  # FSDP2: the tracker that knows sharded/unsharded parameters and gradients
        from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

        return FSDPMemTracker(model, optimizer)
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    tracker.track_external(model, optimizer)
    return tracker


def _save(saver: _Checkpointing, steps_done: int, *, model: nn.Module, optimizer: torch.optim.Optimizer,
          scheduler: Any, scaler: Any, losses: list[float], cfg: Config) -> Path:
    samples = saver.resumed.samples_per_rank + (steps_done - saver.resumed.step) * (
        cfg.train.batch_size * cfg.train.grad_accum)
    progress = checkpoint.Progress(step=steps_done, samples_per_rank=samples,
                                   first_loss=losses[0] if losses else None)
    path = checkpoint.save(saver.root, model=model, optimizer=optimizer, scheduler=scheduler, scaler=scaler,
                           progress=progress, meta=saver.meta, keep_last=saver.keep_last)
    saver.saved.append(path.name)
    return path


def _ranks_memory(summary: dict[str, Any], peak: int | None, source: str) -> tuple[int | None, str]:
    """Every rank's peak (memory.per_rank); the run's peak is the largest rank's."""
    per_rank = gather_objects({"peak_bytes": peak, "peak_rss_bytes": peak_rss_bytes()})
    if len(per_rank) == 1:
        return peak, source
    summary["memory"]["per_rank"] = per_rank
    summary["memory"]["peak_rss_bytes"] = max(r["peak_rss_bytes"] for r in per_rank)
    peaks = [r["peak_bytes"] for r in per_rank if r["peak_bytes"] is not None]
    return (max(peaks) if peaks else None), f"{source}; largest of {len(per_rank)} ranks"


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
