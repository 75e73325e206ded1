"""summary.json's parts: the sections of ``optbench.summary.RunSummary`` (each a dataclass whose fields
are its keys), the checkpoint manager's ``CheckpointRecord`` (``applied.checkpoint``) and the sections
only the loop returns (``LoopProgress``, ``EvalResult``, ``Timing``, ``MemoryPeak``), which
``RunSummary.add`` puts in place. Import them from ``optbench.summary``."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any

import torch


def versions() -> dict[str, Any]:
    """summary.json ``versions``: the Python, torch and CUDA a run used."""
    return {"python": sys.version.split()[0], "torch": torch.__version__, "cuda": torch.version.cuda}


def _optional() -> Any:
    return field(default=None, metadata={"omit_none": True})


# --------------------------------------------------------------------------- summary.json's parts
@dataclass
class Model:
    name: str | None = None
    params: int | None = None
    matmul_params: int | None = None
    flops_per_token: int | None = None  # the FLOPs behind every MFU of the run
    trainable_params: int | None = None
    frozen_params: int | None = None
    # a fused model's (optbench.training.kinds.fused)
    frozen_share: float | None = _optional()
    forward_flops_per_token: int | None = _optional()
    flops_source: str | None = _optional()
    hf: dict[str, Any] | None = _optional()  # model=hf: what transformers built (optbench.model.hf.describe_hf_model)
    # model=energy_*: the lattice, flows, parameters by part (optbench.training.kinds.energy_flow)
    energy_flow: dict[str, Any] | None = _optional()


@dataclass
class StepTimes:
    """The timed steps' seconds: median and spread (``optbench.measure.spread``)."""

    median: float | None = None
    p10: float | None = None
    p90: float | None = None
    mean: float | None = _optional()


@dataclass
class Throughput:
    tokens_per_s: float | None = None  # at the median step time
    tokens_per_s_mean: float | None = None
    tokens_per_step: int | None = None
    step_time_s: StepTimes = field(default_factory=StepTimes)
    step_times_s: list[float] | None = None
    timed_steps: int | None = None
    warmup_steps: int | None = None
    mfu: float | None = None
    peak_flops: float | None = None
    peak_source: str | None = None
    compile_s: float | None = None
    data_wait_frac: float | None = None
    page_faults_per_step: float | None = None  # the process's minor faults a timed step, median


@dataclass
class OomRecord:
    """The step that ran out of memory, the allocator's figures and what would fit."""

    step: int
    allocated_bytes: int | None
    reserved_bytes: int | None
    max_allocated_bytes: int | None
    capacity_bytes: int
    estimate_bytes: int | None
    advice: str


@dataclass
class Memory:
    peak_bytes: int | None = None
    peak_source: str | None = None
    peak_rss_bytes: int | None = None
    estimate_bytes: int | None = None
    per_rank: list[dict[str, Any]] | None = None
    oom: OomRecord | None = _optional()


@dataclass
class Loss:
    first: float | None = None
    final: float | None = None
    eval: float | None = None
    eval_metrics: dict[str, float] | None = None


@dataclass
class MachineSpeed:
    """Matmul probes before the first step and after the last (``optbench.measure.machine_speed_probe``)."""

    before: dict[str, Any] | None = None
    after: dict[str, Any] | None = None
    moved: float | None = None  # after / before - 1

    def probed_flops(self) -> list[float]:
        """The FLOP/s of the probes this run has (before, after): positive numbers only."""
        probes = (probe.get("flops") if isinstance(probe, dict) else None for probe in (self.before, self.after))
        return [float(v) for v in probes if isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0]


@dataclass
class ProfileRecord:
    dir: str | None
    steps: list[int]  # 0-based, the recorded (active) steps
    warmup_steps: list[int]  # 0-based, the profiler's warm-up steps before them
    excluded_steps: list[int]  # both, left out of the timed steps
    excluded_from_timing: bool
    traces: list[str]
    top_ops: list[dict[str, Any]]
    memory_snapshot: str | None


@dataclass
class EarlyStoppingRecord:
    metric: str
    mode: str
    patience: int
    min_delta: float
    best: float | None
    best_step: int | None
    evals_without_improvement: int
    stopped_at_step: int | None


@dataclass
class SpikeRecord:
    factor: float
    window: int
    action: str
    skipped_steps: list[int]
    events: list[dict[str, Any]]


@dataclass
class TimeBudgetRecord:
    time_limit_s: float
    loop_s: float
    stopped_at_step: int | None


@dataclass
class Stopping:
    early: EarlyStoppingRecord | None = _optional()
    spikes: SpikeRecord | None = _optional()
    time_budget: TimeBudgetRecord | None = _optional()


@dataclass
class StopRecord:
    """A stop request the loop did not honour in time: the watchdog ended the process."""

    signal: str
    bound_s: float
    last_step: int
    last_checkpoint: str | None
    forced: bool


@dataclass
class CheckpointRecord:
    """What the checkpoints of a run did (``applied.checkpoint``; ``optbench.checkpoint.Manager.record``)."""

    name: str  # every_N or on_stop, then ,resumed@STEP and ,config_changed where they apply
    dir: str
    save_every: int
    keep_last: int
    resumed_from: str | None
    resumed_step: int | None
    saved: list[str]  # the checkpoints this run wrote, oldest first
    skipped: list[str]  # "name: why" of newer checkpoints that did not load
    config_changes: list[dict[str, Any]]  # what differs from the config the resumed one was written under


@dataclass
class StepsUsed:
    """How many steps of an inner loop the training steps ran (task=energy_flow: the flow steps, per
    training step the mean over its micro-steps): their mean, least and most, over ``steps`` steps."""

    mean: float
    min: float
    max: float
    steps: int


@dataclass
class TaskRecord:
    """What a task ran beside the model and recorded over the training steps (``applied.task``;
    ``optbench.tasks.Task.run_record``; only task=energy_flow has one): ``mode``, one line;
    ``forms``, the forms of the plan's optimizations it ran (task=energy_flow: flows, stop,
    threshold, patience, bridge, load, max_steps); ``flow_steps``, the inner steps used (None: no
    training step ran); ``throughput_unit``, what a "token" of tokens/s is when it is not one."""

    mode: str
    forms: dict[str, Any]
    flow_steps: StepsUsed | None = None
    throughput_unit: str | None = None


# ------------------------------------------------------------- sections only the loop returns
@dataclass
class LoopProgress:
    """Steps done and the run's first and latest loss (a resumed run's first is its checkpoint's)."""

    steps: int = 0
    first_loss: float | None = None
    final_loss: float | None = None


@dataclass
class EvalResult:
    loss: float
    metrics: dict[str, float]


@dataclass
class Timing:
    throughput: Throughput
    compile: dict[str, Any]  # what compilation turned out to do (applied.compile: CUDA graphs, ...)


@dataclass
class MemoryPeak:
    peak_bytes: int | None
    source: str
    per_rank: list[dict[str, Any]] | None = None  # a distributed run's peaks, rank by rank
    peak_rss_bytes: int | None = None  # the largest rank's RSS peak (a distributed run)


Section = (LoopProgress | EvalResult | Timing | MemoryPeak | OomRecord | MachineSpeed | ProfileRecord
           | EarlyStoppingRecord | SpikeRecord | TimeBudgetRecord | CheckpointRecord | StopRecord | TaskRecord)
