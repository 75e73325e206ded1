"""Data parallelism: FSDP2 (``fully_shard``) and DDP, applied in place to the meta-device model.

* ``apply_fsdp`` shards every transformer block, then the root, with a ``MixedPrecisionPolicy``
  derived from the precision group (bf16 params with fp32 gradient reduction for ``precision=bf16``).
* ``apply_ddp`` uses ``torch.distributed._composable.replicate``: torch's DistributedDataParallel
  applied in place (as torchtitan's ``apply_ddp`` does), so it composes with building on the meta
  device, keeps parameter names (checkpoints are portable between single, ddp and fsdp2) and
  offers the same ``set_requires_gradient_sync`` as FSDP2 for gradient accumulation.
* ``maybe_full_tensor_init`` makes FSDP2's sharded initialization bit-identical to the unsharded
  one, so every parallel mode starts from the same weights for the same seed.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from optbench.config import PrecisionConfig
from optbench.training.precision import DTYPES

log = logging.getLogger(__name__)


def build_mp_policy(cfg: PrecisionConfig) -> Any:
    """FSDP2's MixedPrecisionPolicy from the precision group: parameters all-gathered and computed
    in the autocast dtype, gradients reduced in fp32 (fp32 runs keep everything in fp32)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if cfg.autocast is None:
        return MixedPrecisionPolicy(param_dtype=None, reduce_dtype=None)
    return MixedPrecisionPolicy(param_dtype=DTYPES[cfg.autocast], reduce_dtype=torch.float32)


def _dtype_name(dtype: torch.dtype | None) -> str:
    return str(dtype or torch.float32).removeprefix("torch.")


def apply_fsdp(
    model: nn.Module, *, blocks: nn.Module, world_size: int, device_type: str, mp_policy: Any,
    reshard_after_forward: bool, cpu_offload: bool = False, mesh: Any = None,
) -> dict[str, Any]:
    """``fully_shard`` each block of ``blocks``, then ``model`` (the root: embedding, final norm,
    head), over a 1-D mesh of ``world_size`` ranks: ``mesh`` when given (``optbench estimate`` passes
    one on a fake process group), else one built on the default process group.

    ``cpu_offload`` applies FSDP2's ``CPUOffloadPolicy``: sharded parameters, gradients and
    optimizer state live in (pinned) host memory, are copied to the GPU for each all-gather, and
    the optimizer steps on the CPU. Preconditions: the process group is initialized; ``model`` is on
    the meta device, after activation checkpointing and compile (it shards the wrapped/compiled
    blocks); ``cpu_offload`` only on CUDA (compat refuses it on a CPU run, where it would move
    nothing). The root is never resharded after forward (its parameters are needed first in
    backward anyway)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

    if mesh is None:
        mesh = init_device_mesh(device_type, (world_size,))
    offload = CPUOffloadPolicy(pin_memory=device_type == "cuda") if cpu_offload else OffloadPolicy()
    for block in blocks.children():  # a ModuleDict of every group's blocks, or the decoder's ModuleList
        fully_shard(block, mesh=mesh, mp_policy=mp_policy, reshard_after_forward=reshard_after_forward,
                    offload_policy=offload)
    fully_shard(model, mesh=mesh, mp_policy=mp_policy, reshard_after_forward=False, offload_policy=offload)
    policy = {
        "param_dtype": _dtype_name(mp_policy.param_dtype),
        "reduce_dtype": _dtype_name(mp_policy.reduce_dtype),
    }
    log.info("Applied FSDP2 to %d blocks and the root over %d ranks (%s, reshard_after_forward=%s, "
             "cpu_offload=%s)", len(list(blocks.children())), world_size, policy, reshard_after_forward, cpu_offload)
    return {
        "mode": "fsdp2", "world_size": world_size, "sharded_blocks": len(list(blocks.children())),
        "mp_policy": policy, "reshard_after_forward": reshard_after_forward, "cpu_offload": cpu_offload,
    }


def apply_ddp(model: nn.Module, *, world_size: int, device: torch.device, compiled: bool) -> dict[str, Any]:
    """DistributedDataParallel over ``world_size`` ranks, in place (``replicate``): DDP is built at
    the first forward, after the weights are materialized, and broadcasts rank 0's parameters.

    Preconditions: the process group is initialized. With compiled blocks, dynamo's DDP optimizer
    (``torch._dynamo.config.optimize_ddp = "ddp_optimizer"``) splits compiled graphs at bucket
    boundaries so gradient all-reduce overlaps the backward pass."""
    from torch.distributed._composable.replicate import replicate

    optimize_ddp = None
    if compiled:
        torch._dynamo.config.optimize_ddp = "ddp_optimizer"
        optimize_ddp = "ddp_optimizer"
    replicate(model, device_id=device if device.type == "cuda" else torch.device("cpu"))
    log.info("Applied DDP over %d ranks (optimize_ddp=%s)", world_size, optimize_ddp)
    return {"mode": "ddp", "world_size": world_size, "optimize_ddp": optimize_ddp}


def build_sharded_grad_scaler(*, device: torch.device) -> Any:
    """fp16 loss scaling for FSDP2: each rank sees only its gradient shards, so the overflow check
    is all-reduced (torch's ShardedGradScaler) and every rank skips the same steps."""
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    return ShardedGradScaler(device=device.type)


def set_gradient_sync(model: nn.Module, enabled: bool) -> None:
    """Turn gradient all-reduce (DDP) / reduce-scatter (FSDP2) off for the non-final micro-steps of
    gradient accumulation and back on for the last; a no-op for a single process."""
    setter = getattr(model, "set_requires_gradient_sync", None)
    if setter is not None:
        setter(enabled)


def _dtensor_type() -> type | None:
    """DTensor, if torch.distributed.tensor is loaded (FSDP2 loads it; importing it costs seconds,
    so a single-process run does not)."""
    module = sys.modules.get("torch.distributed.tensor")
    return module.DTensor if module is not None else None


def is_sharded(model: nn.Module) -> bool:
    dtensor = _dtensor_type()
    return dtensor is not None and any(isinstance(p, dtensor) for p in model.parameters())


def full_tensor(value: torch.Tensor) -> torch.Tensor:
    """A DTensor's full value (e.g. FSDP2's total gradient norm); a plain tensor as it is."""
    dtensor = _dtensor_type()
    return value.full_tensor() if dtensor is not None and isinstance(value, dtensor) else value


_RANDOM_INIT_OPS = {
    torch.ops.aten.normal_, torch.ops.aten.uniform_, torch.ops.aten.bernoulli_,
    torch.ops.aten.exponential_, torch.ops.aten.log_normal_, torch.ops.aten.cauchy_,
    torch.ops.aten.geometric_, torch.ops.aten.random_,
}


class _FullTensorRandomInit(TorchDispatchMode):
    """A random in-place op on a sharded DTensor draws the *full* tensor from the global RNG, as an
    unsharded model would, and keeps this rank's shard. DTensor's own random ops draw per-shard
    values instead (and are only partly supported on a CPU mesh), so a sharded model would start
    from other weights than the same seed gives in a single process or under DDP."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        from torch.distributed.tensor import DTensor, distribute_tensor

        kwargs = kwargs or {}
        target = args[0] if args else None
        if func._overloadpacket in _RANDOM_INIT_OPS and isinstance(target, DTensor):
            full = torch.empty(target.shape, dtype=target.dtype, device=target.to_local().device)
            func(full, *args[1:], **kwargs)
            shard = distribute_tensor(full, target.device_mesh, target.placements, src_data_rank=None)
            target.to_local().copy_(shard.to_local())
            return target
        return func(*args, **kwargs)


@contextlib.contextmanager
def maybe_full_tensor_init(model: nn.Module) -> Iterator[None]:
    """Around ``init_weights()``: for an FSDP2-sharded model, initialize so that the gathered
    weights equal the unsharded model's for the same seed (one full parameter at a time, so the
    extra memory is the largest parameter); otherwise do nothing."""
    if not is_sharded(model):
        yield
        return
    with _FullTensorRandomInit():
        yield


def ddp_gradient_buckets(model: nn.Module) -> tuple[int, bool] | None:
    """DDP's gradient buckets, read from DDP itself: their total bytes (the reducer's logging data)
    and whether DDP has rebuilt them yet (it does once, in the forward of its second iteration, in
    the order the first backward produced gradients: new buckets replace the ones built with DDP).
    None for a model without DDP, before ``replicate`` built it (at the first forward), or where
    this torch does not say (private interfaces)."""
    try:
        from torch.distributed._composable.replicate import replicate

        state = replicate.state(model)
        ddp = getattr(state, "_ddp", None) if state is not None else None
        if ddp is None:
            return None
        data = ddp._get_ddp_logging_data()
        sizes = data.get("rebuilt_bucket_sizes") or data.get("bucket_sizes")
        return sum(int(x) for x in str(sizes).split(",") if x.strip()), bool(ddp._has_rebuilt_buckets)
    except Exception as exc:  # a private interface: any change reads as "not known"
        log.warning("cannot read DDP's gradient buckets (%s)", exc)
        return None


def ddp_buckets_outside(before: tuple[int, bool] | None, after: tuple[int, bool] | None) -> int:
    """Bytes of DDP gradient buckets that existed through a step a MemTracker followed but were
    allocated before it (so the tracker never saw them): all of them, unless DDP was built or
    rebuilt its buckets inside that step (then the tracker saw the allocation). ``before`` and
    ``after`` are ``ddp_gradient_buckets`` read around the step."""
    return before[0] if before is not None and before == after else 0
