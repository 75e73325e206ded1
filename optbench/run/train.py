"""``train(cfg) -> RunResult``: one measured training run.

The order a run flows through, each step in the module that owns it:
typed config (``config.to_config``) -> ``compat.preflight`` (this machine, every rule) -> launch
local workers (``distributed``), or run here: process group -> checkpoint plan
(``loop.checkpoints``) -> task and data (``tasks``) -> model on the meta device (``build``) ->
``parallelize`` (AC -> compile -> DDP/FSDP2) -> ``materialize`` -> optimizer, scheduler, scaler ->
``loop.run_loop`` over the components (timing, memory, progress, evaluation, checkpoints), each
writing its part of ``summary.json``. Every outcome, failures included, ends with a summary whose
``status`` says what happened.
"""

from __future__ import annotations

import logging
import signal
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from optbench.checkpoint import resume
from optbench.checkpoint import store as checkpoint
from optbench.config import Config, to_config
from optbench.data.loader import describe_loader
from optbench.distributed import (
    Machine,
    destroy_process_group,
    env_rank,
    init_process_group,
    launch_local_workers,
    setup_worker_logging,
)
from optbench.errors import (
    ConfigError,
    DivergedError,
    IncompatibleError,
    Interrupted,
    OutOfMemory,
    RunStopped,
)
from optbench.estimate.train_hook import estimate_run
from optbench.files import timestamp
from optbench.logs import apply_log_level
from optbench.measure import peak_flops, peak_rss_bytes
from optbench.model.fusion import count_parameters
from optbench.model.transformer import count_matmul_params, count_params, flops_per_token
from optbench.optim.optimizers import build_optimizer, build_scheduler, describe_optimizer
from optbench.outputs import RunOutputs, config_hash, file_stamp, flatten, new_summary, read_summary
from optbench.run.loop import RunContext, run_loop
from optbench.run.loop.checkpoints import Checkpointing, checkpoint_plan
from optbench.run.loop.evaluation import Evaluation
from optbench.run.loop.machine_speed import MachineSpeed
from optbench.run.loop.memory import MemoryProbe
from optbench.run.loop.oom import OomGuard, check_fits, release_memory
from optbench.run.loop.profiler import Profiler
from optbench.run.loop.progress import MetricsLog
from optbench.run.loop.stopping import EarlyStopping, LossSpikeGuard, TimeBudget
from optbench.run.loop.timing import StepTiming
from optbench.run.loop.watchdog import Watchdog
from optbench.tasks import build_task
from optbench.training import preflight as compat
from optbench.training.attention import describe_attention
from optbench.training.build import (
    build_model,
    build_scaler,
    build_train_loader,
    fixed_eval_batches,
    materialize,
    seed_everything,
)
from optbench.training.parallelize import parallelize
from optbench.training.precision import apply_tf32, compute_dtype, describe_precision

log = logging.getLogger(__name__)

EXIT_CODES = {"completed": 0, "diverged": 1, "failed": 1, "incompatible": 2, "interrupted": 130,
              "stopped_early": 0, "time_limit": 124, "loss_spike": 1, "oom": 1}


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
        outputs.raise_if_refused()  # another run holds the directory: refused before anything is built
        resolved = _resolved_dict(cfg)
        summary["config"] = resolved
        summary["config_hash"] = config_hash(resolved)
        config = to_config(cfg)
        apply_log_level(config.train.log_level, progress=config.train.progress)
        summary["task"] = config.task.name
        machine = compat.preflight(
            config, seen=lambda m: summary.update(device=m.describe(), world_size=m.world_size))
        if machine.spawns_workers:  # parallel=ddp|fsdp2 outside torchrun: rank 0's result is the run's
            workers = _run_local_workers(config, machine=machine, run_dir=run_dir, summary=summary)
            summary.update({k: v for k, v in workers.summary.items() if k != "started_at"})
            user_error, trace, signum = workers.user_error, workers.traceback, workers.signal
        else:
            _run(config, machine=machine, outputs=outputs, summary=summary)
            summary["status"] = "completed"
    except (IncompatibleError, ConfigError, DivergedError, Interrupted, KeyboardInterrupt, Exception) as exc:
        status, error, user_error, signum = _outcome(exc)
        summary.update(status=status, error=error)
        trace = traceback.format_exc() if user_error else None
    finally:
        summary["wall_s"] = time.perf_counter() - started
        summary["finished_at"] = timestamp()
        # the largest of this process and (distributed) every rank
        summary["memory"]["peak_rss_bytes"] = max(peak_rss_bytes(), summary["memory"]["peak_rss_bytes"] or 0)
        if summary["status"] == "completed":
            outputs.log_hparams(flatten(summary["config"]), {
                "loss/final": summary["loss"]["final"], "loss/eval": summary["loss"]["eval"],
                "throughput/tokens_per_s": summary["throughput"]["tokens_per_s"]})
        outputs.write_summary(summary)
        outputs.close()
        destroy_process_group()
    if summary["status"] == "oom":  # here, not in the except: its traceback held the model's frames
        release_memory()  # the next run of a sweep starts with a clean allocator
    if summary["status"] != "completed":
        log.error("%s: %s", summary["status"], summary["error"])
    return RunResult(
        summary["status"], summary["error"], run_dir, summary, user_error=user_error, traceback=trace,
        signal=signum,
    )


def _run(cfg: Config, *, machine: Machine, outputs: RunOutputs, summary: dict[str, Any]) -> None:
    """One rank's run, in this process: build everything, then the loop."""
    process_group = init_process_group(machine, parallel=cfg.parallel, nccl=cfg.nccl)
    ckpt_root, resume_from = checkpoint_plan(cfg, machine=machine, run_dir=outputs.run_dir, config=summary["config"])
    device = machine.device
    predicted = _record_estimate(cfg, summary=summary, device=device)
    check_fits(cfg, estimate_bytes=summary["memory"]["estimate_bytes"], device=device,
               world_size=machine.world_size)
    summary["predicted"] = predicted() if predicted else None  # optbench.estimate: the step, before it runs

    seed_everything(cfg.train.seed)
    task = build_task(cfg)
    train_set, eval_set = task.build_datasets()

    model = build_model(cfg, task)
    applied = parallelize(model, cfg=cfg, machine=machine)
    applied["parallel"].update(process_group["parallel"])
    materialize(model, device=device, seed=cfg.train.seed)
    if cfg.fusion.kind != "none":  # the decoder from a task=lm checkpoint, before the optimizer sees it
        from optbench.model.fused import apply_base_checkpoint

        applied["fusion"] = apply_base_checkpoint(model, cfg=cfg, task=task)
    apply_tf32(cfg.precision, device=device)
    optimizer = build_optimizer(model, cfg=cfg.optimizer, lr=cfg.train.lr)
    scheduler = build_scheduler(optimizer, cfg=cfg.train)
    scaler = build_scaler(cfg, device=device)

    seq_len = task.tokens_per_sample()
    fpt = _describe_model(model, cfg=cfg, task=task, summary=summary)
    # read back from the objects built (compile's CUDA graphs after the loop, by StepTiming)
    summary["applied"] = {
        "precision": describe_precision(cfg.precision, device=device, scaler=scaler),
        "attention": describe_attention(model),
        "optimizer": describe_optimizer(optimizer, cfg=cfg.optimizer),
        "loss_freq": {"name": cfg.loss_freq.name, "every": cfg.loss_freq.every,
                      "num_queries": cfg.loss_freq.num_queries, **task.describe_aux()},
        **applied,
        "nccl": process_group["nccl"],
    }
    log.info(
        "model %s: %s parameters, %s FLOPs/token; device %s",
        cfg.model.name, f"{summary['model']['params']:,}", f"{fpt:,}", summary["device"],
    )

    ctx = RunContext(
        cfg=cfg, model=model, task=task, optimizer=optimizer, scheduler=scheduler, scaler=scaler, device=device,
        outputs=outputs, summary=summary, peak=peak_flops(device, compute_dtype(cfg.precision)),
        tokens_per_step=cfg.train.batch_size * cfg.train.grad_accum * seq_len * machine.world_size,
    )
    checkpoints = Checkpointing(ctx, root=ckpt_root, resume_from=resume_from, meta={
        "model": resume.model_signature(cfg.model), "parallel": cfg.parallel.mode,
        "config_hash": summary["config_hash"], "config": summary["config"]})
    checkpoints.resume()
    outputs.open_streams(resume_step=ctx.start)
    evaluation = Evaluation(ctx, batches=fixed_eval_batches(eval_set, cfg=cfg))
    loader = build_train_loader(train_set, cfg=cfg, machine=machine, start=checkpoints.resumed.samples_per_rank)
    summary["applied"]["dataloader"] = describe_loader(loader, cfg=cfg.dataloader)
    components = _components(ctx, evaluation=evaluation, checkpoints=checkpoints)
    run_loop(ctx, batches=loader, components=components)


def _describe_model(model: Any, *, cfg: Config, task: Any, summary: dict[str, Any]) -> int:
    """summary.json ``model``: parameters (total, trainable, frozen) and the FLOPs per token really
    computed; returns the FLOPs per token."""
    fpt = flops_per_token(model, seq_len=task.tokens_per_sample())
    summary["model"].update(
        name=cfg.model.name, params=count_params(model), matmul_params=count_matmul_params(model),
        flops_per_token=fpt,
    )
    counts = count_parameters(model)
    summary["model"].update(trainable_params=counts["trainable"], frozen_params=counts["frozen"])
    if cfg.fusion.kind != "none":  # the FLOPs autograd really computes (a frozen base: no weight gradients)
        from optbench.model.fused import describe_fused_model

        summary["model"].update(describe_fused_model(model, cfg=cfg, task=task))
        fpt = summary["model"]["flops_per_token"]
    return fpt


def _components(ctx: RunContext, *, evaluation: Evaluation, checkpoints: Checkpointing) -> list:
    """The loop's components. The order of the list is the order each hook runs in: the memory
    tracker wraps the compile timer and reads the peak before the machine-speed probe after the loop;
    the probe before the loop runs before the profiler starts; progress is logged before evaluation, and a checkpoint is saved
    after both; the stopping rules read the evaluation and may save (time budget) after the
    checkpoints; the watchdog knows the last checkpoint when a stop request hangs."""
    stopping = [EarlyStopping(ctx, evaluation=evaluation), LossSpikeGuard(ctx), TimeBudget(ctx, checkpoints=checkpoints)]
    return [OomGuard(ctx), MemoryProbe(ctx), MachineSpeed(ctx), Profiler(ctx), StepTiming(ctx), MetricsLog(ctx), evaluation,
            checkpoints, *stopping,
            Watchdog(ctx, last_checkpoint=lambda: checkpoints.root / checkpoints.saved[-1]
                     if checkpoints.saved else checkpoints.resume_from)]


def _outcome(exc: BaseException) -> tuple[str, str, bool, int | None]:
    """(status, error, user error, signal) of a run that raised ``exc``."""
    if isinstance(exc, IncompatibleError):
        return "incompatible", str(exc), True, None
    if isinstance(exc, ConfigError):
        return "failed", str(exc), True, None
    if isinstance(exc, DivergedError):
        return "diverged", str(exc), False, None
    if isinstance(exc, Interrupted):
        return "interrupted", str(exc), False, exc.signum
    if isinstance(exc, RunStopped):
        return exc.status, str(exc), False, None
    if isinstance(exc, OutOfMemory):
        return "oom", str(exc), False, None
    if isinstance(exc, KeyboardInterrupt):
        return "interrupted", "interrupted by the user (SIGINT)", False, None
    # a bug or an environment failure: keep the traceback in the log
    log.error("run failed:\n%s", traceback.format_exc())
    return "failed", f"{type(exc).__name__}: {exc}".splitlines()[0], False, None


# ------------------------------------------------------------------------------------- workers
def _rank_main(cfg: Config, run_dir: str, overrides: list[str]) -> RunResult:
    """One self-launched worker (started by torch elastic): the per-rank run; rank 0 writes the
    outputs. A failure that is not the user's exits non-zero so the launcher stops the others."""
    setup_worker_logging(env_rank())
    result = train(cfg, run_dir=run_dir, overrides=overrides)
    if result.status in ("failed", "oom") and not result.user_error:  # oom: this rank alone stopped
        raise RuntimeError(result.error)
    if result.status == "interrupted":  # exit as a stopped process (the launcher may be stopping too)
        raise SystemExit(result.exit_code)
    return result


def _run_local_workers(cfg: Config, *, machine: Machine, run_dir: Path, summary: dict[str, Any]) -> RunResult:
    """parallel=ddp|fsdp2 outside torchrun, in the process the user started (config and machine
    already checked): bad resume input fails here, before any worker starts; then
    ``parallel.nproc_per_node`` workers run ``train`` through torch's elastic launch, and rank 0's
    result is returned as this run's."""
    root = checkpoint.checkpoint_root(cfg.train, run_dir=run_dir)
    resume.find_resume(cfg.train, root=root, world_size=machine.world_size, model=cfg.model,
                           config=summary["config"])
    written = run_dir / "summary.json"
    before = file_stamp(written)
    outcome = launch_local_workers(_rank_main, cfg, str(run_dir), summary["overrides"], nproc=machine.world_size)
    if outcome.values is not None:
        return outcome.values[0]
    if file_stamp(written) != before:  # rank 0 recorded how it ended before the workers were stopped
        rank0 = read_summary(run_dir)
        if rank0["status"] == "failed" and outcome.failure:
            rank0["error"] = outcome.failure  # the first failure, which may be another rank's
        return RunResult(rank0["status"], rank0["error"], run_dir, rank0,
                         signal=outcome.signum or outcome.worker_signal)
    if outcome.signum is not None:
        raise Interrupted(f"stopped by {signal.Signals(outcome.signum).name} before the workers recorded "
                          "a result", signum=outcome.signum)
    raise RuntimeError(outcome.failure)


# ------------------------------------------------------------------------------------- helpers
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


def _record_estimate(cfg: Config, *, summary: dict[str, Any], device: Any) -> Any:
    """``memory.estimate_bytes``: the peak ``optbench estimate`` traces for this very config and device
    type (FakeTensors, nothing allocated, RNG untouched), before anything is seeded or timed; returns
    the callable that predicts the step from the same trace (``summary.json`` ``predicted``)."""
    package = logging.getLogger("optbench")
    level = package.level
    package.setLevel(logging.WARNING)  # the trace applies the run's optimizations too: no second "Applied ..."
    try:
        summary["memory"]["estimate_bytes"], predicted = estimate_run(
            cfg, world_size=summary["world_size"] or 1, device=device)
    finally:
        package.setLevel(level)

    def quietly() -> Any:
        package.setLevel(logging.WARNING)
        try:
            return predicted()
        finally:
            package.setLevel(level)

    return quietly
