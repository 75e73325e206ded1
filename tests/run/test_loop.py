"""The loop's shape: the typed summary writes the summary.json contract and reads it back, each
component returns its own section, components do nothing until ``start`` (and only the enabled ones
are built), and ``finish`` follows every ``start``, last started first."""

from __future__ import annotations

import mmap
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from optbench import summary as sections
from optbench.checkpoint import Manager, Plan
from optbench.config import to_config
from optbench.errors import ConfigError
from optbench.measure import Peak
from optbench.run.loop import Component, RunContext, run_loop
from optbench.run.train import loop_components
from optbench.summary import RunSummary
from tests.helpers import FAST, compose_cfg


def test_a_fresh_record_writes_every_field_null_where_not_measured():
    written = RunSummary(overrides=["model=tiny"]).to_dict()
    assert list(written)[:4] == ["schema_version", "status", "error", "overrides"]
    assert written["schema_version"] == sections.SCHEMA_VERSION and written["status"] == "failed"
    assert written["throughput"]["step_time_s"] == {"median": None, "p10": None, "p90": None}
    assert written["model"]["params"] is None and written["loss"]["eval_metrics"] is None
    assert written["steps"] == 0 and written["world_size"] == 1 and written["versions"]["torch"]


def _every_section() -> list:
    throughput = sections.Throughput(tokens_per_s=10.0, tokens_per_step=4, timed_steps=1, step_times_s=[0.4],
                                     step_time_s=sections.StepTimes(median=0.4, p10=0.4, p90=0.4, mean=0.4))
    return [
        sections.LoopProgress(steps=3, first_loss=2.0, final_loss=1.5),
        sections.EvalResult(loss=1.4, metrics={"nrmse/temperature": 0.5}),
        sections.Timing(throughput=throughput, compile={"graphs": 2}),
        sections.MemoryPeak(peak_bytes=7, source="test", per_rank=[{"peak_bytes": 7, "peak_rss_bytes": 9}] * 2,
                            peak_rss_bytes=9),
        sections.OomRecord(step=2, allocated_bytes=1, reserved_bytes=2, max_allocated_bytes=3, capacity_bytes=4,
                           estimate_bytes=5, advice="smaller"),
        sections.MachineSpeed(before={"flops": 1.0}, after={"flops": 2.0}, moved=1.0),
        sections.ProfileRecord(dir="p", steps=[2], warmup_steps=[1], excluded_steps=[1, 2], excluded_from_timing=True,
                               traces=[], top_ops=[], memory_snapshot=None),
        sections.EarlyStoppingRecord(metric="loss", mode="min", patience=1, min_delta=0.0, best=1.4, best_step=3,
                                     evals_without_improvement=0, stopped_at_step=None),
        sections.SpikeRecord(factor=3.0, window=4, action="skip", skipped_steps=[], events=[]),
        sections.TimeBudgetRecord(time_limit_s=60.0, loop_s=2.0, stopped_at_step=None),
        sections.CheckpointRecord(name="every_2", dir="c", save_every=2, keep_last=0, resumed_from=None,
                                  resumed_step=None, saved=["step-00000002"], skipped=[], config_changes=[]),
    ]


def test_each_section_lands_where_the_contract_says_and_reads_back():
    record = RunSummary(applied={"compile": {"mode": "off"}})
    record.add(*_every_section(), None)
    written = record.to_dict()
    assert written["steps"] == 3 and written["loss"] == {"first": 2.0, "final": 1.5, "eval": 1.4,
                                                         "eval_metrics": {"nrmse/temperature": 0.5}}
    assert written["throughput"]["tokens_per_s"] == 10.0 and written["applied"]["compile"] == {"mode": "off",
                                                                                                "graphs": 2}
    assert written["memory"]["peak_source"] == "test" and written["memory"]["peak_rss_bytes"] == 9
    assert written["memory"]["oom"]["advice"] == "smaller" and written["machine_speed"]["moved"] == 1.0
    assert list(written["stopping"]) == ["early", "spikes", "time_budget"] and written["profile"]["steps"] == [2]
    assert written["applied"]["checkpoint"]["saved"] == ["step-00000002"]
    assert RunSummary.from_dict(written).to_dict() == written
    with pytest.raises(TypeError, match="no place in summary.json"):
        record.add(object())
    with pytest.raises(ValueError, match="memory.peek_bytes is no field of summary.json"):
        RunSummary.from_dict({**written, "memory": {"peek_bytes": 1}})


def test_sections_only_some_runs_have_are_left_out_until_they_exist():
    written = RunSummary().to_dict()
    assert not {"profile", "stopping", "stop"} & set(written) and "oom" not in written["memory"]
    assert "frozen_share" not in written["model"]


# ------------------------------------------------------------------------------------ lifecycle
def _context(tmp_path: Path, overrides: list[str]) -> RunContext:
    cfg = to_config(compose_cfg([*FAST, *overrides]))
    return RunContext(cfg=cfg, model=torch.nn.Linear(2, 2), task=None, optimizer=None, scheduler=None, scaler=None,
                      device=torch.device("cpu"), outputs=SimpleNamespace(run_dir=tmp_path), world_size=1,
                      tokens_per_step=1, flops_per_token=1, peak=Peak(None, "none"))


def _built(tmp_path: Path, overrides: list[str]) -> list[Component]:
    ctx = _context(tmp_path, overrides)
    manager = Manager(Plan(tmp_path / "checkpoints", None), cfg=ctx.cfg, config={}, config_hash="h",
                      model=ctx.model, optimizer=None, scheduler=None, scaler=None)
    return loop_components(ctx, record=RunSummary(), checkpoint_manager=manager, eval_batches=[])


def test_only_enabled_components_are_built_and_building_them_does_nothing(tmp_path, monkeypatch):
    import optbench.run.loop.machine_speed as machine_speed

    probes = []
    monkeypatch.setattr(machine_speed, "machine_speed_probe", lambda device: probes.append(device))
    threads = threading.active_count()
    names = [type(c).__name__ for c in _built(tmp_path, [])]
    assert names == ["Watchdog", "MachineSpeedProbe", "OomGuard", "MemoryProbe", "StepTiming", "MetricsLog",
                     "Evaluation", "CheckpointSaver"]
    every = _built(tmp_path, ["profile=trace", "train.steps=8", "stopping=plateau", "train.eval_every=2",
                              "stopping.spike_factor=3", "run.time_limit_s=300"])
    assert {"Profiler", "EarlyStopping", "LossSpikeGuard", "TimeBudget"} <= {type(c).__name__ for c in every}
    # nothing but assignment: no probe, no thread, no profile directory, no progress bar
    assert probes == [] and threading.active_count() == threads and not (tmp_path / "profile").exists()
    assert next(c for c in every if type(c).__name__ == "MetricsLog").bar is None


class _Recorder(Component):
    def __init__(self, name: str, calls: list[str], *, fails_to_start: bool = False) -> None:
        self.name, self.calls, self.fails_to_start = name, calls, fails_to_start

    def start(self) -> None:
        self.calls.append(f"{self.name}.start")
        if self.fails_to_start:
            raise ConfigError(f"{self.name} cannot start")

    def finish(self, *, ranks_agree: bool) -> sections.EvalResult:
        self.calls.append(f"{self.name}.finish")
        return sections.EvalResult(loss=float(len(self.calls)), metrics={"by": self.name})


def test_finish_follows_every_start_last_started_first(tmp_path):
    calls: list[str] = []
    components = [_Recorder("a", calls), _Recorder("b", calls, fails_to_start=True), _Recorder("c", calls)]
    record = RunSummary()
    with pytest.raises(ConfigError, match="b cannot start"):
        run_loop(_context(tmp_path, []), batches=[], components=components, record=record)
    assert calls == ["a.start", "b.start", "b.finish", "a.finish"]  # c never started: nothing to finish
    assert record.loss.eval_metrics == {"by": "a"}  # every section recorded, a's last


def test_the_watchdog_thread_ends_when_the_run_finishes_not_at_its_next_poll(monkeypatch):
    """Every run's end waited for the watchdog's next poll (half a second per run, per sweep job)."""
    from optbench.run.loop import watchdog

    monkeypatch.setattr(watchdog, "POLL_S", 60.0)
    ctx = SimpleNamespace(cfg=SimpleNamespace(run=SimpleNamespace(stop_timeout_s=5.0)))
    dog = watchdog.Watchdog(ctx, record=None, checkpoint_manager=None, exit=lambda code: None)
    dog.start()
    assert dog.thread is not None and dog.thread.is_alive()
    join, alive_after_join = dog.thread.join, []

    def recorded_join(timeout=None):  # finish joins for at most 1 s, then closes the pipe
        join(timeout)
        alive_after_join.append(dog.thread.is_alive())

    dog.thread.join = recorded_join
    dog.finish(ranks_agree=True)
    assert alive_after_join == [False]


def test_a_timed_steps_page_faults_are_counted_and_an_untimed_ones_are_not(tmp_path):
    """``throughput.page_faults_per_step``: the minor faults of the timed steps (median): memory
    mapped afresh and touched in a step is counted; a warm-up step's faults are not."""
    from optbench.run.loop.timing import StepTiming

    timing = StepTiming(_context(tmp_path, []))
    timing.start()
    pages = 1024

    def touch_fresh_pages() -> None:
        with mmap.mmap(-1, pages * mmap.PAGESIZE) as region:
            torch.frombuffer(region, dtype=torch.uint8)[::mmap.PAGESIZE].fill_(1)

    with timing.around_step(0, timed=False):
        touch_fresh_pages()
        touch_fresh_pages()
    for step in (1, 2, 3):
        with timing.around_step(step, timed=True):
            touch_fresh_pages()
        timing.on_step(SimpleNamespace(timed=True, elapsed_s=0.1, stats=SimpleNamespace(data_wait_s=0.0)))
    throughput = timing.finish(ranks_agree=True).throughput
    assert len(timing.step_faults) == 3
    assert pages <= throughput.page_faults_per_step < 2 * pages  # one fault a page, the untimed step left out


def test_the_memory_probe_keeps_memtrackers_global_peak_without_each_modules_own():
    """The CPU probe's tracker skips the per-module local peaks torch's MemTracker updates on every op
    (the probe never reads them): on the same step of two identically built models, the peak snapshot
    is torch's own, key for key and byte for byte."""
    from torch.distributed._tools.mem_tracker import MemTracker

    from optbench.model.fusion import frozen_tolerant
    from optbench.optim.optimizers import build_optimizer
    from optbench.run.loop.memory import cpu_memory_tracker
    from optbench.tasks import build_task
    from optbench.training.build import build_model, materialize
    from optbench.training.step import StepContext, StepHooks, train_step

    cfg = to_config(compose_cfg([*FAST, "train.grad_accum=2"]))
    task, cpu = build_task(cfg), torch.device("cpu")
    peaks, local = {}, {}
    for kind in ("torch", "probe"):
        model = build_model(cfg, task)
        materialize(model, device=cpu, seed=0)
        optimizer = build_optimizer(model, cfg=cfg.optimizer, lr=1e-3)
        if kind == "torch":
            tracker = frozen_tolerant(MemTracker)()
            tracker.track_external(model, optimizer)
        else:
            tracker = cpu_memory_tracker(model, optimizer)
        torch.manual_seed(1)
        batches = iter(lambda: task.example_batch(4), None)
        with tracker:
            ctx = StepContext(model=model, task=task, cfg=cfg, device=cpu, optimizer=optimizer)
            train_step(ctx, batches, step=0, with_aux=True, hooks=StepHooks(between_micro_steps=(tracker.reset_mod_stats,)))
        peaks[kind] = tracker.get_tracker_snapshot("peak")
        local[kind] = sum(stats.local_peak.get(cpu, 0) for stats in tracker.memory_tracking.values())
    assert peaks["probe"] == peaks["torch"] and peaks["torch"][cpu]["Total"] > 0
    assert local["torch"] > local["probe"]  # torch's grow op by op; the probe's stay where the hooks set them
