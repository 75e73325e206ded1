"""Step timing: the timed steps (warm-up and steps other components claim excluded), their median
and spread, tokens/s, MFU against the named peak, the data wait, compile time, and the page faults
of a step (the process's minor faults over the step: memory the allocator handed back to the kernel
and touched again; on a CPU a cost the predicted step does not price, docs/estimate-speed.md)."""

from __future__ import annotations

import contextlib
import statistics
from collections.abc import Iterator

from optbench.measure import minor_faults, spread
from optbench.run.loop import Component, RunContext, StepState
from optbench.summary import StepTimes, Throughput, Timing
from optbench.training.compile import CompileTimer


class StepTiming(Component):
    def __init__(self, ctx: RunContext) -> None:
        self.ctx = ctx
        self.compile_timer: CompileTimer | None = None
        self.step_times: list[float] = []
        self.data_waits: list[float] = []
        self.step_faults: list[int] = []

    def start(self) -> None:
        cfg = self.ctx.cfg  # Dynamo's counters from here: compilation happens in the steps
        self.compile_timer = CompileTimer(enabled=cfg.compile.name != "none" or cfg.attention.name == "flex")

    @contextlib.contextmanager
    def around_step(self, step: int, *, timed: bool) -> Iterator[None]:
        assert self.compile_timer is not None, "StepTiming.start() comes before the steps"
        before = minor_faults()
        with self.compile_timer.step(timed):
            yield
        if timed:
            self.step_faults.append(minor_faults() - before)

    def on_step(self, state: StepState) -> None:
        if state.timed:
            self.step_times.append(state.elapsed_s)
            self.data_waits.append(state.stats.data_wait_s)

    def finish(self, *, ranks_agree: bool) -> Timing | None:
        if self.compile_timer is None:
            return None
        ctx = self.ctx
        throughput = Throughput(
            tokens_per_step=ctx.tokens_per_step, warmup_steps=ctx.cfg.measure.warmup_steps,
            timed_steps=len(self.step_times), step_times_s=self.step_times,
            peak_flops=ctx.peak.flops, peak_source=ctx.peak.source, compile_s=self.compile_timer.total(),
        )
        if self.step_times:
            stats = spread(self.step_times)
            throughput.step_time_s = StepTimes(median=stats["median"], p10=stats["p10"], p90=stats["p90"],
                                               mean=stats["mean"])
            throughput.tokens_per_s = ctx.tokens_per_step / stats["median"]
            throughput.tokens_per_s_mean = ctx.tokens_per_step * len(self.step_times) / sum(self.step_times)
            throughput.mfu = ctx.mfu(throughput.tokens_per_s)
            throughput.data_wait_frac = sum(self.data_waits) / sum(self.step_times)
        if self.step_faults:
            throughput.page_faults_per_step = statistics.median(self.step_faults)
        return Timing(throughput=throughput, compile=self.compile_timer.describe(ctx.device))
