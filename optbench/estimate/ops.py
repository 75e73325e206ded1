"""The operators of a traced training step, recorded for the speed prediction
(``optbench.estimate.speed``): every aten op the memory trace runs on FakeTensors
(``optbench.estimate.memtrace``), with the shapes, strides and dtypes of its tensors, its FLOPs
(torch's ``flop_registry``) and the bytes it reads and writes, in which stage of the step it ran
(a micro-step's forward or backward, gradient clipping, the optimizer step) and in which block.

A call is recorded as a hashable ``OpCall`` whose tensors are ``TensorSpec``s: the same op on the
same shapes in every block is one key, so the per-op benchmark times it once
(``optbench.estimate.op_timings``) however deep the model is. Nothing here depends on optbench's own
model: any module the tracer runs (HF models included) is recorded the same way.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils._pytree as pytree

from optbench.estimate.stacking import Plan

aten = torch.ops.aten

# What each op is, for the breakdown: by the op's packet.
MATMUL_OPS = frozenset({aten.mm, aten.addmm, aten.bmm, aten.baddbmm, aten._scaled_mm, aten._int_mm})
ATTENTION_PREFIXES = ("_scaled_dot_product_", "_flash_attention", "_efficient_attention", "_cudnn_attention")
VIEW_OPS = frozenset({
    aten.view, aten._unsafe_view, aten.t, aten.transpose, aten.permute, aten.expand, aten.as_strided,
    aten.slice, aten.select, aten.unsqueeze, aten.squeeze, aten.alias, aten.detach, aten.split,
    aten.split_with_sizes, aten.unbind, aten.chunk, aten.view_as_real, aten.view_as_complex, aten.unflatten,
    aten.lift_fresh, aten.diagonal, aten._reshape_alias, aten.narrow,
})
METADATA_OPS = frozenset({aten.sym_size, aten.sym_stride, aten.sym_numel, aten.sym_storage_offset, aten.is_same_size})
COLLECTIVE_NAMESPACES = ("c10d", "_c10d_functional")


@dataclass(frozen=True)
class TensorSpec:
    """What a tensor argument looks like: enough to build a real one of the same layout."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        n = 1
        for size in self.shape:
            n *= size
        return n

    @property
    def nbytes(self) -> int:
        """Bytes an op touches reading it: broadcast (stride 0) dimensions once."""
        n = 1
        for size, stride in zip(self.shape, self.stride, strict=True):
            if stride:
                n *= size
        return n * self.dtype.itemsize


def spec_of(value: Any) -> Any:
    """A hashable stand-in for an op argument: tensors as TensorSpec, lists as tuples."""
    if isinstance(value, torch.Tensor):
        return TensorSpec(tuple(value.shape), tuple(value.stride()), value.dtype)
    if isinstance(value, (list, tuple)):
        return tuple(spec_of(v) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((k, spec_of(v)) for k, v in value.items()))
    if isinstance(value, (int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout,
                          torch.memory_format)):
        return value
    return ("opaque", type(value).__name__)  # a process group, a generator: not rebuilt, never timed


@dataclass(frozen=True)
class BlockInput:
    """A tensor a block was called with, and whether autograd tracks it."""

    spec: TensorSpec
    requires_grad: bool


def _inputs(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return BlockInput(spec_of(value), value.requires_grad)
    if isinstance(value, (list, tuple)):
        return tuple(_inputs(v) for v in value)
    return value


@dataclass(frozen=True)
class OpCall:
    """One op on tensors of given layouts (the key the benchmark times once)."""

    func: Any  # torch._ops.OpOverload
    args: tuple
    kwargs: tuple

    @property
    def name(self) -> str:
        return str(self.func.overloadpacket)

    @property
    def kind(self) -> str:
        """matmul | attention | view | collective | other (the stage decides optimizer/clip)."""
        packet = self.func.overloadpacket
        if packet in MATMUL_OPS:
            return "matmul"
        if self.func.namespace in COLLECTIVE_NAMESPACES:
            return "collective"
        if packet in VIEW_OPS or packet in METADATA_OPS:
            return "view"
        if self.func.namespace == "aten" and packet.__name__.startswith(ATTENTION_PREFIXES):
            return "attention"
        return "other"

    def tensors(self) -> list[TensorSpec]:
        return [v for v in pytree.tree_leaves((self.args, self.kwargs)) if isinstance(v, TensorSpec)]


@dataclass(frozen=True)
class Cost:
    """What the roofline needs of one call: FLOPs, bytes read and written, the dtype its FLOPs run in."""

    flops: int
    bytes: int
    dtype: torch.dtype | None


@dataclass
class OpLog:
    """The calls of one traced step in order: (stage, phase, block, call, fused). ``stage`` is set by
    the tracer as the step goes ("micro 0", "clip", "optimizer"); ``phase`` is forward/backward
    within a micro-step; ``block`` the index of the decoder block the op ran in (None outside
    blocks); ``fused``: a compiled block's op Inductor fuses into the kernel of a later one
    (``optbench.estimate.compiled_memory``)."""

    stage: str = "micro 0"
    calls: list[tuple[str, str, int | None, OpCall, bool]] = field(default_factory=list)
    costs: dict[OpCall, Cost] = field(default_factory=dict)
    block_inputs: dict[int, tuple] = field(default_factory=dict)  # block index -> (args, kwargs) as BlockInput

    def capture_block_inputs(self, blocks: Any) -> list:
        """Record what each block of ``blocks`` (the decoder's block container) is first called with (a compiled
        block is timed on real tensors of these shapes); returns the hook handles."""

        def hook(index: int) -> Callable:
            def record(module: Any, args: tuple, kwargs: dict) -> None:
                if index not in self.block_inputs:
                    self.block_inputs[index] = (_inputs(args), {k: _inputs(v) for k, v in kwargs.items()})
            return record

        return [block.register_forward_pre_hook(hook(int(name)), with_kwargs=True) for name, block in blocks.named_children()]

    def record(self, func: Any, args: tuple, kwargs: dict, out: Any, *, phase: str, block: int | None,
               fused: bool = False) -> None:
        if func.namespace == "profiler":  # record_function's bookkeeping (the optimizer's step marks)
            return
        call = OpCall(func, spec_of(args), spec_of(kwargs or {}))
        if call not in self.costs:
            self.costs[call] = _cost(func, args, kwargs or {}, out)
        self.calls.append((self.stage, phase, block, call, fused))

    def counts(self, *, stage_prefix: str = "") -> Counter:
        return Counter(call for stage, _, _, call, _ in self.calls if stage.startswith(stage_prefix))


# SDPA's ops: query, key and value are (batch, heads, seq, head_dim), after the output's gradient in
# the backward ones
_SDPA_KERNELS = ("flash_attention", "efficient_attention", "cudnn_attention", "flash_attention_for_cpu")
SDPA_FORWARD = frozenset(getattr(aten, f"_scaled_dot_product_{k}") for k in _SDPA_KERNELS)
SDPA_BACKWARD = frozenset(getattr(aten, f"_scaled_dot_product_{k}_backward") for k in _SDPA_KERNELS)


def grouped_query_flops(packet: Any, args: tuple) -> int | None:
    """FLOPs of an SDPA op whose key and value have fewer heads than its query (grouped-query attention,
    ``enable_gqa``, which transformers passes on CUDA): as the kernel runs it, each query head against
    its group's key and value, the count of the same op with key and value repeated to the query's
    heads. None for any other op. torch 2.11's counter refuses these shapes (it asserts equal heads:
    every Hugging Face Llama run's estimate failed so on an H200); 2.13's counts them the same way."""
    from torch.utils.flop_counter import sdpa_backward_flop_count, sdpa_flop_count

    backward = packet in SDPA_BACKWARD
    if not backward and packet not in SDPA_FORWARD:
        return None
    q, k, v = args[1:4] if backward else args[:3]
    if k.dim() != 4 or k.shape[1] == q.shape[1]:
        return None
    k_shape, v_shape = [(t.shape[0], q.shape[1], *t.shape[2:]) for t in (k, v)]
    if backward:
        return sdpa_backward_flop_count(args[0].shape, q.shape, k_shape, v_shape)
    return sdpa_flop_count(q.shape, k_shape, v_shape)


def _cost(func: Any, args: tuple, kwargs: dict, out: Any) -> Cost:
    packet = func.overloadpacket
    outs = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
    ins = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    nbytes = sum(spec_of(t).nbytes for t in ins + outs)
    dtype = args[0].dtype if packet is aten._scaled_mm else ins[0].dtype if ins else None
    flops = grouped_query_flops(packet, args)
    if flops is None:
        flops = _counted_flops(packet, args, kwargs, out)
    return Cost(flops=int(flops), bytes=int(nbytes), dtype=dtype)


def _counted_flops(packet: Any, args: tuple, kwargs: dict, out: Any) -> int:
    """An op's FLOPs by torch's counter (``flop_registry``); 0 for an op it does not count."""
    from torch.utils.flop_counter import flop_registry, sdpa_backward_flop_count, sdpa_flop_count

    if packet in flop_registry:
        return flop_registry[packet](*args, **kwargs, out_val=out)
    if packet is aten._scaled_dot_product_flash_attention_for_cpu:  # CPU's flash kernel: torch counts only CUDA's
        return sdpa_flop_count(args[0].shape, args[1].shape, args[2].shape)
    if packet is aten._scaled_dot_product_flash_attention_for_cpu_backward:
        return sdpa_backward_flop_count(args[0].shape, args[1].shape, args[2].shape, args[3].shape)
    return 0


@dataclass
class StepOps:
    """The op logs of a traced step: the whole model's (``plan`` None), or two short copies' that
    stack like the memory trace (``optbench.estimate.stacking``): a figure per unit of blocks grows
    linearly, so the whole model's is ``b + extra (b - a)``."""

    logs: list[OpLog]
    plan: Plan | None

    def total(self, figures: Callable[[OpLog], dict[str, float]]) -> dict[str, float]:
        """``figures`` of the whole model's step, from its log or stacked from the copies'."""
        if self.plan is None:
            return figures(self.logs[0])
        a, b = figures(self.logs[0]), figures(self.logs[1])
        return {k: b.get(k, 0.0) + self.plan.extra * (b.get(k, 0.0) - a.get(k, 0.0)) for k in {*a, *b}}

    def weighted(self) -> Any:
        """(weight, log, call record) of every recorded call, weighted so that a sum over them is
        the whole model's: 1 each for one log; ``1 + extra`` for copy b's and ``-extra`` for copy
        a's when two copies stack."""
        if self.plan is None:
            weights = [1.0]
        else:
            weights = [-float(self.plan.extra), 1.0 + self.plan.extra]
        for weight, log in zip(weights, self.logs, strict=True):
            for record in log.calls:
                yield weight, log, record
