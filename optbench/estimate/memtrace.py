"""Per-device memory of one training step, traced without allocating it.

The configured model is built exactly as ``optbench train`` builds it (``build_model`` on the meta
device, ``parallelize`` for activation checkpointing, FSDP2 for ``parallel=fsdp2``), materialized as
FakeTensors (``FakeTensorMode``: shapes, dtypes and storages, no memory) and run through one real
training step — forward under the precision policy's autocast, loss, backward, gradient clipping,
optimizer step — inside torch's ``MemTracker`` (``FSDPMemTracker`` for FSDP2, on a fake process
group of ``world_size`` ranks). The tracker follows every storage the step creates and frees and
reports the peak by category.

Three details make this exact and fast enough for a 13B model on a laptop:

* DTensor's sharding propagation builds global-shape FakeTensors in whichever fake mode is active;
  under our FakeTensorMode the tracker would count them as allocations. A TracingContext whose fake
  mode is a *separate* FakeTensorMode makes propagation run there, where the tracker ignores it.
* The tracker updates every module's local peak on every op (quadratic in the number of layers);
  ``_PeakOnly`` keeps the global peak only, records where it happened, and lets metadata queries
  (``prim.device``) through untracked.
* FSDP2's optimizer step runs on the local shards (plain tensors sharing the DTensors' storages), so
  the same local kernels allocate the same bytes without DTensor's per-op dispatch overhead.

Where torch's CUDA kernels keep other tensors for backward than this CPU's, the trace follows CUDA
(``target="cuda"``, what ``optbench estimate`` reports): RMSNorm's fused CUDA kernel keeps its input
and rstd, the CPU decomposition an fp32 copy of the input and the fp32 normalized tensor as well.
``target="cpu"`` traces exactly what a CPU run allocates (what ``optbench train`` records on a CPU).

The steady state (optimizer states already allocated) is derived from one step: AdamW-style
optimizers allocate their states at the start of their first ``step()``, before any temporary, and
nothing else differs between the first and later steps (gradients are set to None between steps).
So the steady-state peak is ``max(peak before the step + state bytes, peak during the step)``;
``tests/estimate/test_estimate.py`` checks it against later steps measured on real tensors (one device, and
FSDP2 on a fake process group).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import warnings
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch._guards import active_fake_mode

from optbench.config import Config, OptimizerConfig
from optbench.distributed import Machine
from optbench.errors import ConfigError
from optbench.estimate.compiled_memory import in_fused_kernel
from optbench.estimate.fake import unpacked_positions, use_cuda_rms_norm
from optbench.estimate.ops import OpLog
from optbench.estimate.stacking import Event, Timeline, block_index, innermost
from optbench.estimate.steps import (
    COMPONENTS,
    HOST_COMPONENTS,
    OPTIMIZER_STEP,
    Snapshot,
    StepTrace,
    split_step_temporaries,
)
from optbench.model.fusion import frozen_tolerant
from optbench.optim.optimizers import build_optimizer
from optbench.tasks import Task, build_task
from optbench.training.build import build_model
from optbench.training.kinds import model_spec
from optbench.training.parallelize import parallelize
from optbench.training.step import StepContext, grad_norm, micro_step

log = logging.getLogger(__name__)

CPU = torch.device("cpu")

_CATEGORY = {
    # MemTracker
    "Parameter": "parameters", "Buffer": "other", "Gradient": "gradients", "Activation": "activations",
    "Temp": "temporaries", "Optstate": "optimizer_states", "Other": "other",
    # FSDPMemTracker
    "Sharded Param": "parameters", "Unsharded Param": "fsdp_buffers", "Sharded Grad": "gradients",
    "Unsharded Grad": "fsdp_buffers", "All Gather": "fsdp_buffers", "Reduce Scatter": "fsdp_buffers",
    "OptState": "optimizer_states", "Inputs": "other",
}

# DDP's default (gradient_as_bucket_view=False) keeps every gradient twice: in param.grad and in its
# all-reduce buckets, allocated once at wrap time. DDP cannot be wrapped around FakeTensors (its C++
# reducer allocates the buckets for real), so the buckets are added as bytes, not traced.
DDP_GRADIENT_AS_BUCKET_VIEW = False


class NotTraceable(ConfigError):
    """A valid config whose step the estimator cannot trace on this machine."""


_HOST_CATEGORIES = frozenset({"Sharded Param", "Sharded Grad", "OptState"})


# --------------------------------------------------------------------------------------- trackers
def _where(tracker: Any) -> tuple[str, str | None]:
    if tracker._in_opt:
        phase = OPTIMIZER_STEP
    else:
        phase = "backward" if tracker._mod_tracker.is_bw else "forward"
    parents = [name for name in tracker._mod_tracker.parents if name != "Global"]
    if not parents:
        return phase, None
    inner = innermost(parents)  # "Transformer.layers.3.mlp": drop the root's class name
    return phase, inner.partition(".")[2] or inner


class _PeakOnly:
    """Keeps the global peak only (MemTracker also updates every active module's local peak on every
    op, which on a 55-layer model costs more than the fake op itself) and records where it happened;
    ``prim.device`` (a metadata query that allocates nothing) is let through untracked."""

    peak_where: tuple[str, str | None] = ("forward", None)
    host_offload: bool = False  # FSDP2 CPUOffloadPolicy: the peak is the device's, host categories apart
    timeline: Timeline | None = None  # records every event (stacked estimates, optbench.estimate.stacking)
    ops: OpLog | None = None  # records every op (the speed prediction, optbench.estimate.speed)
    activation_max: int = 0  # the most activation bytes seen at once (not at the peak: its own moment)

    def __enter__(self) -> Any:
        # the fake mode the step runs under: ops recorded for the prediction are that mode's alone (set
        # here, not read from MemTracker, whose attribute for it older torch releases do not have)
        self.entry_fake_mode = active_fake_mode()
        return super().__enter__()

    def _device_bytes(self, snap: dict) -> int:
        if not self.host_offload:
            return snap["Total"]
        return snap["Total"] - sum(v for k, v in snap.items() if k != "Total" and k.value in _HOST_CATEGORIES)

    def _update_peak_stats(self, peak_state: Any) -> None:
        for dev, snap in self._curr_mem_snap.items():
            device_bytes = self._device_bytes(snap)
            if self._peak_mem.get(dev, 0) < device_bytes:
                self._peak_mem[dev] = device_bytes
                self._peak_mem_snap[dev] = dict(snap)
                self.peak_where = _where(self)
        snap = self._curr_mem_snap.get(CPU)
        if snap:
            self.activation_max = max(self.activation_max, _activations(snap))
        if self.timeline is not None:
            self._record()

    def _record(self) -> None:
        snap = self._curr_mem_snap.get(CPU, {})
        components = _snapshot(snap, where=("", None), host=frozenset()).components
        event = Event(tuple(components[c] for c in COMPONENTS), self._device_bytes(snap) if snap else 0, _where(self))
        self.timeline.record(block_index(self._mod_tracker.parents), event)

    def reset_peak(self) -> None:
        """Start a new peak from the current memory."""
        self._peak_mem_snap = {dev: dict(snap) for dev, snap in self._curr_mem_snap.items()}
        self._peak_mem = {dev: self._device_bytes(snap) for dev, snap in self._curr_mem_snap.items()}
        self.peak_where = _where(self)
        if self.timeline is not None:
            self._record()

    def peak(self) -> Snapshot:
        return _snapshot(self._peak_mem_snap.get(CPU, {}), where=self.peak_where, host=self._host())

    def current(self) -> Snapshot:
        return _snapshot(self._curr_mem_snap.get(CPU, {}), where=_where(self), host=self._host())

    def _host(self) -> frozenset[str]:
        return HOST_COMPONENTS if self.host_offload else frozenset()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        if func is torch.ops.prim.device.default:
            return func(*args, **(kwargs or {}))
        fused = in_fused_kernel()
        if fused:  # inside a compiled block's fused kernel: computed, never allocated
            out = func(*args, **(kwargs or {}))
        else:
            out = super().__torch_dispatch__(func, types, args, kwargs)
        if self.ops is not None and out is not NotImplemented and active_fake_mode() is self.entry_fake_mode:
            phase = "optimizer" if self._in_opt else "backward" if self._mod_tracker.is_bw else "forward"
            self.ops.record(func, args, kwargs, out, phase=phase, block=block_index(self._mod_tracker.parents),
                            fused=fused)
        return out


def _activations(snap: dict) -> int:
    return sum(v for k, v in snap.items() if _is_activation(k))


@functools.cache  # asked on every traced op, of the few keys MemTracker's snapshots have
def _is_activation(key: Any) -> bool:
    return key != "Total" and _CATEGORY[key.value] == "activations"


def _snapshot(snap: dict, *, where: tuple[str, str | None], host: frozenset[str]) -> Snapshot:
    components = dict.fromkeys(COMPONENTS, 0)
    for key, nbytes in snap.items():
        if key != "Total":
            components[_CATEGORY[key.value]] += nbytes
    return Snapshot(components, phase=where[0], module=where[1], host=host)


def _memtracker_class() -> type:
    from torch.distributed._tools.mem_tracker import MemTracker

    return type("PeakMemTracker", (_PeakOnly, frozen_tolerant(MemTracker)), {})


def _fsdp_memtracker_class() -> type:
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

    return type("PeakFSDPMemTracker", (_PeakOnly, frozen_tolerant(FSDPMemTracker)), {})


# ------------------------------------------------------------------------------------- the step
@dataclass
class Traced:
    model: nn.Module
    task: Task
    fake_mode: Any
    mesh: Any


def _cpu_machine(world_size: int = 1) -> Machine:
    return Machine(device=CPU, cuda_available=False, cuda_devices=0, cpu_threads=torch.get_num_threads(),
                   world_size=world_size)


def _traced(cfg: Config, *, mesh: Any) -> Config:
    """The config ``parallelize`` sees for the fake model: activation checkpointing as configured;
    compile off (the trace is eager; ``use_compiled_blocks`` models the compiled blocks); FSDP2 over
    the fake ``mesh`` exactly as training applies it; DDP not applied (its buckets are modeled)."""
    return dataclasses.replace(
        cfg,
        compile=dataclasses.replace(cfg.compile, name="none"),
        parallel=dataclasses.replace(cfg.parallel, name="fsdp2" if mesh is not None else "single",
                                     nproc_per_node=1, cpu_offload=cfg.parallel.cpu_offload and mesh is not None),
    )


def check_traceable(cfg: Config) -> None:
    """Raise NotTraceable for a config whose step cannot run on FakeTensors on this machine."""
    if cfg.attention.name == "flex":  # compiled flex_attention: no eager kernel to trace
        raise NotTraceable(
            f"attention={cfg.attention.name} cannot be traced on a CPU; estimate with attention=sdpa "
            "(a fused kernel with the same O(seq) memory)"
        )


def build_fake(cfg: Config, *, mesh: Any, target: str) -> Traced:
    from torch._subclasses.fake_tensor import FakeTensorMode

    check_traceable(cfg)
    task = build_task(cfg)
    model = build_model(cfg, task)
    if target == "cuda":
        use_cuda_rms_norm(model)
    # the run's own plan, every block group in its order (FSDP2 over the fake mesh, host memory unpinned)
    parallelize(model, cfg=_traced(cfg, mesh=mesh), machine=_cpu_machine(mesh.size() if mesh is not None else 1),
                mesh=mesh)
    if cfg.compile.name != "none":  # what the compiled blocks save (optbench.estimate.compiled_memory)
        from optbench.estimate.compiled_memory import use_compiled_blocks

        for group in model_spec(cfg).block_groups(model).values():
            use_compiled_blocks(group)
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    with fake_mode, warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="DTensor random operators")
        model.to_empty(device=CPU)
        model.init_weights()
    return Traced(model=model, task=task, fake_mode=fake_mode, mesh=mesh)


def _device_optimizer_cfg(cfg: Config) -> OptimizerConfig:
    """The AdamW torchao's CPUOffloadOptimizer keeps on the device for tensors under its
    ``minimal_size``."""
    opt = cfg.optimizer
    return OptimizerConfig(name="adamw", impl=opt.impl, weight_decay=opt.weight_decay, betas=list(opt.betas),
                           eps=opt.eps)


def _optimizer_for(traced: Traced, cfg: Config) -> tuple[torch.optim.Optimizer | None, list, Any]:
    """The optimizer the device sees, and the parameters clipping and the step see.

    With FSDP2 they are the local shards: plain tensors sharing the DTensors' storages, whose
    ``.grad`` is set to the local gradient shard before clipping (``sync``). With torchao's
    CPUOffloadOptimizer the device keeps an AdamW for the tensors under ``minimal_size`` only (None
    when there are none)."""
    params = list(traced.model.parameters())
    host_states, _ = cfg.optimizer.offloads()
    if traced.mesh is None and not host_states:
        return build_optimizer(traced.model, cfg=cfg.optimizer, lr=cfg.train.lr), params, lambda: None
    shards = nn.Module()
    pairs = []
    for index, param in enumerate(params):
        local = param if traced.mesh is None else nn.Parameter(param._local_tensor, requires_grad=True)
        if not host_states or param.numel() < cfg.optimizer.minimal_size:
            shards.register_parameter(f"p{index}", local)
        pairs.append((param, local))

    def sync() -> None:
        if traced.mesh is not None:
            for param, local in pairs:
                local.grad = None if param.grad is None else param.grad._local_tensor

    if host_states:
        device_params = list(shards.parameters())
        optimizer = (
            build_optimizer(shards, cfg=_device_optimizer_cfg(cfg), lr=cfg.train.lr) if device_params else None
        )
    else:
        optimizer = build_optimizer(shards, cfg=cfg.optimizer, lr=cfg.train.lr)
    return optimizer, [p for _, p in pairs], sync


def _drop_grads_when_accumulated(params: list[nn.Parameter]) -> list:
    """CPUOffloadOptimizer(offload_gradients=True) copies each gradient to the host as it is
    accumulated and frees it on the device."""

    def drop(param: torch.Tensor) -> None:
        param.grad = None

    return [p.register_post_accumulate_grad_hook(drop) for p in params]


def trace_built(traced: Traced, cfg: Config, *, micro_batch: int, timeline: Timeline | None = None,
                ops: OpLog | None = None, with_aux: bool = True) -> StepTrace:
    """One training step of the model ``build_fake`` made, at ``micro_batch`` samples per device;
    ``timeline`` (when given) records every event of it (``optbench.estimate.stacking``), ``ops``
    every op (``optbench.estimate.ops``); ``with_aux``: the task's auxiliary loss computed (the
    heavier step, whose memory the estimate reports)."""
    from torch._guards import TracingContext, tracing
    from torch._subclasses.fake_tensor import FakeTensorMode

    model, task = traced.model, traced.task
    host_states, host_grads = cfg.optimizer.offloads()
    batch = task.fake_batch(micro_batch, traced.fake_mode)  # from shapes: the real batch is never allocated
    with traced.fake_mode, tracing(TracingContext(FakeTensorMode())), unpacked_positions():
        optimizer, params, sync = _optimizer_for(traced, cfg)
        hooks = _drop_grads_when_accumulated([p for p in model.parameters() if p.requires_grad]) if host_grads else []
        if ops is not None:
            hooks += ops.capture_block_inputs(model_spec(cfg).main_blocks(model)[1])
        tracker = _tracker_for(traced, cfg, batch=batch, optimizer=optimizer)
        with tracker:
            # __enter__ starts the peak at the whole snapshot's total, host-resident shards included:
            # under CPUOffloadPolicy that would hide every device peak smaller than them
            tracker.timeline, tracker.ops = timeline, ops
            tracker.reset_peak()
            held: list = []  # as train_step: the last outputs and losses live until the step ends
            main_sum = _micro_steps_traced(tracker, StepContext(model=model, task=task, cfg=cfg, device=CPU),
                                           batch, ops=ops, with_aux=with_aux, held=held)
            sync()
            _stage(ops, "clip")
            grad_norm(params, clip=cfg.train.clip_grad)
            before, activation_peak = tracker.peak(), tracker.activation_max
            during, state_bytes = None, 0
            if optimizer is not None:
                if timeline is not None:
                    timeline.new_part()
                _stage(ops, "optimizer")
                tracker.reset_peak()
                optimizer.step()
                state_bytes = tracker.current().components["optimizer_states"]
                during = tracker.peak()
                if not tracker.host_offload:  # with CPUOffloadPolicy the step and its temporaries are on the host
                    during = split_step_temporaries(during, state_bytes=state_bytes)
            model.zero_grad(set_to_none=True)
            del held, main_sum, optimizer, params
        for hook in hooks:
            hook.remove()
    return StepTrace(micro_batch=micro_batch, before_step=before, during_step=during, state_bytes=state_bytes,
                     activation_peak=activation_peak)


def _micro_steps_traced(tracker: Any, step_ctx: StepContext, batch: dict, *, ops: OpLog | None, with_aux: bool,
                        held: list) -> torch.Tensor:
    """The step's micro-steps, as ``train_step`` runs them; returns the sum of their losses."""
    main_sum = torch.zeros((), device=CPU)  # as train_step's sum of the micro-steps' losses
    for micro, last in _micro_steps(step_ctx.cfg.train.grad_accum):
        if micro:  # as train_step: MemTracker allows one forward per module
            tracker.reset_mod_stats()
        _stage(ops, f"micro {micro}")
        # FSDP2 keeps unsharded gradients until the last micro-step (gradient sync off)
        losses = micro_step(step_ctx, batch, step=0, micro=micro, last=last, with_aux=with_aux, held=held)
        main_sum += losses.main.detach()
        del losses
    return main_sum


def _tracker_for(traced: Traced, cfg: Config, *, batch: dict, optimizer: Any) -> Any:
    """FSDPMemTracker over the fake mesh's FSDP2 model, else MemTracker over the model, the batch and
    the optimizer."""
    if traced.mesh is not None:
        tracker = _fsdp_memtracker_class()(traced.model, optimizer)
        tracker.host_offload = cfg.parallel.cpu_offload
        tracker.track_inputs(tuple(batch.values()))
        return tracker
    tracker = _memtracker_class()()
    tracker.track_external(traced.model, *batch.values(), *([optimizer] if optimizer else []))
    return tracker


def _stage(ops: OpLog | None, stage: str) -> None:
    if ops is not None:
        ops.stage = stage


def _micro_steps(accum: int) -> list[tuple[int, bool]]:
    """The micro-steps whose memory differs, as (index, last): the first (gradients allocated as
    backward goes), a middle one (all gradients already there; FSDP2 keeps them unsharded while
    gradient sync is off) and the last (gradient sync on); more middle ones would repeat it."""
    if accum == 1:
        return [(0, True)]
    return [(0, False), *([(1, False)] if accum > 2 else []), (accum - 1, True)]
