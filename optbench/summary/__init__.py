"""summary.json, typed: ``RunSummary`` is the one definition of what a run records (its sections are
in ``parts``, all importable from here), and this package the only place that turns it into a dict
or reads it back.

``optbench.run.train`` fills in the run (config, device, model, what was applied, how it ended) and
each loop component returns its own section from ``finish`` (``Timing``, ``MemoryPeak``,
``EvalResult``, ``CheckpointRecord``, ...), which ``RunSummary.add`` puts in its place. ``to_dict``
is the file's content (the field names below are its keys, in their order; ``optbench.outputs``
writes it atomically); ``read_run_summary`` reads one back for ``optbench report``, ``compare``,
``validate``, a sweep that skips finished jobs, a re-run that keeps a finished run, and the launcher
of local workers (rank 0's).

A field made with ``_optional()`` is left out of the dict while it is None (a section only some runs
have: ``profile``, ``stopping``, ``stop``, ``memory.oom``, a fused model's FLOPs); every other field
is always there, ``null`` where not measured.

``schema_version`` (``SCHEMA_VERSION``) says which layout a file has. A summary written before it
(no ``schema_version``: version 0) is read through ``UPGRADES`` (its time budget in minutes becomes
``time_limit_s``); a key the record lacks was added since and reads as its default (None). A key
the record has no field for, or a newer ``schema_version``, is refused with one line
(``SummaryError``): a record cannot hold what it has no field for, and dropping it would be silent.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from optbench.errors import ConfigError
from optbench.files import timestamp
from optbench.provenance import provenance
from optbench.summary.parts import (
    CheckpointRecord,
    EarlyStoppingRecord,
    EvalResult,
    LoopProgress,
    Loss,
    MachineSpeed,
    Memory,
    MemoryPeak,
    Model,
    OomRecord,
    ProfileRecord,
    Section,
    SpikeRecord,
    StepsUsed,
    StepTimes,
    Stopping,
    StopRecord,
    TaskRecord,
    Throughput,
    TimeBudgetRecord,
    Timing,
    _optional,
    versions,
)

__all__ = [
    "SCHEMA_VERSION", "UPGRADES", "CheckpointRecord", "EarlyStoppingRecord", "EvalResult", "LoopProgress", "Loss",
    "MachineSpeed", "Memory", "MemoryPeak", "Model", "OomRecord", "ProfileRecord", "RunSummary", "Section",
    "SpikeRecord", "StepTimes", "StepsUsed", "StopRecord", "Stopping", "SummaryError", "TaskRecord", "Throughput",
    "TimeBudgetRecord", "Timing", "read_run_summary", "recorded_steps", "summary_or_reason", "unreadable_summary",
    "versions",
]

# 2: provenance (optbench's commit, the packages, GPU and CPU) recorded; 1: schema_version written;
# 0 (no key): every summary written before it
SCHEMA_VERSION = 2


class SummaryError(ConfigError):
    """A summary.json that cannot be read as a ``RunSummary``; the message is one line naming the file:
    ``reason`` (why), then ``advice`` (what a reader of runs does about it: one of the ``*_ADVICE``).
    ``reason`` alone is what a writer says when it will not replace the file (``summary_or_reason``)."""

    def __init__(self, reason: str, advice: str = "") -> None:
        super().__init__(reason + advice)
        self.reason = reason


RERUN_ADVICE = "; rerun that run or leave its directory out"
NEWER_ADVICE = ": read it with a newer optbench, or leave its directory out"
WRITER_ADVICE = ": read it with the optbench that wrote it, or leave its directory out"


# ------------------------------------------------------------------------------------ the run
@dataclass
class RunSummary:
    schema_version: int = SCHEMA_VERSION
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
    provenance: dict[str, Any] | None = field(default_factory=provenance)  # optbench.provenance: commit, packages, GPU, CPU
    started_at: str | None = field(default_factory=timestamp)
    finished_at: str | None = None
    profile: ProfileRecord | None = _optional()
    stopping: Stopping | None = _optional()
    stop: StopRecord | None = _optional()

    # ------------------------------------------------------------- what the run fills in, in order
    def set_config(self, config: dict[str, Any], config_hash: str) -> None:
        """The resolved config and its hash (``optbench.outputs.config_hash``)."""
        self.config, self.config_hash = config, config_hash

    def set_machine(self, device: str, world_size: int) -> None:
        self.device, self.world_size = device, world_size

    def set_estimate(self, estimate_bytes: int | None) -> None:
        """``memory.estimate_bytes``: the peak ``optbench estimate`` traced for this run, before it ran."""
        self.memory.estimate_bytes = estimate_bytes

    def set_model(self, model: Model, applied: dict[str, Any]) -> None:
        """What was built: the model's sizes and every optimization's ``applied`` record."""
        self.model, self.applied = model, applied

    def set_applied(self, key: str, value: Any) -> None:
        """One more ``applied`` record, known after the model (the loader's ``dataloader``)."""
        self.applied[key] = value

    def end(self, status: str, error: str | None = None) -> None:
        """How the run ended: ``status`` and the one line saying why when it did not complete."""
        self.status, self.error = status, error

    def close(self, *, wall_s: float, peak_rss_bytes: int) -> None:
        """The run's wall time, end time and process RSS peak (the largest of this process and, in a
        distributed run, of every rank: ``MemoryPeak``)."""
        self.wall_s, self.finished_at = wall_s, timestamp()
        self.memory.peak_rss_bytes = max(peak_rss_bytes, self.memory.peak_rss_bytes or 0)

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
            case CheckpointRecord():
                self.applied["checkpoint"] = dataclasses.asdict(section)
            case TaskRecord():
                self.applied["task"] = dataclasses.asdict(section)
            case StopRecord():
                self.stop = section
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

    # ------------------------------------------------------------------------------ read back
    @property
    def predicted_step_time_s(self) -> Any:
        """The step time ``optbench.estimate`` predicted before the loop (None: no prediction)."""
        return self.predicted.get("step_time_s") if isinstance(self.predicted, dict) else None

    @property
    def checkpoint(self) -> CheckpointRecord | None:
        """``applied.checkpoint``, typed (None: a run that stopped before its checkpoints were planned)."""
        return _checkpoint_of(self.applied, "summary.json")

    @property
    def task_record(self) -> TaskRecord | None:
        """``applied.task``, typed (None: a task that records nothing, task=energy_flow's only)."""
        return _task_of(self.applied, "summary.json")

    def to_dict(self) -> dict[str, Any]:
        """summary.json's content (NaN and infinities stay floats: the writer spells them)."""
        return _to_dict(self)

    @classmethod
    def from_dict(cls, data: Any, *, where: str = "summary.json") -> RunSummary:
        """A record from ``data`` (a summary.json's content, of any schema version up to this one's);
        SummaryError, one line starting with ``where``, when it is not one."""
        if not isinstance(data, dict) or "status" not in data:
            raise SummaryError(f"{where} is not an optbench summary (it has no status)", RERUN_ADVICE)
        version = data.get("schema_version", 0)
        if isinstance(version, bool) or not isinstance(version, int) or not 0 <= version <= SCHEMA_VERSION:
            raise SummaryError(f"{where} has schema_version {version!r}, which this optbench does not read (it "
                               f"reads 0 to {SCHEMA_VERSION})", NEWER_ADVICE)
        for older in range(version, SCHEMA_VERSION):
            data = UPGRADES[older](data)
        record = _from_dict(cls, {**data, "schema_version": SCHEMA_VERSION}, where)
        _checkpoint_of(record.applied, where)  # one that is not a CheckpointRecord is refused here, not later
        _task_of(record.applied, where)  # nor a TaskRecord
        return record


def _checkpoint_of(applied: Any, where: str) -> CheckpointRecord | None:
    value = applied.get("checkpoint") if isinstance(applied, dict) else None
    return _from_dict(CheckpointRecord, value, where, "applied.checkpoint.") if isinstance(value, dict) else None


def _task_of(applied: Any, where: str) -> TaskRecord | None:
    value = applied.get("task") if isinstance(applied, dict) else None
    return _from_dict(TaskRecord, value, where, "applied.task.") if isinstance(value, dict) else None


def _upgrade_from_0(data: dict[str, Any]) -> dict[str, Any]:
    """Version 0 -> 1: the time budget was ``max_minutes`` (minutes) before the config renames."""
    budget = (data.get("stopping") or {}).get("time_budget") if isinstance(data.get("stopping"), dict) else None
    if not isinstance(budget, dict) or "max_minutes" not in budget:
        return data
    rest = {k: v for k, v in budget.items() if k != "max_minutes"}
    minutes = budget["max_minutes"]
    seconds = minutes * 60 if isinstance(minutes, (int, float)) and not isinstance(minutes, bool) else minutes
    return {**data, "stopping": {**data["stopping"], "time_budget": {"time_limit_s": seconds, **rest}}}


def _upgrade_from_1(data: dict[str, Any]) -> dict[str, Any]:
    """Version 1 -> 2: ``provenance`` is new; a summary written before it has none (it reads as null,
    never as this machine's)."""
    return data


UPGRADES = {0: _upgrade_from_0, 1: _upgrade_from_1}  # version -> what turns a summary of it into the next version's


# ---------------------------------------------------------------------------------- the file
def read_run_summary(run_dir: str | Path) -> RunSummary:
    """The record in ``run_dir``/summary.json; SummaryError (one line naming the file and the fix) when
    it is missing, cannot be read, is not JSON or not a summary this optbench reads."""
    path = Path(run_dir) / "summary.json"
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise SummaryError(f"{path} is not valid JSON ({exc.msg}, line {exc.lineno}): the summary is truncated "
                           "or corrupt", RERUN_ADVICE) from None
    except (OSError, UnicodeDecodeError) as exc:
        why = exc.strerror if isinstance(exc, OSError) else "not UTF-8 text"
        raise SummaryError(f"cannot read {path}: {why}", RERUN_ADVICE) from None
    return RunSummary.from_dict(data, where=str(path))


def summary_or_reason(run_dir: str | Path) -> tuple[RunSummary | None, str | None]:
    """The summary.json in ``run_dir`` read once: (its record, None); (None, why it cannot be read:
    truncated, not JSON, not a summary, of a newer schema); (None, None) when there is none. What an
    unreadable one recorded is unknown: possibly a finished run, which nothing may train over
    (``optbench.run.rerun``) or write over."""
    if not (Path(run_dir) / "summary.json").is_file():  # a directory there is refused as in the way
        return None, None
    try:
        return read_run_summary(run_dir), None
    except SummaryError as exc:
        return None, exc.reason  # without what a reader of runs is told to do


def unreadable_summary(run_dir: str | Path) -> str | None:
    """Why the summary.json in ``run_dir`` cannot be read, or None (``summary_or_reason``)."""
    return summary_or_reason(run_dir)[1]


def recorded_steps(run_dir: str | Path) -> int:
    """Steps the summary in ``run_dir`` records as trained; 0 when there is none or it cannot be read.
    Only ``steps`` is looked at: a summary of a newer schema, which ``read_run_summary`` refuses,
    still protects the steps it records (``optbench.outputs.RunOutputs``)."""
    try:
        data = json.loads((Path(run_dir) / "summary.json").read_text())
    except (OSError, ValueError):
        return 0
    steps = data.get("steps") if isinstance(data, dict) else None
    return steps if isinstance(steps, int) and not isinstance(steps, bool) else 0


def _to_dict(obj: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if value is None and f.metadata.get("omit_none"):
            continue
        out[f.name] = _to_dict(value) if dataclasses.is_dataclass(value) else value
    return out


@functools.cache
def _fields(cls: type) -> dict[str, tuple[type | None, Any, bool]]:
    """``cls``'s fields: name -> (the dataclass its value is, if any; the field; whether None is one
    of its values)."""
    hints = typing.get_type_hints(cls)
    out = {}
    for f in dataclasses.fields(cls):
        section = next((t for t in (hints[f.name], *typing.get_args(hints[f.name])) if dataclasses.is_dataclass(t)),
                       None)
        out[f.name] = (section, f, type(None) in typing.get_args(hints[f.name]))
    return out


def _default(f: dataclasses.Field) -> Any:
    """The value a key missing from a summary reads as: its field's default; None where that default is
    what this process would record now (``versions``, ``provenance``, ``started_at``), not what that run recorded."""
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is dataclasses.MISSING or f.default_factory in (versions, provenance, timestamp):
        return None
    return f.default_factory()


def _from_dict(cls: type, data: dict[str, Any], where: str, prefix: str = "") -> Any:
    """``cls`` from its dict: a missing key reads as the field's default (None for a section's own
    fields: added since), a key it has no field for is refused (written by another version)."""
    fields = _fields(cls)
    unknown = sorted(set(data) - set(fields))
    if unknown:
        names = ", ".join(prefix + name for name in unknown)
        raise SummaryError(f"{where}: {names} is no field of summary.json (schema_version {SCHEMA_VERSION}; written "
                           "by another optbench?)", WRITER_ADVICE)
    values = {}
    for name, (section, f, nullable) in fields.items():
        if name not in data:
            values[name] = _default(f)
            continue
        value = data[name]
        if section is not None and isinstance(value, dict):
            value = _from_dict(section, value, where, f"{prefix}{name}.")
        elif section is not None and (value is not None or not nullable):
            raise SummaryError(f"{where}: {prefix}{name} is {json.dumps(value)[:40]}, not an object: not an optbench "
                               "summary (edited by hand?)", RERUN_ADVICE)
        values[name] = value
    return cls(**values)
