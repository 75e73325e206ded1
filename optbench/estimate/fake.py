"""Stand-ins the memory trace runs on instead of real hardware: RMSNorm that keeps for backward
what torch's CUDA kernel keeps (so a trace on a CPU estimates a GPU), and a DeviceMesh over a fake
process group (so FSDP2 shards for ``world_size`` ranks in one process, without communication)."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from optbench.errors import ConfigError


# ------------------------------------------------------------------------ CUDA's saved tensors
def _rms_norm_parts(x: torch.Tensor, dims: tuple[int, ...], eps: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    upcast = x.float()
    eps = torch.finfo(x.dtype).eps if eps is None else eps
    rstd = torch.rsqrt(upcast.pow(2).mean(dims, keepdim=True) + eps)
    return upcast * rstd, rstd


class _FusedRMSNorm(torch.autograd.Function):
    """RMSNorm as torch's CUDA kernel (``aten::_fused_rms_norm``) is differentiated: autograd keeps the
    input, rstd and weight. On a CPU the op decomposes and autograd keeps an fp32 upcast of the input
    and the fp32 normalized tensor as well (2-4x the activation bytes of each norm)."""

    @staticmethod
    def forward(ctx, x, normalized_shape, weight, eps):  # noqa: ANN001, ANN205
        dims = tuple(range(-len(normalized_shape), 0))
        normed, rstd = _rms_norm_parts(x, dims, eps)
        out = normed if weight is None else normed * weight
        ctx.save_for_backward(x, rstd, weight)
        ctx.dims = dims
        return out.type_as(x)

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001, ANN205
        x, rstd, weight = ctx.saved_tensors
        normed = x.float() * rstd
        grad_weight = None
        if weight is not None:
            grad_weight = (grad.float() * normed).sum(tuple(range(grad.dim() - weight.dim()))).to(weight.dtype)
            grad = grad.float() * weight
        grad = grad.float()
        mean = (grad * normed).mean(ctx.dims, keepdim=True)
        grad_x = (grad - normed * mean) * rstd
        return grad_x.type_as(x), None, grad_weight, None


def use_cuda_rms_norm(model: nn.Module) -> int:
    """Make every RMSNorm of ``model`` keep for backward what torch's CUDA kernel keeps, so a trace on
    this CPU estimates a GPU. Only for the estimate's own fake model (an instance attribute; checkpoint
    recomputation calls it too). Returns how many norms were changed."""
    norms = [m for m in model.modules() if isinstance(m, nn.RMSNorm)]
    for norm in norms:
        norm.forward = functools.partial(_cuda_rms_norm_forward, norm)
    return len(norms)


def _cuda_rms_norm_forward(norm: nn.RMSNorm, x: torch.Tensor) -> torch.Tensor:
    return _FusedRMSNorm.apply(x, list(norm.normalized_shape), norm.weight, norm.eps)


# ------------------------------------------------------------------- what a real run reads from values
@contextlib.contextmanager
def unpacked_positions() -> Iterator[None]:
    """Inside: transformers' check for packed sequences answers "not packed", as it does in the run.

    Without an attention mask transformers reads the position ids' values to detect several sequences
    packed into one row (``masking_utils.find_packed_sequence_indices``); on real tensors it finds none
    (optbench never passes position ids: they are transformers' own ``arange``), so the causal mask is
    skipped and SDPA runs with ``is_causal=True`` (grouped KV heads unexpanded). A FakeTensor has no
    values, so transformers assumes packing and builds a ``(batch, 1, seq, seq)`` mask, which forces
    SDPA to expand K and V to every head: on a 2-block Llama, 262,144 bytes above the run's peak.
    The check still computes what it computes (its ops are the run's); only its answer is the run's.
    Nothing changes where transformers is not imported or has no such check."""
    import sys

    masking = sys.modules.get("transformers.masking_utils")
    original = getattr(masking, "find_packed_sequence_indices", None)
    if original is None:
        yield
        return

    def not_packed(position_ids: torch.Tensor) -> None:
        original(position_ids)

    masking.find_packed_sequence_indices = not_packed
    try:
        yield
    finally:
        masking.find_packed_sequence_indices = original


# ---------------------------------------------------------------------------------- the FSDP part
@contextlib.contextmanager
def fake_mesh(world_size: int) -> Iterator[Any]:
    """A 1-D DeviceMesh of ``world_size`` ranks on a fake process group (no communication). Inside a
    real distributed run (a default group exists) the fake group is a subgroup of it, so every rank
    must enter this together, as every rank of ``optbench train`` does."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore  # also registers "fake"

    _forget_dtensor_plans()
    if dist.is_initialized():
        if dist.get_world_size() != world_size:
            raise ConfigError(
                f"cannot trace {world_size} ranks inside a job of {dist.get_world_size()}; run "
                "`optbench estimate` outside the job for another world size"
            )
        group = dist.new_group(backend="fake")
        try:
            yield DeviceMesh.from_group(group, "cpu")
        finally:
            dist.destroy_process_group(group)
            _forget_dtensor_plans()
        return
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        yield init_device_mesh("cpu", (world_size,))
    finally:
        dist.destroy_process_group()
        _forget_dtensor_plans()


def _forget_dtensor_plans() -> None:
    """Clear DTensor's caches of sharding and redistribution plans. A DeviceMesh hashes and compares
    by its ranks and layout, not by its process group, so plans cached for the fake mesh would be
    reused for a real mesh of the same shape (and the reverse): a training run after an estimate in
    the same process would all-reduce gradient norms over the destroyed fake group."""
    from torch.distributed.tensor._collective_utils import MeshTopoInfo
    from torch.distributed.tensor._redistribute import _gen_transform_infos, clear_redistribute_planner_cache
    from torch.distributed.tensor._sharding_prop import ShardingPropagator
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    _clear_sharding_prop_cache()
    ShardingPropagator._propagate_tensor_meta_cached.cache_clear()
    _gen_transform_infos.cache_clear()
    clear_redistribute_planner_cache()
    MeshTopoInfo.build_from_mesh.cache_clear()
