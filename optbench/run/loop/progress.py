"""What a person watches: the progress bar (or log lines), metrics.jsonl and TensorBoard scalars,
every ``log.every`` steps and at the last."""

from __future__ import annotations

import logging
import sys

import torch

from optbench.distributed import env_rank
from optbench.measure import peak_rss_bytes
from optbench.run.loop import Component, RunContext, StepState
from optbench.summary import TaskRecord

log = logging.getLogger(__name__)


class ProgressBar:
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
                TextColumn("{task.completed}/{task.total} steps"),
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
            # "step" is the 0-based index everywhere (metrics.jsonl, TensorBoard, errors); the count is a count
            log.info("step %d (%d/%d done) %s", step, step + 1, self.total, info)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()


class MetricsLog(Component):
    def __init__(self, ctx: RunContext) -> None:
        self.ctx = ctx
        self.every = ctx.cfg.log.every
        self.bar: ProgressBar | None = None

    def start(self) -> None:
        log_cfg = self.ctx.cfg.log
        self.bar = ProgressBar(total=self.ctx.cfg.train.steps, mode=log_cfg.progress if env_rank() == 0 else "log",
                               log_every=log_cfg.every)

    def on_step(self, state: StepState) -> None:
        ctx, stats = self.ctx, state.stats
        tokens_per_s = ctx.tokens_per_step / state.elapsed_s
        task_record = ctx.task.step_record()  # once per step (task=energy_flow: the flow steps used)
        if state.done % self.every == 0 or state.done == ctx.total:
            ctx.outputs.log_metrics({
                "kind": "train", "step": state.step, "loss": stats.loss, "lr": state.lr,
                "grad_norm": stats.grad_norm, "step_time_s": state.elapsed_s, "tokens_per_s": tokens_per_s,
                "timed": state.timed, "data_wait_s": stats.data_wait_s, "aux_computed": bool(stats.aux),
                "aux": stats.aux, "skipped": stats.skipped, **({"task": task_record} if task_record else {}),
            })
            ctx.outputs.log_scalars(state.step, {
                "loss/train": stats.loss, "lr": state.lr, "grad_norm": stats.grad_norm,
                "throughput/tokens_per_s": tokens_per_s, "throughput/mfu": ctx.mfu(tokens_per_s),
                # what is measured on every device: the process's peak RSS; on CUDA the allocator too
                "memory/peak_rss_bytes": float(peak_rss_bytes()),
                "memory/allocated_bytes": (
                    float(torch.cuda.memory_allocated(ctx.device)) if ctx.device.type == "cuda" else None
                ),
            })
        assert self.bar is not None, "MetricsLog.start() comes before the steps"
        self.bar.update(state.step, f"loss {stats.loss:.4f} | {tokens_per_s:,.0f} tok/s")

    def finish(self, *, ranks_agree: bool) -> TaskRecord | None:
        if self.bar is not None:
            self.bar.close()
        return self.ctx.task.run_record()  # applied.task (task=energy_flow: its forms, the flow steps used)
