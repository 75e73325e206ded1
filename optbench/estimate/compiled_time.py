"""A compiled step's blocks, timed on this machine: Inductor's kernels cannot be costed op by op
(they fuse the block's elementwise ops into generated loops), so one block of each kind is built,
wrapped and compiled exactly as ``optbench train`` does it (``optbench.training.parallelize``), and
its forward and backward timed on real tensors of the shapes the traced step fed it. The blocks'
matmuls and attention stay extern kernels under Inductor (the same aten ops the per-op benchmark
times), so they keep their per-op cost; what the compiled block takes beyond them replaces the
block's other ops ("other ops" in the breakdown). The blocks and those matmuls and attention, each
on its own real tensors, are timed in the same rounds, all of them in every round
(``op_timings.time_rounds`` in lockstep): the difference is taken between times of the same moments
of the machine, not of two benchmarks seconds apart.

A kind is a block's index modulo the activation-checkpointing period (every ``every``-th block is
checkpointed under selective AC, all or none otherwise): a short model of one period holds one
block of each kind.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import torch

from optbench.config import Config
from optbench.estimate.op_timings import real_args, real_tensor, time_rounds
from optbench.estimate.ops import BlockInput, OpCall, OpLog


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


def kept_calls(log: OpLog, *, period: int) -> list[list[OpCall]]:
    """Per kind, a block's matmuls and attention in the first micro-step, in the step's order."""
    out: list[list[OpCall]] = [[] for _ in range(period)]
    for stage, _, block, call, _ in log.calls:
        if stage == "micro 0" and block is not None and block < period and call.kind in ("matmul", "attention"):
            out[block].append(call)
    return out


def time_compiled_blocks(cfg: Config, *, log: OpLog, device: torch.device) -> CompiledBlocks:
    """Build a model of one AC period, parallelized as training does (compile included), and time
    each block's forward + backward on real tensors shaped as the traced step fed it
    (``log.block_inputs``), in the same rounds as the block's matmuls and attention per op."""
    from optbench.estimate.memtrace import _cpu_machine
    from optbench.tasks import build_task
    from optbench.training.build import build_model, materialize
    from optbench.training.kinds import model_spec
    from optbench.training.parallelize import parallelize

    period = cfg.ac.every if cfg.ac.name == "selective" else 1
    short = dataclasses.replace(cfg, model=cfg.model.with_layers(period),
                                parallel=dataclasses.replace(cfg.parallel, name="single", nproc_per_node=1))
    kept = kept_calls(log, period=period)
    with torch.random.fork_rng(devices=[]):
        model = build_model(short, build_task(short))
        parallelize(model, cfg=short, machine=_cpu_machine())
        materialize(model, device=device, seed=0)
        entries: dict[Any, Any] = {}  # key -> run it once; blocks and ops alternate in the step's order
        for index, (_, block) in enumerate(model_spec(short).main_blocks(model)[1].named_children()):
            run = _block_runner(block, *_real_inputs(log.block_inputs[index], device), precision=cfg.precision,
                                device=device)
            run()  # compiles the forward, then the backward
            entries[("block", index)] = run
            for call in kept[index]:
                if call not in entries:
                    args, kwargs = real_args(call, device)
                    entries[call] = functools.partial(call.func, *args, **kwargs)
        seconds = time_rounds(list(entries.items()), device=device, lockstep=True)
    return CompiledBlocks(period=period, seconds_by_kind=[seconds[("block", i)] for i in range(period)],
                          mode=cfg.compile.name, eager_kept_s=[sum(seconds[call] for call in calls) for calls in kept])


def _real_inputs(captured: tuple, device: torch.device) -> tuple[list, dict]:
    args, kwargs = captured

    def build(value: Any) -> Any:
        if isinstance(value, BlockInput):
            return real_tensor(value.spec, device).clone().requires_grad_(value.requires_grad)
        if isinstance(value, tuple):
            return [build(v) for v in value]
        return value

    return [build(v) for v in args], {k: build(v) for k, v in kwargs.items()}


def _block_runner(block: torch.nn.Module, args: list, kwargs: dict, *, precision: Any, device: torch.device) -> Any:
    """One forward + backward of ``block`` on ``args`` (with autograd on and the run's autocast)."""
    from optbench.training.precision import maybe_autocast

    def run() -> None:
        with torch.enable_grad(), maybe_autocast(precision, device=device):
            out = block(*args, **kwargs)
            torch.autograd.backward(out, torch.ones_like(out))

    return run
