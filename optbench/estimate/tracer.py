"""The traced training step ``optbench estimate`` (and a run's own estimate, and the OOM advice)
reports: the whole model traced (``optbench.estimate.memtrace``), or, for a decoder of many alike blocks,
two short copies traced and stacked (``optbench.estimate.stacking``): the same bytes in a fraction of the
time (55 blocks: 2 and 3 traced).

``stacked``: None (the default) stacks whenever the model allows (blocks alike: no fusion layers
between them; more blocks than the longer copy has), True insists (and says why it cannot), False
traces the whole model. A step whose copies do not line up block for block falls back to the whole
trace and says so in ``StepTrace.method``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from optbench.config import Config
from optbench.errors import ConfigError
from optbench.estimate.fake import fake_mesh
from optbench.estimate.memtrace import (
    COMPONENTS,
    DDP_GRADIENT_AS_BUCKET_VIEW,
    NotTraceable,
    Snapshot,
    StepTrace,
    build_fake,
    split_step_temporaries,
    trace_built,
)
from optbench.estimate.ops import OpLog, StepOps
from optbench.estimate.stacking import (
    Event,
    NotStackable,
    Plan,
    Timeline,
    collinear,
    linear,
    moved,
    plan_for,
    stack,
)
from optbench.training.kinds import model_spec

log = logging.getLogger(__name__)


def stacking_plan(cfg: Config) -> Plan | None:
    """The short copies to trace for ``cfg``, or None when its blocks are not alike
    (``ModelSpec.stackable``) or too few for stacking to save anything. A fused model's unit is a
    fusion block and the decoder layers up to the next one (``fusion.every``; ``add``: one block);
    its climate encoder's blocks, named ``fusion.encoder.<i>``, are taken for decoder blocks by
    their index, so they must all fall in the first block. ``fusion=prefix`` (the climate tokens in
    the decoder's sequence) does not line up block for block: traced whole, not approximated."""
    if not model_spec(cfg).stackable:
        return None
    period = math.lcm(cfg.ac.every if cfg.ac.name == "selective" else 1, cfg.model.block_period())
    if cfg.fusion.name != "none":
        if cfg.fusion.name == "prefix" or cfg.fusion.encoder_layers > period:
            return None
        period = math.lcm(period, cfg.fusion.every if cfg.fusion.name in ("cross_attention", "gated") else 1)
    return plan_for(cfg.model.layers, period=period)


@contextlib.contextmanager
def step_tracer(cfg: Config, *, world_size: int, target: str = "cuda", stacked: bool | None = None,
                workspaces: int = 0) -> Iterator[Callable[[int], StepTrace]]:
    """Build the fake model of ``cfg`` once (or its two short copies) and yield
    ``trace(micro_batch, ops=False, with_aux=True) -> StepTrace``, which traces one training step at
    that many samples per device on ``world_size`` ranks (the sharding degree for FSDP2; DDP replicates). Nothing is
    allocated; the RNG state is untouched. ``target`` is the device type whose kernels' saved
    tensors are modeled: ``cuda`` (a GPU estimate) or ``cpu``.

    The step runs training's own body (``optbench.training.step.micro_step`` for each micro-step,
    ``grad_norm``, the optimizer step) except what needs real values: the finite checks and fp16's
    GradScaler bookkeeping (its unscale is in place). A step whose shapes depend on values (which
    FakeTensors do not have) raises NotTraceable. ``workspaces``: the bytes CUDA libraries hold
    beside the step's tensors (``optbench.estimate.cuda_libs``), added to every step as ``cuda_workspaces``.
    ``ops``: record every op as well (``StepTrace.ops``, for the speed prediction); ``with_aux``: the
    task's auxiliary loss computed (memory is reported for that step, the heavier one); ``accum``:
    the micro-steps per optimizer step (``train.grad_accum`` unless given: the model built once
    serves every accumulation, as ``optbench plan``'s candidates of one configuration share it).
    """
    plan = None if stacked is False else stacking_plan(cfg)
    if stacked and plan is None:
        raise ConfigError(f"model={cfg.model.name}: its {cfg.model.layers} blocks cannot be stacked (fusion "
                          "layers between them, or too few blocks); trace the whole model")
    mesh_ctx = fake_mesh(world_size) if cfg.parallel.name == "fsdp2" else contextlib.nullcontext()
    with torch.random.fork_rng(devices=[]), mesh_ctx as mesh:
        tracer = _Stacked(cfg, plan, mesh=mesh, target=target) if plan else _Whole(cfg, mesh=mesh, target=target)

        def trace(micro_batch: int, *, ops: bool = False, with_aux: bool = True, accum: int | None = None) -> StepTrace:
            step = tracer(micro_batch, ops=ops, with_aux=with_aux, accum=accum or cfg.train.grad_accum)
            if workspaces:
                step.extra["cuda_workspaces"] = workspaces
            return step

        yield trace


def trace_step(cfg: Config, *, world_size: int, micro_batch: int, target: str = "cuda",
               stacked: bool | None = None, workspaces: int = 0) -> StepTrace:
    """One traced training step (see ``step_tracer``)."""
    with step_tracer(cfg, world_size=world_size, target=target, stacked=stacked, workspaces=workspaces) as trace:
        return trace(micro_batch)


class _Whole:
    """Traces the whole model."""

    def __init__(self, cfg: Config, *, mesh: Any, target: str) -> None:
        self.cfg = cfg
        self.traced = build_fake(cfg, mesh=mesh, target=target)
        ddp = cfg.parallel.name == "ddp" and not DDP_GRADIENT_AS_BUCKET_VIEW
        self.buckets = grad_bytes(self.traced.model) if ddp else 0
        self.resident = self.traced.task.resident_bytes()  # the task's data on the device (task=energy_flow)

    def __call__(self, micro_batch: int, timeline: Timeline | None = None, *, ops: OpLog | bool | None = None,
                 with_aux: bool = True, accum: int | None = None) -> StepTrace:
        log = OpLog() if ops is True else ops or None
        cfg = self.cfg if accum in (None, self.cfg.train.grad_accum) else dataclasses.replace(
            self.cfg, train=dataclasses.replace(self.cfg.train, grad_accum=accum))
        with _fake_limits(cfg):
            step = trace_built(self.traced, cfg, micro_batch=micro_batch, timeline=timeline, ops=log,
                               with_aux=with_aux)
        if self.buckets:
            step.extra["ddp_buckets"] = self.buckets
        if self.resident:
            step.extra["other"] = self.resident
        if ops is True:
            step.ops = StepOps(logs=[log], plan=None)
        return step


class _Stacked:
    """Traces two short copies and stacks them (``optbench.estimate.stacking``); the whole model when their
    steps do not line up."""

    def __init__(self, cfg: Config, plan: Plan, *, mesh: Any, target: str) -> None:
        self.cfg, self.plan, self.mesh, self.target = cfg, plan, mesh, target
        self.copies = [_Whole(_with_layers(cfg, n), mesh=mesh, target=target) for n in (plan.la, plan.lb)]
        self.ways = [self._stacked, self._by_peaks]
        self.traced_b: StepTrace | None = None
        self.traced_b_accum: int | None = None
        self.whole: _Whole | None = None
        self.why: list[str] = []

    def __call__(self, micro_batch: int, *, ops: bool = False, with_aux: bool = True,
                 accum: int | None = None) -> StepTrace:
        for way in self.ways[:]:
            try:
                return way(micro_batch, ops=ops, with_aux=with_aux, accum=accum)
            except NotStackable as exc:  # the next way, for this and every later micro-batch
                self.why.append(str(exc))
                log.info("%s: %s", way.__name__, exc)
                self.ways.remove(way)
        if self.whole is None:
            self.whole = _Whole(self.cfg, mesh=self.mesh, target=self.target)
        step = self.whole(micro_batch, ops=ops, with_aux=with_aux, accum=accum)
        step.method = f"the whole model traced ({'; '.join(self.why)})"
        return step

    def _by_peaks(self, micro_batch: int, *, ops: bool, with_aux: bool, accum: int | None = None) -> StepTrace:
        """The peaks of three copies one unit apart, extrapolated along their line when every figure
        lies on it: the moment of the peak is then the same in all three, and assumed to stay so
        (a lower bound if another moment, growing faster with depth, overtakes it later; the method
        says "approximate")."""
        plan = self.plan
        if len(self.copies) == 2:
            self.copies += [_Whole(_with_layers(self.cfg, plan.lb + n * plan.period), mesh=self.mesh,
                                   target=self.target) for n in (1, 2)]
        logs = [OpLog(), OpLog()] if ops else [None, None]
        reuse = self.traced_b if self.traced_b and self.traced_b.micro_batch == micro_batch and not ops \
            and with_aux and self.traced_b_accum == accum else None
        steps = [reuse or self.copies[1](micro_batch, ops=logs[0], with_aux=with_aux, accum=accum)] + [
            copy(micro_batch, ops=log, with_aux=with_aux, accum=accum) for copy, log in zip(self.copies[2:], [logs[1], None],
                                                                              strict=True)]
        figures = [_figures(step) for step in steps]
        further = Plan(layers=plan.layers, period=plan.period, la=plan.lb + plan.period)
        if not all(collinear([f[i] for f in figures]) for i in range(len(figures[0]))):
            raise NotStackable(f"the peaks of {plan.lb}, {further.la} and {further.lb} blocks are not on a line")
        middle, last = steps[1], steps[2]
        return StepTrace(
            micro_batch=micro_batch,
            before_step=_along(middle.before_step, last.before_step, further),
            during_step=None if last.during_step is None else _along(middle.during_step, last.during_step, further),
            state_bytes=linear(middle.state_bytes, last.state_bytes, further),
            extra={k: linear(middle.extra.get(k, 0), v, further) for k, v in last.extra.items()},
            activation_peak=linear(middle.activation_peak, last.activation_peak, further),
            method=(f"approximate: the peaks of {plan.lb}, {further.la} and {further.lb} blocks, on a line, "
                    f"extrapolated to {plan.layers} (a lower bound if the peak's moment moves past {further.lb} blocks)"),
            ops=StepOps(logs=logs, plan=Plan(layers=plan.layers, period=plan.period, la=plan.lb)) if ops else None,
        )

    def _stacked(self, micro_batch: int, *, ops: bool, with_aux: bool, accum: int | None = None) -> StepTrace:
        timelines = [Timeline(), Timeline()]
        logs = [OpLog(), OpLog()] if ops else [None, None]
        a, b = [copy(micro_batch, timeline, ops=log, with_aux=with_aux, accum=accum)
                for copy, timeline, log in zip(self.copies, timelines, logs, strict=True)]
        if with_aux:
            self.traced_b, self.traced_b_accum = b, accum  # if they do not line up, the peaks' way starts from it
        peaks, approximate = stack(self.plan, *timelines)
        # the most activation bytes at any moment before the optimizer step, found as the peak is:
        # not a line through the copies' own maxima, whose moment can differ from the whole
        # model's (the copies' in the loss, the whole model's at the end of its blocks)
        held, _ = stack(self.plan, *timelines, by=COMPONENTS.index("activations"), parts=1)
        if held[0] is None:
            raise NotStackable("the step recorded no event before the optimizer step")
        host = b.before_step.host
        state_bytes = linear(a.state_bytes, b.state_bytes, self.plan)
        during = None
        if b.during_step is not None:
            during = _snapshot(peaks[1], host=host)
            if not host:  # as trace_built: the step's temporaries apart from the states that remain
                during = split_step_temporaries(during, state_bytes=state_bytes)
        extra = {k: linear(a.extra.get(k, 0), v, self.plan) for k, v in b.extra.items()}
        method = self.plan.describe() + (
            "; per-parameter loops (clipping, optimizer state) extrapolated through their largest event"
            if approximate else "")
        return StepTrace(micro_batch=micro_batch, before_step=_snapshot(peaks[0], host=host), during_step=during,
                         state_bytes=state_bytes, extra=extra, method=method,
                         activation_peak=held[0].components[COMPONENTS.index("activations")],
                         ops=StepOps(logs=logs, plan=self.plan) if ops else None)


def _snapshot(event: Event | None, *, host: frozenset[str]) -> Snapshot:
    if event is None:
        raise NotStackable("a part of the step recorded no event")
    phase, module = event.where
    return Snapshot(dict(zip(COMPONENTS, event.components, strict=True)), phase=phase, module=module, host=host)


def _figures(step: StepTrace) -> list[int]:
    snaps = [step.before_step] + ([step.during_step] if step.during_step is not None else [])
    return [v for snap in snaps for v in snap.components.values()] + [step.state_bytes, *step.extra.values()]


def _along(near: Snapshot, far: Snapshot, plan: Plan) -> Snapshot:
    """``far``'s snapshot moved along the line from ``near`` to the ``plan.layers``-block model; its
    block index moves with the blocks beyond the first unit."""
    components = {k: linear(near.components[k], v, plan) for k, v in far.components.items()}
    module = moved(far.module, plan.extra * plan.period, at_least=2 * plan.period)
    return Snapshot(components, phase=far.phase, module=module, host=far.host)


def _with_layers(cfg: Config, layers: int) -> Config:
    return dataclasses.replace(cfg, model=cfg.model.with_layers(layers))


@contextlib.contextmanager
def _fake_limits(cfg: Config) -> Iterator[None]:
    """A step whose shapes or control flow depend on tensor values cannot run on FakeTensors: say
    which op, as NotTraceable."""
    from torch._subclasses.fake_tensor import (
        DataDependentOutputException,
        DynamicOutputShapeException,
        UnsupportedOperatorException,
    )

    try:
        yield
    except (DataDependentOutputException, DynamicOutputShapeException, UnsupportedOperatorException) as exc:
        raise NotTraceable(
            f"task={cfg.task.name}: its training step needs tensor values ({type(exc).__name__}: "
            f"{exc.func}), which FakeTensors do not have, so its memory cannot be traced"
        ) from exc


def grad_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)

