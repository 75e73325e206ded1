"""summary.json, typed. ``RunSummary`` is what one run records: ``optbench.run.train`` fills in the
run (config, device, model, what was applied, how it ended) and each loop component returns its own
section from ``finish`` (``Timing``, ``MemoryPeak``, ``EvalResult``, ...), which ``RunSummary.add``
puts in its place. ``to_dict`` writes the contract of ``optbench.outputs.SUMMARY_FIELDS`` (the field
names below are its keys, in its order); ``from_dict`` reads one back (rank 0's, in the process that
launched the workers). Logic never reads the summary: what it needs is in ``RunContext``
(``optbench.run.loop``).

A field made with ``_optional()`` is left out of the dict while it is None (a section only some runs
have: ``profile``, ``stopping``, ``memory.oom``, a fused model's FLOPs); every other field is always
there, ``null`` where not measured.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from typing import Any

from optbench.checkpoint import Record as CheckpointRecord
from optbench.files import timestamp
from optbench.outputs import versions


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
    # a fused model's (optbench.training.fused.describe_fused_model)
    frozen_share: float | None = _optional()
    forward_flops_per_token: int | None = _optional()
    flops_source: str | None = _optional()
    hf: dict[str, Any] | None = _optional()  # model=hf: what transformers built (optbench.model.hf.describe_hf_model)


@dataclass
class Throughput:
    tokens_per_s: float | None = None  # at the median step time
    tokens_per_s_mean: float | None = None
    tokens_per_step: int | None = None
    step_time_s: dict[str, float | None] = field(default_factory=lambda: dict.fromkeys(("median", "p10", "p90")))
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


@dataclass
class TaskRecord:
    """What the task recorded over the training steps (``Task.run_record``; task=energy_flow: the
    forms run and the flow steps used): ``applied.task``."""

    values: dict[str, Any]


Section = (TaskRecord | LoopProgress | EvalResult | Timing | MemoryPeak | OomRecord | MachineSpeed | ProfileRecord
           | EarlyStoppingRecord | SpikeRecord | TimeBudgetRecord | CheckpointRecord)


# ------------------------------------------------------------------------------------ the run
@dataclass
class RunSummary:
    status: str = "failed"
    error: str | None = None
    overrides: list[str] = field(default_factory=list)
    config_hash: str | None = None
    config: dict[str, Any] | None = None
    applied: dict[str, Any] = field(default_factory=dict)  # what each optimization really did, read back
    task: str | None = None
    model: Model = field(default_factory=Model)
    throughput: Throughput = field(default_factory=Throughput)
    memory: Memory = field(default_factory=Memory)
    predicted: dict[str, Any] | None = None  # optbench.estimate's prediction of the step, made before it ran
    loss: Loss = field(default_factory=Loss)
    machine_speed: MachineSpeed = field(default_factory=MachineSpeed)
    steps: int = 0
    wall_s: float | None = None
    device: str | None = None
    world_size: int = 1
    versions: dict[str, Any] = field(default_factory=versions)
    started_at: str = field(default_factory=timestamp)
    finished_at: str | None = None
    profile: ProfileRecord | None = _optional()
    stopping: Stopping | None = _optional()
    stop: StopRecord | None = _optional()

    def add(self, *sections: Section | None) -> None:
        """Put each section in its place (None: a component with nothing to say)."""
        for section in sections:
            self._place(section)

    def _place(self, section: Section | None) -> None:
        match section:
            case None:
                pass
            case LoopProgress():
                self.steps, self.loss.first, self.loss.final = section.steps, section.first_loss, section.final_loss
            case EvalResult():
                self.loss.eval, self.loss.eval_metrics = section.loss, section.metrics
            case Timing():
                self.throughput = section.throughput
                self.applied["compile"] = {**self.applied.get("compile", {}), **section.compile}
            case MemoryPeak():
                self.memory.peak_bytes, self.memory.peak_source = section.peak_bytes, section.source
                if section.per_rank is not None:
                    self.memory.per_rank, self.memory.peak_rss_bytes = section.per_rank, section.peak_rss_bytes
            case OomRecord():
                self.memory.oom = section
            case MachineSpeed():
                self.machine_speed = section
            case ProfileRecord():
                self.profile = section
            case EarlyStoppingRecord() | SpikeRecord() | TimeBudgetRecord():
                self._place_stopping(section)
            case TaskRecord():
                self.applied["task"] = section.values
            case CheckpointRecord():
                self.applied["checkpoint"] = dataclasses.asdict(section)
            case _:
                raise TypeError(f"no place in summary.json for a {type(section).__name__}")

    def _place_stopping(self, section: EarlyStoppingRecord | SpikeRecord | TimeBudgetRecord) -> None:
        self.stopping = self.stopping or Stopping()
        if isinstance(section, EarlyStoppingRecord):
            self.stopping.early = section
        elif isinstance(section, SpikeRecord):
            self.stopping.spikes = section
        else:
            self.stopping.time_budget = section

    def to_dict(self) -> dict[str, Any]:
        return _to_dict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RunSummary:
        return _from_dict(cls, data)


def _to_dict(obj: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if value is None and f.metadata.get("omit_none"):
            continue
        out[f.name] = _to_dict(value) if dataclasses.is_dataclass(value) else value
    return out


def _from_dict(cls: type, data: dict[str, Any]) -> Any:
    """``cls`` from its dict; a key it has no field for is an error (a summary from another version)."""
    hints = typing.get_type_hints(cls)
    unknown = set(data) - {f.name for f in dataclasses.fields(cls)}
    if unknown:
        raise ValueError(f"summary.json: {cls.__name__} has no field {', '.join(sorted(unknown))}")
    values = {}
    for name, value in data.items():
        section = next((t for t in (hints[name], *typing.get_args(hints[name])) if dataclasses.is_dataclass(t)), None)
        values[name] = _from_dict(section, value) if section is not None and isinstance(value, dict) else value
    return cls(**values)
