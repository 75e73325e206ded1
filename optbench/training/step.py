"""The one training step: ``micro_step`` is the forward/backward body that ``optbench train`` runs
and that ``optbench estimate`` traces on FakeTensors (``optbench.estimate.memtrace``), so the estimate cannot
drift from what training does; ``train_step`` is one optimizer step over ``train.grad_accum``
micro-steps; ``evaluate`` is the held-out loss and the task's metrics."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from optbench.config import Config
from optbench.distributed import mean_across_ranks
from optbench.errors import DivergedError
from optbench.tasks import Batch, Losses, Task
from optbench.training.build import to_device
from optbench.training.data_parallel import full_tensor, set_gradient_sync
from optbench.training.precision import maybe_autocast


@dataclass
class StepStats:
    loss: float
    grad_norm: float
    aux: dict[str, float] = field(default_factory=dict)
    skipped: bool = False  # fp16: the scaler found inf/nan gradients and skipped the update
    data_wait_s: float = 0.0


@dataclass(frozen=True)
class StepContext:
    """What every step of a run uses, built once. ``optimizer`` None: micro-steps only (the
    estimate traces ``micro_step`` and steps its own optimizer); ``scaler``: fp16's loss scaler."""

    model: nn.Module
    task: Task
    cfg: Config
    device: torch.device
    optimizer: torch.optim.Optimizer | None = None
    scaler: torch.amp.GradScaler | None = None


@dataclass(frozen=True)
class StepHooks:
    """What the loop's components add to a step: ``between_micro_steps`` run before every
    micro-step but the first (MemTracker's reset); ``vetoes(step, loss=, grad_norm=)`` are asked,
    all of them, before the update, and one False skips it (the loss-spike guard)."""

    between_micro_steps: tuple[Callable[[], None], ...] = ()
    vetoes: tuple[Callable[..., bool], ...] = ()

    def accepts(self, step: int, *, loss: float, grad_norm: float) -> bool:
        return all([veto(step, loss=loss, grad_norm=grad_norm) for veto in self.vetoes])  # every rule sees it


NO_HOOKS = StepHooks()


def micro_step(ctx: StepContext, batch: Batch, *, step: int, micro: int, last: bool, with_aux: bool,
               held: list) -> Losses:
    """One micro-batch: gradient sync only on the ``last`` micro-step (DDP/FSDP2), the task's
    augmentation, forward and losses under the precision policy's autocast, and backward of the
    total loss divided by ``train.grad_accum`` (scaled by fp16's ``scaler``).

    ``held`` keeps the model's outputs and the losses: the previous micro-step's outputs are
    released once this forward has returned, its losses once these are computed, and the last
    micro-step's live until the caller drops ``held`` at the end of the step. The peak memory
    includes them, and the estimate, which traces this very body, does too."""
    set_gradient_sync(ctx.model, last)
    batch = ctx.task.augment(batch, step=step, micro=micro)
    with maybe_autocast(ctx.cfg.precision, device=ctx.device):
        outputs = ctx.task.forward(ctx.model, batch)
        held[:1] = [outputs]
        losses = ctx.task.losses(outputs, batch, with_aux=with_aux)
        held[1:] = [losses]
    del outputs
    loss = losses.total / ctx.cfg.train.grad_accum
    (ctx.scaler.scale(loss) if ctx.scaler is not None else loss).backward()
    return losses


def grad_norm(params: list[nn.Parameter], *, clip: float | None) -> torch.Tensor:
    """The total gradient norm over ``params`` that have a gradient, clipped to ``clip`` if set."""
    with_grads = [p for p in params if p.grad is not None]
    if clip is not None:
        return torch.nn.utils.clip_grad_norm_(with_grads, clip)
    return torch.nn.utils.get_total_norm([p.grad for p in with_grads])


def train_step(ctx: StepContext, batches: Iterator[Batch], *, step: int, with_aux: bool = False,
               hooks: StepHooks = NO_HOOKS) -> StepStats:
    """One optimizer step over ``train.grad_accum`` micro-batches drawn from ``batches``.

    Raises DivergedError *before* the optimizer update when the loss or the gradient norm is not
    finite (with fp16 loss scaling a non-finite gradient is an overflow the scaler skips instead).
    A veto of ``hooks`` skips the optimizer update (``skipped``)."""
    accum = ctx.cfg.train.grad_accum
    held: list = []  # the last micro-step's outputs and losses, until the step ends
    main_sum = torch.zeros((), device=ctx.device)
    aux_sums: dict[str, torch.Tensor] = {}
    data_wait = 0.0
    for micro in range(accum):
        if micro:
            for hook in hooks.between_micro_steps:
                hook()
        fetch_start = time.perf_counter()
        batch = to_device(next(batches), ctx.device)
        data_wait += time.perf_counter() - fetch_start
        losses = micro_step(ctx, batch, step=step, micro=micro, last=micro == accum - 1, with_aux=with_aux,
                            held=held)
        main_sum += losses.main.detach()
        for name, value in losses.aux.items():
            aux_sums[name] = aux_sums.get(name, 0.0) + value.detach()
        del losses

    if ctx.scaler is not None:
        ctx.scaler.unscale_(ctx.optimizer)
    norm = grad_norm(list(ctx.model.parameters()), clip=ctx.cfg.train.clip_grad)
    # the global batch's mean loss (DDP/FSDP2 already average the gradients over ranks)
    means = mean_across_ranks(torch.stack([main_sum, *aux_sums.values()]) / accum)
    # one host sync for the loss, the auxiliary losses and the norm (read before the update decides)
    loss_value, *aux_values, norm_value = torch.cat([means, full_tensor(norm).float().reshape(1)]).tolist()
    skipped = _update(ctx, step=step, loss=loss_value, norm=norm_value, hooks=hooks)
    aux = dict(zip(aux_sums, aux_values, strict=True))
    return StepStats(loss=loss_value, grad_norm=norm_value, aux=aux, skipped=skipped, data_wait_s=data_wait)


def _update(ctx: StepContext, *, step: int, loss: float, norm: float, hooks: StepHooks) -> bool:
    """The optimizer update of a step whose gradients are ready; returns whether it was skipped (a
    hook vetoed it, or fp16's scaler found an overflow). Raises DivergedError, before any update,
    for a non-finite loss (or gradient norm, without loss scaling)."""
    optimizer, scaler = ctx.optimizer, ctx.scaler
    assert optimizer is not None, "train_step needs the StepContext's optimizer"
    try:
        if not math.isfinite(loss):
            raise DivergedError(step, "loss", loss)
        if not hooks.accepts(step, loss=loss, grad_norm=norm):
            if scaler is not None:
                scaler.update()  # ends the step the scaler unscaled
            return True
        if scaler is not None:
            scale_before = scaler.get_scale()
            scaler.step(optimizer)
            scaler.update()
            return scaler.get_scale() < scale_before
        if not math.isfinite(norm):
            raise DivergedError(step, "gradient norm", norm)
        optimizer.step()
        return False
    finally:
        optimizer.zero_grad(set_to_none=True)


@torch.no_grad()
def evaluate(model: nn.Module, *, task: Task, batches: list[Batch], device: torch.device, cfg: Config) -> dict:
    """Mean main loss over the fixed eval batches, and the task's metrics from its sums over them."""
    model.eval()
    total = 0.0
    sums: dict[str, Any] = {}

    def forward(*args: Any, **kwargs: Any) -> Any:  # the metrics' extra forwards, under the policy too
        with maybe_autocast(cfg.precision, device=device):
            return model(*args, **kwargs)

    try:
        for batch in batches:
            batch = to_device(batch, device)
            with maybe_autocast(cfg.precision, device=device):
                outputs = task.forward(model, batch)
                losses = task.losses(outputs, batch, with_aux=False)
            total += float(losses.main)
            for key, value in task.eval_metrics(outputs, batch, model=forward).items():
                sums[key] = sums[key] + value if key in sums else value
    finally:
        model.train()
    n = max(1, len(batches))
    return {"loss": total / n, **task.finalize_eval_metrics(sums)}
