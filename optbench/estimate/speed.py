"""The predicted step time of a training config: the traced step's ops (``optbench.estimate.ops``),
each costed on this machine by the per-op benchmark (``optbench.estimate.op_timings``) or on a named
GPU by a roofline (``optbench.estimate.roofline``), summed by stage and stacked like the memory
trace; collectives from their message sizes over a stated link; the data wait measured.

The step: ``train.grad_accum`` micro-steps (the trace records the first, one middle one standing
for the others, and the last), gradient clipping and the optimizer step. With ``loss_freq.every``
> 1 most steps skip the auxiliary loss: the typical step (what a run's median measures) is traced
without it, and the mean step weighs the two kinds. A compiled step (``compile=``) on this machine
times one compiled block on real tensors and stacks it in place of the block's eager ops
(``optbench.estimate.compiled_time``).

Breakdown: forward matmuls, backward matmuls, attention (fused SDPA kernels), other ops
(elementwise, norms, loss, embedding, casts), optimizer (clipping and the step), communication
(exposed: what the device does not overlap with compute), data (the wait for the next batch).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Protocol

from optbench.estimate.ops import Cost, OpCall, OpLog, StepOps, TensorSpec

CATEGORIES = ("forward matmuls", "backward matmuls", "attention", "other ops", "optimizer", "communication")
BREAKDOWN = (*CATEGORIES, "data")


class Costs(Protocol):
    """Seconds of one op call on the device predicted for."""

    device: str
    method: str
    overlaps_communication: bool

    def seconds(self, call: OpCall, cost: Cost) -> float: ...


@dataclass(frozen=True)
class Link:
    """The bandwidth collectives run at: bytes/s per rank (bus bandwidth), a latency per
    collective, and where the figure comes from."""

    bytes_per_s: float
    latency_s: float
    source: str

    def seconds(self, kind: str, nbytes: int, world: int) -> float:
        """Ring algorithms: all-gather / reduce-scatter move (n-1)/n of the full buffer per rank,
        all-reduce twice that, broadcast the buffer once."""
        if world <= 1:
            return 0.0
        share = (world - 1) / world
        factor = {"all_gather": share, "reduce_scatter": share, "all_reduce": 2 * share}.get(kind, 1.0)
        return self.latency_s + factor * nbytes / self.bytes_per_s


def collective_kind(call: OpCall) -> tuple[str, int]:
    """(all_gather | reduce_scatter | all_reduce | other, bytes of the full buffer) of a c10d op."""
    name = call.func.name()
    tensors = call.tensors()
    if "allgather" in name or "all_gather" in name:
        return "all_gather", tensors[0].nbytes  # the gathered output
    if "reduce_scatter" in name:
        return "reduce_scatter", max(t.nbytes for t in tensors)  # the unsharded input
    if "allreduce" in name or "all_reduce" in name:
        return "all_reduce", sum(t.nbytes for t in tensors)
    return "other", sum(t.nbytes for t in tensors)


def category(stage: str, phase: str, call: OpCall) -> str:
    if stage in ("clip", "optimizer"):
        return "optimizer"
    kind = call.kind
    if kind == "collective":
        return "communication"
    if kind == "matmul":
        return "backward matmuls" if phase == "backward" else "forward matmuls"
    return "attention" if kind == "attention" else "other ops"


def stage_weight(stage: str, accum: int) -> int:
    """How many micro-steps a traced one stands for: the middle one all between first and last."""
    if stage == "micro 1" and accum > 2:
        return accum - 2
    return 1


def in_compiled_block(stage: str, phase: str, block: int | None, call: OpCall) -> bool:
    """An op a compiled block fuses: not a matmul nor attention (Inductor keeps those as extern
    kernels), inside a block, in a micro-step."""
    return block is not None and stage.startswith("micro") and call.kind in ("other", "view")


def log_figures(log: OpLog, *, costs: Costs, accum: int, world: int, link: Link | None,
                compiled: str | None = None) -> dict[str, float]:
    """Seconds by category (and FLOPs, ``flops``) of one traced step. ``compiled``: "measured"
    leaves the compiled blocks' ops other than matmuls and attention out (a compiled block's
    measured time stands for them); "fused" costs the ops Inductor fuses away at nothing and each
    remaining one as the kernel that writes its result (the roofline's way)."""
    out = dict.fromkeys(CATEGORIES, 0.0)
    out.update(flops=0.0, ops=0.0, collective_bytes=0.0)
    for stage, phase, block, call, fused in log.calls:
        skip = (compiled == "measured" and in_compiled_block(stage, phase, block, call)) or \
            (compiled == "fused" and fused)
        if skip:
            out["flops"] += stage_weight(stage, accum) * log.costs[call].flops
            continue
        weight = stage_weight(stage, accum)
        cost = log.costs[call]
        where = category(stage, phase, call)
        if where == "communication":
            kind, nbytes = collective_kind(call)
            out[where] += weight * (link.seconds(kind, nbytes, world) if link else 0.0)
            out["collective_bytes"] += weight * nbytes
        else:
            out[where] += weight * costs.seconds(call, cost)
        out["flops"] += weight * cost.flops
        out["ops"] += weight
    return out


def ddp_allreduce_s(*, gradient_bytes: int, world: int, link: Link, bucket_bytes: int = 25 * 2**20) -> float:
    """DDP's gradient all-reduce (not traced: DDP cannot wrap FakeTensors): its buckets of
    ``bucket_bytes`` (torch's default 25 MiB), each a ring all-reduce."""
    buckets = max(1, math.ceil(gradient_bytes / bucket_bytes))
    return buckets * link.latency_s + link.seconds("all_reduce", gradient_bytes, world) - link.latency_s


def exposed_communication(figures: dict[str, float], *, comm_s: float, overlaps: bool, last_s: float) -> float:
    """Communication the step waits for: all of it where the device cannot overlap it with compute
    (gloo on the CPU cores the compute uses), else what exceeds the forward and backward compute,
    and at least the last collective (which nothing follows)."""
    if not overlaps:
        return comm_s
    compute = sum(figures[k] for k in ("forward matmuls", "backward matmuls", "attention", "other ops"))
    return max(comm_s - compute, min(comm_s, last_s))


def step_figures(ops: StepOps, **kwargs: Any) -> dict[str, float]:
    """``log_figures`` of the whole model's step (stacked from the short copies' logs)."""
    return ops.total(lambda log: log_figures(log, **kwargs))


def combine(typical: dict[str, float], heavy: dict[str, float] | None, *, every: int) -> dict[str, float]:
    """The mean step over ``every`` steps, one of them ``heavy`` (the auxiliary loss computed)."""
    if heavy is None or every <= 1:
        return dict(typical)
    return {k: (heavy.get(k, 0.0) + (every - 1) * typical.get(k, 0.0)) / every for k in {*typical, *heavy}}


def tensor_bytes(spec: TensorSpec) -> int:
    return spec.nbytes
