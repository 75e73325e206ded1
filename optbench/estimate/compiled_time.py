"""A compiled step's blocks, timed on this machine: Inductor's kernels cannot be costed op by op
(they fuse the block's elementwise ops into generated loops), so one block of each kind is built,
wrapped and compiled exactly as ``optbench train`` does it (``optbench.training.parallelize``), and
its forward and backward timed on real tensors of the shapes the traced step fed it. The blocks'
matmuls and attention stay extern kernels under Inductor (the same aten ops the per-op benchmark
times), so they keep their per-op cost; what the compiled block takes beyond them replaces the
block's other ops ("other ops" in the breakdown).

A kind is a block's index modulo the activation-checkpointing period (every ``every``-th block is
checkpointed under selective AC, all or none otherwise): a short model of one period holds one
block of each kind.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Any

import torch

from optbench.config import Config
from optbench.estimate.opbench import real_tensor
from optbench.estimate.ops import BlockInput, OpLog
from optbench.model.decoder import blocks_of

REPEATS = 5


@dataclasses.dataclass
class CompiledBlocks:
    """Forward+backward seconds of one compiled block of each kind (index modulo ``period``)."""

    period: int
    seconds_by_kind: list[float]
    mode: str
    eager_kept_s: list[float] = dataclasses.field(default_factory=list)  # its matmuls + attention, per-op

    def other_seconds(self, *, layers: int) -> float:
        """One micro-step's blocks beyond their matmuls and attention."""
        return sum(max(0.0, self.seconds_by_kind[i % self.period] - self.eager_kept_s[i % self.period])
                   for i in range(layers))

    def describe(self) -> dict[str, Any]:
        return {"mode": self.mode, "period": self.period, "block_fwd_bwd_s": self.seconds_by_kind,
                "of_which_matmuls_and_attention_s": self.eager_kept_s,
                "method": "one compiled block of each kind timed here on real tensors (forward + backward), "
                          "stacked over the blocks"}


def kept_seconds(log: OpLog, *, period: int, seconds: Any) -> list[float]:
    """Per kind, the per-op seconds of a block's matmuls and attention in the first micro-step."""
    out = [0.0] * period
    for stage, _, block, call, _ in log.calls:
        if stage == "micro 0" and block is not None and block < period and call.kind in ("matmul", "attention"):
            out[block] += seconds(call, log.costs[call])
    return out


def time_compiled_blocks(cfg: Config, *, inputs: dict[int, tuple], device: torch.device) -> CompiledBlocks:
    """Build a model of one AC period, parallelized as training does (compile included), and time
    each block's forward + backward on real tensors shaped as ``inputs`` (block index -> the specs
    the traced step called it with, ``OpLog.block_inputs``)."""
    from optbench.estimate.memtrace import _cpu_machine
    from optbench.tasks import build_task
    from optbench.training.build import build_model, materialize
    from optbench.training.parallelize import parallelize
    from optbench.training.precision import maybe_autocast

    period = cfg.ac.every if cfg.ac.name == "selective" else 1
    short = dataclasses.replace(cfg, model=cfg.model.with_layers(period),
                                parallel=dataclasses.replace(cfg.parallel, name="single", nproc_per_node=1))
    with torch.random.fork_rng(devices=[]):
        model = build_model(short, build_task(short))
        parallelize(model, cfg=short, machine=_cpu_machine())
        materialize(model, device=device, seed=0)
        seconds = []
        for index, (_, block) in enumerate(blocks_of(model)):
            args, kwargs = _real_inputs(inputs[index], device)
            with maybe_autocast(cfg.precision, device=device):
                seconds.append(_time_block(block, args, kwargs, device=device))
    return CompiledBlocks(period=period, seconds_by_kind=seconds, mode=cfg.compile.name)


def _real_inputs(captured: tuple, device: torch.device) -> tuple[list, dict]:
    args, kwargs = captured

    def build(value: Any) -> Any:
        if isinstance(value, BlockInput):
            return real_tensor(value.spec, device).clone().requires_grad_(value.requires_grad)
        if isinstance(value, tuple):
            return [build(v) for v in value]
        return value

    return [build(v) for v in args], {k: build(v) for k, v in kwargs.items()}


def _time_block(block: torch.nn.Module, args: list, kwargs: dict, *, device: torch.device) -> float:
    from optbench.measure import synchronize

    def once() -> float:
        synchronize(device)
        start = time.perf_counter()
        out = block(*args, **kwargs)
        torch.autograd.backward(out, torch.ones_like(out))
        synchronize(device)
        return time.perf_counter() - start

    once()  # compiles the forward, then the backward
    once()
    return statistics.median(once() for _ in range(REPEATS))  # typical, as the per-op benchmark's
