"""What CUDA libraries hold in PyTorch's caching allocator beside a training step's tensors.

A traced step counts the tensors the step creates; ``torch.cuda.max_memory_allocated`` also counts
cuBLAS's workspaces, which torch allocates through its caching allocator, one per (cuBLAS handle,
stream) pair, the first time a thread multiplies on a stream. ``bench/cuda_workspace.py`` measured
them on an H200 (torch 2.11.0+cu130, ``bench/RESULTS.md``): 32 MiB at the first matmul of the
Python thread, 32 MiB more at the first backward (autograd runs backward on its own device thread,
with its own handle), 32 MiB more for any other thread or side stream, 1 MiB of cuBLASLt workspace
for a matmul with a fused bias (optbench's models have no biases). So a training step holds two
workspaces: forward and optimizer on the Python thread, backward on autograd's.

The size is torch's ``CUBLAS_WORKSPACE_CONFIG`` default (``:4096:8``, 32 MiB, on compute capability
9.x; ``:4096:2:16:8``, 8 MiB + 128 KiB, elsewhere) unless that variable sets another.
"""

from __future__ import annotations

import os

from optbench.errors import ConfigError

KIB = 1024
STEP_THREADS = 2  # the Python thread (forward, optimizer step) and autograd's device thread (backward)
DEFAULT_CONFIG = {9: ":4096:8"}  # compute capability major -> torch's default; others ":4096:2:16:8"
OTHER_DEFAULT = ":4096:2:16:8"
GPU_CAPABILITY = {"h100": 9, "h200": 9, "a100": 8}  # estimate.gpu -> compute capability major


def parse_workspace_config(config: str) -> int:
    """Bytes of one workspace from a ``CUBLAS_WORKSPACE_CONFIG`` value (``:SIZE_KIB:COUNT`` pairs)."""
    fields = [f for f in config.split(":") if f]
    if not fields or len(fields) % 2 or not all(f.isdigit() for f in fields):
        raise ConfigError(f"CUBLAS_WORKSPACE_CONFIG={config!r} is not ':SIZE_KIB:COUNT[:SIZE_KIB:COUNT...]' (e.g. :4096:8); unset it for torch's default")
    return sum(int(size) * int(count) * KIB for size, count in zip(fields[::2], fields[1::2], strict=True))


def workspace_bytes(capability_major: int, env: dict[str, str] | None = None) -> int:
    """One cuBLAS workspace on a GPU of this compute capability (``CUBLAS_WORKSPACE_CONFIG`` first)."""
    config = (os.environ if env is None else env).get("CUBLAS_WORKSPACE_CONFIG")
    return parse_workspace_config(config or DEFAULT_CONFIG.get(capability_major, OTHER_DEFAULT))


def step_workspace_bytes(capability_major: int, env: dict[str, str] | None = None) -> int:
    """What cuBLAS holds through a training step: one workspace per thread that multiplies."""
    return STEP_THREADS * workspace_bytes(capability_major, env)
