"""Where a run executes: the device and, later, the process group."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from optbench.errors import IncompatibleError
from optbench.metrics import _cpu_name


@dataclass(frozen=True)
class Machine:
    """What this process can use: the device type asked for, CUDA devices present, CPU threads."""

    device: torch.device
    cuda_available: bool
    cuda_devices: int
    cpu_threads: int

    def describe(self) -> str:
        if self.device.type == "cuda":
            return f"{self.device} ({torch.cuda.get_device_name(self.device)})"
        return f"cpu ({_cpu_name()}, {self.cpu_threads} threads)"


def detect_machine(requested: str) -> Machine:
    """``requested`` is train.device: auto (CUDA when present), cpu or cuda."""
    cuda = torch.cuda.is_available()
    if requested == "cuda" and not cuda:
        raise IncompatibleError(
            "train.device=cuda but torch.cuda.is_available() is False "
            f"(torch {torch.__version__}); use train.device=cpu or train.device=auto"
        )
    use_cuda = cuda and requested in ("auto", "cuda")
    device = torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")
    return Machine(
        device=device,
        cuda_available=cuda,
        cuda_devices=torch.cuda.device_count() if cuda else 0,
        cpu_threads=torch.get_num_threads(),
    )
