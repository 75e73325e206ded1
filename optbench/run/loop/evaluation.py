"""Evaluation on the fixed held-out batches every ``train.eval_every`` steps and after the last."""

from __future__ import annotations

from optbench.distributed import broadcast_object
from optbench.run.loop import Component, RunContext, StepState
from optbench.summary import EvalResult
from optbench.tasks import Batch
from optbench.training.step import evaluate


class Evaluation(Component):
    def __init__(self, ctx: RunContext, *, batches: list[Batch]) -> None:
        self.ctx = ctx
        self.batches = batches
        self.every = ctx.cfg.train.eval_every
        self.result: dict[str, float] | None = None  # the latest evaluation's, the same on every rank

    def due(self, done: int) -> bool:
        if not self.batches:  # train.eval_batches=0: no evaluation, and no eval loss (not a loss of 0)
            return False
        return done == self.ctx.total or bool(self.every and done % self.every == 0)

    def on_step(self, state: StepState) -> None:
        if not self.due(state.done):
            return
        ctx = self.ctx
        result = evaluate(ctx.model, task=ctx.task, batches=self.batches, device=ctx.device, cfg=ctx.cfg)
        # rank 0's figures for every rank: a rule that reads them (early stopping) decides alike everywhere
        self.result = broadcast_object(result)
        ctx.outputs.log_metrics({"kind": "eval", "step": state.step, **self.result})
        ctx.outputs.log_scalars(state.step, {"loss/eval": self.result["loss"],
                                             **{f"eval/{k}": v for k, v in self.result.items() if k != "loss"}})

    def finish(self, *, ranks_agree: bool) -> EvalResult | None:
        if self.result is None:
            return None
        return EvalResult(loss=self.result["loss"], metrics={k: v for k, v in self.result.items() if k != "loss"})
