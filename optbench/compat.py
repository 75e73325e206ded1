"""Pre-launch compatibility check of the whole config against this machine.

Runs before anything heavy is built. An impossible combination raises ``IncompatibleError`` whose
message names the option that blocks the run and the fix; the run is recorded with status
``incompatible``. Nothing is ever silently dropped: a run without the optimization it asked for
would report a false speedup.
"""

from __future__ import annotations

from optbench.config import Config
from optbench.distributed import Machine
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
    ("parallel", "ddp"), ("parallel", "fsdp2"),
    ("nccl", "tuned"),
}


def _not_yet_implemented(cfg: Config, machine: Machine) -> str | None:
    for group, value in sorted(NOT_YET_IMPLEMENTED):
        if getattr(cfg, group).name == value:
            return f"{group}={value} is not implemented in this build yet; leave {group} at its default"
    return None


RULES = [_not_yet_implemented, _tf32_needs_cuda]
