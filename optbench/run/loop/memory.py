"""The memory probe: on CUDA the allocator's peak over the run; on a CPU torch's MemTracker on the
real tensors of one step (the last warm-up step, or the first that computes the auxiliary loss when
``loss_freq`` skips it there, which is then left out of the timing), plus DDP's gradient buckets
where they were allocated before that step; per rank in a distributed run."""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import nn

from optbench.distributed import gather_objects
from optbench.measure import peak_rss_bytes
from optbench.model.fusion import frozen_tolerant
from optbench.run.loop import Component, RunContext, StepState
from optbench.summary import MemoryPeak
from optbench.training.data_parallel import ddp_buckets_outside, ddp_gradient_buckets, is_sharded


def memory_step(*, warmup: int, every: int) -> int:
    """The step MemTracker follows on CPU: the last warm-up step, or, when that step skips the
    auxiliary loss (loss_freq.every > 1), the next step that computes it, so the peak covers the
    run's heaviest kind of step (that step is then left out of the timing)."""
    step = max(warmup - 1, 0)
    while step % every:
        step += 1
    return step


def _untracked_reason(track_memory: bool, *, step: int, steps: int, warmup_end: int) -> str:
    """The peak's source until the tracked step has run (what a run that never reaches it says)."""
    if not track_memory:
        return "not measured (measure.track_memory=false)"
    which = "the last warm-up step" if step < warmup_end else "the first after the warm-up to compute the auxiliary loss"
    if step >= steps:
        return f"not measured (step {step}, {which}, is past the last step, {steps - 1})"
    return f"not measured (the run ended before step {step}, {which}, which it tracks)"


def cpu_memory_tracker(model: nn.Module, optimizer: torch.optim.Optimizer, *, compiled: bool = False) -> Any:
    if compiled:  # torch.compile runs eager under a dispatch mode: the profiler sees Inductor's buffers
        from optbench.measure import ProfiledPeak

        return ProfiledPeak(model, optimizer)
    if is_sharded(model):  # FSDP2: the tracker that knows sharded/unsharded parameters and gradients
        from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

        return global_peak_only(frozen_tolerant(FSDPMemTracker))(model, optimizer)
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = global_peak_only(frozen_tolerant(MemTracker))()
    tracker.track_external(model, optimizer)
    return tracker


def global_peak_only(tracker_class: type) -> type:
    """``tracker_class`` (a MemTracker) updating only the global peak on each op: the probe reads
    ``get_tracker_snapshot("peak")``, never a module's local peak, which torch's ``_update_peak_stats``
    also updates for every tracked module on every op (the estimate's tracer skips it too,
    optbench.estimate.memtrace). The global peak and its snapshot are kept exactly as torch keeps them."""
    def _update_peak_stats(self: Any, peak_state: Any) -> None:
        for dev, snap in self._curr_mem_snap.items():
            if self._peak_mem.get(dev, 0) < snap["Total"]:
                self._peak_mem[dev] = snap["Total"]
                self._peak_mem_snap[dev] = dict(snap)

    return type(tracker_class.__name__, (tracker_class,), {"_update_peak_stats": _update_peak_stats})


class MemoryProbe(Component):
    def __init__(self, ctx: RunContext) -> None:
        self.ctx = ctx
        train, measure = ctx.cfg.train, ctx.cfg.measure
        self.device = ctx.device
        self.step = memory_step(warmup=ctx.start + measure.warmup_steps, every=ctx.cfg.loss_freq.every)
        self.tracks = measure.track_memory and self.device.type == "cpu"
        self.tracker: Any = None
        self.buckets_before: tuple[int, bool] | None = None
        self.peak: int | None = None
        self.source = _untracked_reason(measure.track_memory, step=self.step, steps=train.steps,
                                        warmup_end=ctx.start + measure.warmup_steps)

    def start(self) -> None:
        """On CUDA the allocator's peak counts from here: after the machine-speed probe's operands
        (that probe brackets this component: it starts before and finishes after it)."""
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)

    def _tracked(self, step: int) -> bool:
        return self.tracks and step == self.step

    def excludes(self, step: int) -> bool:
        return self._tracked(step)

    def around_step(self, step: int, *, timed: bool) -> contextlib.AbstractContextManager:
        if not self._tracked(step):
            return contextlib.nullcontext()
        self.tracker = cpu_memory_tracker(self.ctx.model, self.ctx.optimizer,
                                          compiled=self.ctx.cfg.compile.name != "none")
        self.buckets_before = ddp_gradient_buckets(self.ctx.model)
        return self.tracker

    def between_micro_steps(self) -> None:
        if self.tracker is not None:
            self.tracker.reset_mod_stats()  # MemTracker allows one forward per module; the peak is kept

    def on_step(self, state: StepState) -> None:
        if self.tracker is None:
            return
        # DDP's gradient buckets exist through the step but, unless DDP built or rebuilt them in it
        # (steps 0 and 1), were allocated before it: the tracker never saw them; DDP says their size
        buckets = ddp_buckets_outside(self.buckets_before, ddp_gradient_buckets(self.ctx.model))
        self.peak = int(self.tracker.get_tracker_snapshot("peak")[self.device]["Total"]) + buckets
        self.ctx.outputs.log_scalars(state.step, {"memory/tracked_peak_bytes": float(self.peak)})
        warmup_end = self.ctx.start + self.ctx.cfg.measure.warmup_steps
        what = getattr(self.tracker, "source", f"torch {type(self.tracker).__name__} on real tensors")
        self.source = f"{what}, step {state.step} " + (
            "(a warm-up step)" if state.step < warmup_end
            else "(the first step computing the auxiliary loss, excluded from timing)") + (
            f" + DDP's gradient buckets, {buckets:,} bytes (allocated before the step)" if buckets else "")
        self.tracker = None

    def finish(self, *, ranks_agree: bool) -> MemoryPeak:
        peak, source = self.peak, self.source
        if self.device.type == "cuda":
            peak, source = torch.cuda.max_memory_allocated(self.device), "torch.cuda.max_memory_allocated"
        if ranks_agree:  # every rank's peak (memory.per_rank); the run's peak is the largest rank's
            per_rank = gather_objects({"peak_bytes": peak, "peak_rss_bytes": peak_rss_bytes()})
            if len(per_rank) > 1:
                peaks = [r["peak_bytes"] for r in per_rank if r["peak_bytes"] is not None]
                return MemoryPeak(peak_bytes=max(peaks) if peaks else None,
                                  source=f"{source}; largest of {len(per_rank)} ranks", per_rank=per_rank,
                                  peak_rss_bytes=max(r["peak_rss_bytes"] for r in per_rank))
        return MemoryPeak(peak_bytes=peak, source=source)
