"""Memory as an outcome, not a crash.

* ``check_fits`` (before the loop, ``run.check_memory``): a config whose traced peak
  (``memory.estimate_bytes``, what ``optbench estimate`` computes) exceeds the device's memory (on a
  CPU, this machine's RAM shared by its local ranks) is refused up front as ``incompatible``, naming
  the estimate and the largest micro-batch (or, at micro-batch 1, the longest sequence) that fits.
  The estimate counts tensors only (no CUDA context, no fragmentation), so a run above 100% cannot fit.
* ``OomGuard`` (a component wrapping every step): a ``torch.OutOfMemoryError`` ends the run as status
  ``oom`` with the step, the allocator's figures and the same advice (``memory.oom``); ``release_memory`` leaves a
  clean allocator for the next run of a sweep.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
import os
from collections.abc import Iterator
from typing import Any

import torch

from optbench.config import Config
from optbench.errors import IncompatibleError, OutOfMemory
from optbench.outputs import human_bytes
from optbench.run.loop import Component, RunContext
from optbench.summary import OomRecord

log = logging.getLogger(__name__)

USABLE = 0.9  # of the device's memory, for the advice (the rest: context, fragmentation)


def device_capacity(device: torch.device, *, local_ranks: int = 1) -> tuple[int, str]:
    """(bytes one rank may use, what they are): the GPU's memory, or this machine's RAM / local ranks."""
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return int(props.total_memory), f"{props.name}'s memory"
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    share = f" / {local_ranks} local ranks" if local_ranks > 1 else ""
    return ram // local_ranks, f"this machine's RAM{share}"


def advice(cfg: Config, *, world_size: int, device_type: str, budget: int) -> str:
    """The largest micro-batch whose traced peak fits ``budget`` bytes, else the longest sequence at
    micro-batch 1 (language model), as the override to use."""
    from optbench.estimate.api import device_workspaces
    from optbench.estimate.fit import largest_micro_batch
    from optbench.estimate.memtrace import NotTraceable
    from optbench.estimate.tracer import step_tracer, trace_step

    try:
        workspaces = device_workspaces(device_type)
        with step_tracer(cfg, world_size=world_size, target=device_type, workspaces=workspaces) as tracer:
            found = largest_micro_batch(tracer, first=tracer(cfg.train.batch_size), budget=budget)
        if found["max_micro_batch"] >= 1:
            return (f"the largest micro-batch that fits is train.batch_size={found['max_micro_batch']} "
                    "(raise train.grad_accum to keep the global batch)")
        if cfg.task.name != "lm":
            return "not even train.batch_size=1 fits; use a smaller model or shard it (parallel=fsdp2)"
        seq_len = cfg.train.seq_len
        while seq_len > 1:
            seq_len //= 2
            shorter = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, seq_len=seq_len, batch_size=1))
            traced = trace_step(shorter, world_size=world_size, micro_batch=1, target=device_type, workspaces=workspaces)
            if traced.steady_peak().total <= budget:
                return (f"not even train.batch_size=1 fits at train.seq_len={cfg.train.seq_len}; "
                        f"train.seq_len={seq_len} does (halving it) at train.batch_size=1")
        return "not even train.batch_size=1 at train.seq_len=1 fits; use a smaller model"
    except NotTraceable as exc:
        return f"no advice: the step cannot be traced ({exc})"


def check_fits(cfg: Config, *, estimate_bytes: int | None, device: torch.device, world_size: int) -> None:
    if not cfg.run.check_memory or estimate_bytes is None:
        return
    # on a CPU the ranks on this machine share its RAM (torchrun says how many; self-launched: all)
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world_size)) if device.type == "cpu" else 1
    capacity, what = device_capacity(device, local_ranks=local)
    if estimate_bytes <= capacity:
        return
    hint = advice(cfg, world_size=world_size, device_type=device.type, budget=int(capacity * USABLE))
    raise IncompatibleError(
        f"the estimated peak memory of this config is {human_bytes(estimate_bytes)} per rank, "
        f"{estimate_bytes / capacity:.1f}x {what} ({human_bytes(capacity)}); {hint}; "
        "or run.check_memory=false to try anyway")


def allocator_figures(device: torch.device) -> dict[str, Any]:
    if device.type != "cuda":
        return {"allocated_bytes": None, "reserved_bytes": None, "max_allocated_bytes": None,
                "capacity_bytes": device_capacity(device)[0]}
    return {"allocated_bytes": torch.cuda.memory_allocated(device),
            "reserved_bytes": torch.cuda.memory_reserved(device),
            "max_allocated_bytes": torch.cuda.max_memory_allocated(device),
            "capacity_bytes": device_capacity(device)[0]}


def release_memory() -> None:
    """Free what a run left cached, so the next run of a sweep starts from a clean allocator."""
    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


class OomGuard(Component):
    def __init__(self, ctx: RunContext) -> None:
        self.ctx = ctx
        self.record: OomRecord | None = None

    @contextlib.contextmanager
    def _guard(self, step: int) -> Iterator[None]:
        try:
            yield
        except torch.OutOfMemoryError as exc:
            first_line = str(exc).splitlines()[0] if str(exc) else "out of memory"
            exc.__traceback__ = None  # its frames hold the step's tensors
            del exc
            raise self._recorded(step, first_line) from None

    def around_step(self, step: int, *, timed: bool) -> contextlib.AbstractContextManager:
        return self._guard(step)

    def _recorded(self, step: int, first_line: str) -> OutOfMemory:
        ctx = self.ctx
        figures = allocator_figures(ctx.device)
        estimate = ctx.estimate_bytes
        hint = advice(ctx.cfg, world_size=ctx.world_size, device_type=ctx.device.type,
                      budget=int(figures["capacity_bytes"] * USABLE))
        self.record = OomRecord(step=step, **figures, estimate_bytes=estimate, advice=hint)
        allocator = ", ".join(f"{k.removesuffix('_bytes').replace('_', ' ')} {human_bytes(v)}"
                              for k, v in figures.items() if v is not None)
        return OutOfMemory(f"out of memory in step {step + 1} of {ctx.total} ({first_line}); {allocator}; "
                           f"estimated peak {human_bytes(estimate)}; {hint}")

    def finish(self, *, ranks_agree: bool) -> OomRecord | None:
        return self.record
