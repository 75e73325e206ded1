"""``train(cfg) -> RunResult``: one measured training run.

The order a run flows through, each step in the module that owns it:
typed config (``config.to_config``) -> ``training.preflight`` (this machine, every rule) -> the
checkpoint plan (``checkpoint.plan``) -> launch local workers (``distributed``), which follow that
plan, or run here: process group -> task and data (``tasks``) -> model on the meta device
(``build``) -> ``parallelize`` (AC -> compile -> DDP/FSDP2) -> ``materialize`` -> optimizer,
scheduler, scaler -> ``checkpoint.Manager.resume`` -> ``loop.run_loop`` over the components
(timing, memory, progress, evaluation, checkpoints, ...), each returning its section of the typed
summary (``optbench.summary.RunSummary``). Every outcome, failures included, ends with a summary.json
whose ``status`` says what happened.
"""

from __future__ import annotations

import dataclasses
import logging
import signal
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from optbench import checkpoint
from optbench.checkpoint.store import checkpoint_root
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
from optbench.exits import OK, run_exit
from optbench.logs import apply_log_level
from optbench.measure import peak_flops, peak_rss_bytes
from optbench.optim.optimizers import build_optimizer, build_scheduler, describe_optimizer
from optbench.outputs import RunOutputs, config_hash, file_stamp, flatten
from optbench.run.loop import Component, RunContext, run_loop
from optbench.run.loop.checkpoint_saver import CheckpointSaver
from optbench.run.loop.evaluation import Evaluation
from optbench.run.loop.machine_speed import MachineSpeedProbe
from optbench.run.loop.memory import MemoryProbe
from optbench.run.loop.oom import OomGuard, check_fits, release_memory
from optbench.run.loop.profiler import Profiler
from optbench.run.loop.progress import MetricsLog
from optbench.run.loop.stopping import EarlyStopping, LossSpikeGuard, TimeBudget
from optbench.run.loop.timing import StepTiming
from optbench.run.loop.tracking import Tracking
from optbench.run.loop.watchdog import Watchdog
from optbench.run.preemption import honour_pending, interruptible
from optbench.run.rerun import guard_finished_run, hydra_files
from optbench.summary import LoopProgress, Model, RunSummary, read_run_summary
from optbench.tasks import build_task
from optbench.training.build import (
    build_scaler,
    build_train_loader,
    fixed_eval_batches,
    materialize,
    seed_everything,
)
from optbench.training.kinds import ModelSpec, model_spec
from optbench.training.parallelize import parallelize
from optbench.training.precision import apply_tf32, compute_dtype, describe_precision
from optbench.training.preflight import preflight

log = logging.getLogger(__name__)

# outcomes that are not errors, said once at their own level: a phase this machine cannot run (a
# recorded, expected outcome: a CPU sweep of the plan blocks phases 5-8), a run stopped on purpose
OUTCOME_LOG_LEVELS = {"incompatible": logging.WARNING, "stopped_early": logging.INFO, "time_limit": logging.WARNING}


@dataclass
class RunResult:
    status: str
    error: str | None
    run_dir: Path
    record: RunSummary  # what summary.json holds
    user_error: bool = False  # a bad value or impossible combination: exit 2, one line
    traceback: str | None = None  # shown for user errors only with HYDRA_FULL_ERROR=1
    signal: int | None = None  # the signal that interrupted the run: exit status 128 + signal

    @property
    def summary(self) -> dict[str, Any]:
        """The record as summary.json spells it (its keys: what a test of the file's content reads)."""
        return self.record.to_dict()

    @property
    def exit_code(self) -> int:
        return run_exit(self.status, user_error=self.user_error, signum=self.signal)


def train(
    cfg: DictConfig | Config, *, run_dir: str | Path | None = None, overrides: list[str] | None = None
) -> RunResult:
    """Train once as ``cfg`` says and write the run's outputs into ``run_dir`` (default: the Hydra
    run directory, else the working directory). Never raises for a user error or a diverged or
    interrupted run: the RunResult and summary.json say what happened."""
    if run_dir is None:
        from hydra.core.hydra_config import HydraConfig

        run_dir = HydraConfig.get().runtime.output_dir if HydraConfig.initialized() else Path.cwd()
    return _train(cfg, run_dir=Path(run_dir), overrides=overrides if overrides is not None else _current_overrides())


def _train(cfg: DictConfig | Config, *, run_dir: Path, overrides: list[str],
           plan: checkpoint.Plan | None = None) -> RunResult:
    """``train``; a local worker follows its launcher's checkpoint ``plan``."""
    record = RunSummary(overrides=list(overrides))
    outputs = RunOutputs(run_dir, enabled=env_rank() == 0)  # only rank 0 writes
    started = time.perf_counter()
    user_error = False
    trace: str | None = None
    signum: int | None = None
    try:
        with interruptible():  # SIGTERM: an interrupted summary
            record, workers = _start(cfg, run_dir=run_dir, outputs=outputs, record=record, plan=plan)
        if workers is not None:
            user_error, trace, signum = workers.user_error, workers.traceback, workers.signal
    except (IncompatibleError, ConfigError, DivergedError, Interrupted, KeyboardInterrupt, Exception) as exc:
        status, error, user_error, signum = _outcome(exc)
        record.end(status, error)
        trace = traceback.format_exc() if user_error else None
    finally:
        _close(record, outputs=outputs, wall_s=time.perf_counter() - started)
    if outputs.summary_error is not None and run_exit(record.status) == OK:  # no summary: not a success
        record.end("failed", f"{outputs.summary_error} (the run itself ended {record.status})")
        user_error = True
    if record.status == "oom":  # here, not in the except: its traceback held the model's frames
        release_memory()  # the next run of a sweep starts with a clean allocator
    if record.status != "completed":
        log.log(OUTCOME_LOG_LEVELS.get(record.status, logging.ERROR), "%s: %s", record.status, record.error)
    return RunResult(record.status, record.error, run_dir, record, user_error=user_error, traceback=trace,
                     signal=signum)


def _start(cfg: DictConfig | Config, *, run_dir: Path, outputs: RunOutputs, record: RunSummary,
           plan: checkpoint.Plan | None) -> tuple[RunSummary, RunResult | None]:
    """The run, from its config to its last step (``_train``'s body): the record (rank 0's, from
    local workers: their result too)."""
    outputs.raise_if_refused()  # another run holds the directory: refused before anything is built
    resolved = _resolved_dict(cfg)
    record.set_config(resolved, config_hash(resolved))
    config = to_config(cfg)
    apply_log_level(config.log.level, progress=config.log.progress)
    _guard_finished_run(config, outputs=outputs)
    outputs.check_in_the_way(checkpoints=checkpoint_root(config.checkpoint, run_dir=run_dir))
    record.task = config.task.name
    machine = preflight(config, seen=lambda m: _seen(record, m))
    if machine.spawns_workers:  # parallel=ddp|fsdp2 outside torchrun: rank 0's result is the run's
        workers = _run_local_workers(config, machine=machine, run_dir=run_dir, record=record)
        return dataclasses.replace(workers.record, started_at=record.started_at), workers
    _run(config, machine=machine, outputs=outputs, record=record, plan=plan)
    record.end("completed")
    return record, None


def _guard_finished_run(cfg: Config, *, outputs: RunOutputs) -> None:
    """A finished run in this directory is kept (``optbench.run.rerun``); rank 0 decides."""
    if outputs.enabled and guard_finished_run(cfg, run_dir=outputs.run_dir, keep=hydra_files(outputs.run_dir)):
        outputs.reopen_log()  # its train.log went with it


def _seen(record: RunSummary, machine: Machine) -> None:
    record.set_machine(machine.describe(), machine.world_size)


def _close(record: RunSummary, *, outputs: RunOutputs, wall_s: float) -> None:
    """Finish the record, write summary.json (and TensorBoard's hparams of a completed run), release
    the run directory and the process group."""
    record.close(wall_s=wall_s, peak_rss_bytes=peak_rss_bytes())
    if record.status == "completed":
        outputs.log_hparams(flatten(record.config), {
            "loss/final": record.loss.final, "loss/eval": record.loss.eval,
            "throughput/tokens_per_s": record.throughput.tokens_per_s})
    outputs.write_summary(record)
    outputs.close()
    destroy_process_group()


def _run(cfg: Config, *, machine: Machine, outputs: RunOutputs, record: RunSummary,
         plan: checkpoint.Plan | None) -> None:
    """One rank's run, in this process: build everything, resume, then the loop."""
    process_group = init_process_group(machine, parallel=cfg.parallel, nccl=cfg.nccl)
    plan = plan or checkpoint.agreed_plan(cfg, machine=machine, run_dir=outputs.run_dir, config=record.config)
    device = machine.device
    predicted = _record_estimate(cfg, record=record, world_size=machine.world_size, device=device)
    check_fits(cfg, estimate_bytes=record.memory.estimate_bytes, device=device, world_size=machine.world_size)
    record.predicted = predicted()  # optbench.estimate: the step, before it runs

    seed_everything(cfg.train.seed)
    task = build_task(cfg)
    train_set, eval_set = task.build_datasets()
    model, optimizer, scheduler, scaler = _build(cfg, task=task, machine=machine, record=record,
                                                 process_group=process_group)

    checkpoint_manager = checkpoint.Manager(plan, cfg=cfg, config=record.config, config_hash=record.config_hash,
                                            model=model, optimizer=optimizer, scheduler=scheduler, scaler=scaler)
    resumed = checkpoint_manager.resume()
    record.add(checkpoint_manager.record())
    outputs.open_streams(resume_step=resumed.step, tensorboard="tensorboard" in cfg.log.trackers)
    ctx = RunContext(
        cfg=cfg, model=model, task=task, optimizer=optimizer, scheduler=scheduler, scaler=scaler, device=device,
        outputs=outputs, world_size=machine.world_size, flops_per_token=record.model.flops_per_token,
        tokens_per_step=cfg.train.batch_size * cfg.train.grad_accum * task.tokens_per_sample() * machine.world_size,
        peak=peak_flops(device, compute_dtype(cfg.precision), given_tflops=cfg.measure.peak_tflops), estimate_bytes=record.memory.estimate_bytes,
        start=resumed.step, progress=LoopProgress(steps=resumed.step, first_loss=resumed.first_loss,
                                                  final_loss=resumed.first_loss),
    )
    loader = build_train_loader(train_set, cfg=cfg, machine=machine, start=resumed.samples_per_rank)
    record.set_applied("dataloader", describe_loader(loader, cfg=cfg.dataloader))
    components = loop_components(ctx, record=record, checkpoint_manager=checkpoint_manager,
                                 eval_batches=fixed_eval_batches(eval_set, cfg=cfg, count=task.eval_count(eval_set)))
    honour_pending()  # the end of start-up: a SIGTERM some library swallowed stops the run here
    run_loop(ctx, batches=loader, components=components, record=record)


def _build(cfg: Config, *, task: Any, machine: Machine, record: RunSummary, process_group: dict[str, Any]) -> tuple:
    """The model (parallelized, materialized, a fused model's base loaded), its optimizer, scheduler
    and scaler; summary.json's ``model`` and ``applied``, read back from the objects built (compile's
    CUDA graphs after the loop, by StepTiming)."""
    device = machine.device
    spec = model_spec(cfg)
    model = spec.build(cfg, task)
    applied = parallelize(model, cfg=cfg, machine=machine)
    applied["parallel"].update(process_group["parallel"])
    materialize(model, device=device, seed=cfg.train.seed)
    # the weights the config names (model.hf.weights, a fused model's base and encoder), before the
    # optimizer sees the model
    applied.update(spec.load_weights(model, cfg))
    apply_tf32(cfg.precision, device=device)
    optimizer = build_optimizer(model, cfg=cfg.optimizer, lr=cfg.train.lr)
    scheduler = build_scheduler(optimizer, cfg=cfg.train)
    scaler = build_scaler(cfg, device=device)

    record.set_model(_describe_model(model, spec=spec, cfg=cfg, task=task), applied={
        "precision": describe_precision(cfg.precision, device=device, scaler=scaler),
        "attention": spec.applied_attention(model),
        "optimizer": describe_optimizer(optimizer, cfg=cfg.optimizer),
        "loss_freq": {"name": cfg.loss_freq.name, "every": cfg.loss_freq.every,
                      "num_queries": cfg.loss_freq.num_queries, **task.describe_aux()},
        **applied,
        "nccl": process_group["nccl"],
    })
    log.info("model %s: %s parameters, %s FLOPs/token; device %s", cfg.model.name, f"{record.model.params:,}",
             f"{record.model.flops_per_token:,}", record.device)
    return model, optimizer, scheduler, scaler


def _describe_model(model: Any, *, spec: ModelSpec, cfg: Config, task: Any) -> Model:
    """summary.json ``model``: parameters (total, trainable, frozen) and the FLOPs per token really
    computed, then what the model's kind adds (``ModelSpec.describe``: what transformers built; a fused
    model's FLOPs as autograd computes them, a frozen base without weight gradients)."""
    counts = spec.count_parameters(model)
    described = Model(name=cfg.model.name, params=counts["total"], matmul_params=counts["matmul"],
                      flops_per_token=spec.flops_per_token(model, task.tokens_per_sample()),
                      trainable_params=counts["trainable"], frozen_params=counts["frozen"])
    return dataclasses.replace(described, **spec.describe(model, cfg, task))


def loop_components(ctx: RunContext, *, record: RunSummary, checkpoint_manager: checkpoint.Manager,
                eval_batches: list) -> list[Component]:
    """The loop's components, those this run enables. ``run_loop`` starts them and runs each step's
    hooks in this order and finishes them in the reverse order, so each brackets those after it: the
    watchdog bounds everything, to the last finish; the machine-speed probes run outside all the
    measuring (before the allocator's peak counts and the profiler starts, after both are read); the
    OOM guard wraps the memory tracker, which wraps the compile timer; the trackers (MLflow, W&B)
    connect before any probe and finish once every other section is recorded; progress is logged and the
    evaluation run before a checkpoint is saved; the stopping rules decide last (early stopping reads
    the evaluation; the time budget saves unless the step was just saved)."""
    cfg = ctx.cfg
    evaluation = Evaluation(ctx, batches=eval_batches)
    components: list[Component] = [Watchdog(ctx, record=record, checkpoint_manager=checkpoint_manager)]
    if cfg.log.trackers != ["tensorboard"] and ctx.outputs.enabled:  # MLflow, W&B: rank 0 alone
        components.append(Tracking(ctx, record=record))
    components += [MachineSpeedProbe(ctx), OomGuard(ctx), MemoryProbe(ctx)]
    if cfg.profile.enabled:
        components.append(Profiler(ctx))
    components += [StepTiming(ctx), MetricsLog(ctx), evaluation, CheckpointSaver(ctx, manager=checkpoint_manager)]
    if cfg.stopping.patience:
        components.append(EarlyStopping(ctx, evaluation=evaluation))
    if cfg.stopping.spike_factor is not None:
        components.append(LossSpikeGuard(ctx))
    if cfg.run.time_limit_s is not None:
        components.append(TimeBudget(ctx, checkpoint_manager=checkpoint_manager))
    return components


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
def _rank_main(cfg: Config, run_dir: str, overrides: list[str], plan: checkpoint.Plan) -> RunResult:
    """One self-launched worker (started by torch elastic): the per-rank run, following the
    launcher's checkpoint ``plan``; rank 0 writes the outputs. A failure that is not the user's
    exits non-zero so the launcher stops the others."""
    setup_worker_logging(env_rank())
    result = _train(cfg, run_dir=Path(run_dir), overrides=overrides, plan=plan)
    if result.status in ("failed", "oom") and not result.user_error:  # oom: this rank alone stopped
        raise RuntimeError(result.error)
    if result.status == "interrupted":  # exit as a stopped process (the launcher may be stopping too)
        raise SystemExit(result.exit_code)
    return result


def _run_local_workers(cfg: Config, *, machine: Machine, run_dir: Path, record: RunSummary) -> RunResult:
    """parallel=ddp|fsdp2 outside torchrun, in the process the user started (config and machine
    already checked): the checkpoint plan is made here, once, so bad resume input fails before any
    worker starts and every worker follows it; then ``parallel.nproc_per_node`` workers run the
    training through torch's elastic launch, and rank 0's result is returned as this run's."""
    plan = checkpoint.plan(cfg, run_dir=run_dir, world_size=machine.world_size, config=record.config)
    written = run_dir / "summary.json"
    before = file_stamp(written)
    outcome = launch_local_workers(_rank_main, cfg, str(run_dir), record.overrides, plan, nproc=machine.world_size,
                                   start_method=cfg.parallel.start_method)
    if outcome.values is not None:
        return outcome.values[0]
    if file_stamp(written) != before:  # rank 0 recorded how it ended before the workers were stopped
        rank0 = read_run_summary(run_dir)
        if rank0.status == "failed" and outcome.failure:
            rank0.end("failed", outcome.failure)  # the first failure, which may be another rank's
        return RunResult(rank0.status, rank0.error, run_dir, rank0, signal=outcome.signum or outcome.worker_signal)
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


def _record_estimate(cfg: Config, *, record: RunSummary, world_size: int, device: Any) -> Any:
    """``memory.estimate_bytes``: the peak ``optbench estimate`` traces for this very config and device
    type (FakeTensors, nothing allocated, RNG untouched), before anything is seeded or timed; returns
    the callable that predicts the step from the same trace (``summary.json`` ``predicted``).
    ``estimate.in_run=false``: neither is made (both null; run.check_memory has nothing to check)."""
    if not cfg.estimate.in_run:
        log.info("no memory estimate or predicted step before the loop (estimate.in_run=false)")
        return lambda: None
    package = logging.getLogger("optbench")
    level = package.level
    package.setLevel(logging.WARNING)  # the trace applies the run's optimizations too: no second "Applied ..."
    try:
        estimate_bytes, predicted = estimate_run(cfg, world_size=world_size, device=device)
        record.set_estimate(estimate_bytes)
    finally:
        package.setLevel(level)

    def quietly() -> Any:
        package.setLevel(logging.WARNING)
        try:
            return predicted()
        finally:
            package.setLevel(level)

    return quietly
