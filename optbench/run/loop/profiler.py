"""The profiler (``profile=trace``): torch.profiler over a wait/warmup/active schedule of steps.

Traces go to ``<run dir>/profile/`` through torch's TensorBoard trace handler (``*.pt.trace.json``,
Chrome trace format: TensorBoard's profiler view, ui.perfetto.dev and chrome://tracing open them);
the top operators by self time (device time on CUDA, CPU time otherwise) go to the log and to
``summary.json`` (``profile.top_ops``). The warm-up and recorded steps are left out of the timed
steps, because profiling slows them (``profile.steps`` names them). On rank 0 only unless
``profile.ranks=all``. ``profile.memory_snapshot`` (CUDA) records the caching allocator's history
from the first step and dumps it (``memory_snapshot.pickle``, for pytorch.org/memory_viz) when the
loop ends, also when it ends by running out of memory.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from optbench.distributed import env_rank
from optbench.errors import ConfigError
from optbench.run.loop import Component, RunContext, StepState
from optbench.summary import ProfileRecord
from optbench.training.preflight import profile_window, profile_window_error

log = logging.getLogger(__name__)


class Profiler(Component):
    """Built only for ``profile.enabled`` (its steps are left out of the timing on every rank); it
    records on rank 0, or every rank with ``profile.ranks=all``."""

    def __init__(self, ctx: RunContext) -> None:
        self.ctx = ctx
        self.cfg = ctx.cfg.profile
        self.dir = Path(ctx.outputs.run_dir) / "profile"
        self.on = self.cfg.ranks == "all" or env_rank() == 0
        self.recorded = profile_window(self.cfg, start=ctx.start)  # warm-up and active steps
        self.prof: torch.profiler.profile | None = None
        self.top: list[dict[str, Any]] = []
        self.snapshot: Path | None = None
        self.recording_memory = False

    def start(self) -> None:
        """Check the window against a resumed run's steps (preflight checked it from step 0), then
        start recording (profile.memory_snapshot on CUDA only: preflight's rule)."""
        cfg, ctx = self.cfg, self.ctx
        message = profile_window_error(cfg, start=ctx.start, steps=ctx.total, warmup_steps=ctx.cfg.measure.warmup_steps)
        if message:
            raise ConfigError(message)
        if not self.on:
            return
        self.dir.mkdir(parents=True, exist_ok=True)
        activities = [torch.profiler.ProfilerActivity.CPU]
        if ctx.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        if cfg.memory_snapshot:
            torch.cuda.memory._record_memory_history(max_entries=100_000)
            self.recording_memory = True
        self.prof = torch.profiler.profile(
            activities=activities,
            schedule=torch.profiler.schedule(skip_first=cfg.skip_first, wait=cfg.wait, warmup=cfg.warmup,
                                             active=cfg.active, repeat=1),
            on_trace_ready=torch.profiler.tensorboard_trace_handler(str(self.dir), worker_name=f"rank{env_rank()}"),
            record_shapes=cfg.record_shapes, profile_memory=cfg.profile_memory, with_stack=cfg.with_stack,
        )
        self.prof.start()

    def excludes(self, step: int) -> bool:  # on every rank: a profiled rank slows the others too
        return step in self.recorded

    def on_step(self, state: StepState) -> None:
        if self.prof is not None:
            self.prof.step()

    def _top_ops(self) -> list[dict[str, Any]]:
        assert self.prof is not None
        cuda = self.ctx.device.type == "cuda"
        key = "self_device_time_total" if cuda else "self_cpu_time_total"
        # operators only: the schedule's ProfilerStep#N region (and any record_function region) is a
        # user annotation whose device "self" time is the whole step's kernels (seen on an H200)
        averages = self.prof.key_averages()
        averages[:] = [e for e in averages if not _annotation(e)]  # in place: it keeps its table settings
        log.info("profiler: top operators by self %s time\n%s", "device" if cuda else "CPU",
                 averages.table(sort_by=key, row_limit=self.cfg.top_ops))
        rows = sorted(averages, key=lambda e: getattr(e, key), reverse=True)[: self.cfg.top_ops]
        return [{"name": e.key, "calls": e.count, "self_us": getattr(e, key),
                 "self_cpu_us": e.self_cpu_time_total} for e in rows]

    def finish(self, *, ranks_agree: bool) -> ProfileRecord:
        if self.prof is not None:
            complete = self.ctx.progress.steps >= self.recorded.stop
            self.prof.stop()  # a schedule cut short is flushed here
            if self.prof.profiler is not None and self.prof.profiler.function_events is not None:
                self.top = self._top_ops()
            if not complete:
                log.warning("profiler: the run ended before the last recorded step %d", self.recorded.stop)
        if self.recording_memory:
            self.snapshot = self.dir / f"memory_snapshot_rank{env_rank()}.pickle"
            torch.cuda.memory._dump_snapshot(str(self.snapshot))
            torch.cuda.memory._record_memory_history(enabled=None)
        recorded = list(self.recorded)
        return ProfileRecord(
            dir=str(self.dir) if self.on else None,
            # 0-based step indices, as metrics.jsonl: the recorded (active) steps, the profiler's
            # warm-up steps before them, and both, which are left out of the timed steps
            steps=recorded[self.cfg.warmup:], warmup_steps=recorded[:self.cfg.warmup], excluded_steps=recorded,
            excluded_from_timing=True,
            traces=sorted(p.name for p in self.dir.glob("*.pt.trace.json*")) if self.on else [],
            top_ops=self.top, memory_snapshot=str(self.snapshot) if self.snapshot else None,
        )


def _annotation(event: Any) -> bool:
    return bool(getattr(event, "is_user_annotation", False)) or str(event.key).startswith("ProfilerStep")
