"""Pre-launch compatibility check of the whole config against this machine.

Runs before anything heavy is built. An impossible combination raises ``IncompatibleError`` whose
message names the option that blocks the run and the fix; the run is recorded with status
``incompatible``. Nothing is ever silently dropped: a run without the optimization it asked for
would report a false speedup.
"""

from __future__ import annotations

from optbench.config import Config
from optbench.distributed import Machine, resolve_backend
from optbench.errors import IncompatibleError


def check(cfg: Config, machine: Machine) -> None:
    """Raise IncompatibleError for the first rule the config breaks on this machine."""
    for rule in RULES:
        message = rule(cfg, machine)
        if message:
            raise IncompatibleError(message)


def _tf32_needs_cuda(cfg: Config, machine: Machine) -> str | None:
    if cfg.precision.tf32 and machine.device.type != "cuda":
        return (
            f"precision={cfg.precision.name} needs CUDA tensor cores; on CPU the matmuls would run in "
            "plain fp32 and the run would be mislabelled: use precision=fp32 on CPU"
        )
    return None


# Presets that exist (so configs and phases compose) but whose implementation has not landed in
# this build; each change that implements one removes it from this set.
NOT_YET_IMPLEMENTED = {
    ("compile", "default"), ("compile", "reduce-overhead"), ("compile", "max-autotune"),
    ("attention", "flex"),
}


def _not_yet_implemented(cfg: Config, machine: Machine) -> str | None:
    for group, value in sorted(NOT_YET_IMPLEMENTED):
        if getattr(cfg, group).name == value:
            return f"{group}={value} is not implemented in this build yet; leave {group} at its default"
    return None


def _fsdp2_needs_ranks(cfg: Config, machine: Machine) -> str | None:
    if cfg.parallel.mode == "fsdp2" and machine.world_size < 2:
        return (
            "parallel=fsdp2 with world size 1 has nothing to shard (every parameter would stay whole on "
            "one rank); set parallel.nproc_per_node=2 or more (or torchrun --nproc-per-node), or use "
            "parallel=single"
        )
    return None


def _single_is_one_process(cfg: Config, machine: Machine) -> str | None:
    if cfg.parallel.mode == "single" and machine.world_size > 1:
        return (
            f"parallel=single but torchrun started {machine.world_size} processes, which would each train "
            "alone; use parallel=ddp or parallel=fsdp2 under torchrun"
        )
    return None


def _workers_fit_gpus(cfg: Config, machine: Machine) -> str | None:
    if machine.device.type == "cuda" and machine.local_world_size > machine.cuda_devices:
        return (
            f"{machine.local_world_size} workers per node need {machine.local_world_size} GPUs but torch sees "
            f"{machine.cuda_devices}; set parallel.nproc_per_node={machine.cuda_devices} (one worker per GPU)"
        )
    return None


def _backend_available(cfg: Config, machine: Machine) -> str | None:
    if cfg.parallel.mode == "single":
        return None
    try:
        resolve_backend(cfg.parallel.backend, device=machine.device)
    except IncompatibleError as exc:
        return str(exc)
    return None


RULES = [
    _not_yet_implemented, _tf32_needs_cuda, _single_is_one_process, _fsdp2_needs_ranks, _workers_fit_gpus,
    _backend_available,
]
