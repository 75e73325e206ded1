"""What CUDA libraries hold in PyTorch's caching allocator beside a training step's tensors.

A traced step counts the tensors the step creates; ``torch.cuda.max_memory_allocated`` also counts
cuBLAS's workspaces, which torch allocates through its caching allocator, one per (cuBLAS handle,
stream) pair, the first time a thread multiplies on a stream. ``bench/cuda_workspace.py`` measured
them on an H200 (torch 2.11.0+cu130, ``bench/RESULTS.md``): 32 MiB at the first matmul of the
Python thread, 32 MiB more at the first backward (autograd runs backward on its own device thread,
with its own handle), 32 MiB more for any other thread or side stream, 1 MiB of cuBLASLt workspace
for a matmul with a fused bias (optbench's models have no biases). So a training step holds two
workspaces: forward and optimizer on the Python thread, backward on autograd's.

The size is torch's ``CUBLAS_WORKSPACE_CONFIG`` default unless that variable sets another, read as
torch reads it (every ``:SIZE_KIB:COUNT`` pair summed; a value with none is ignored, with torch's
own warning, for the default): ``:4096:8`` (32 MiB) on compute capability 9 (measured), and in
recent torch also on 10, 11 and 12 (pytorch/pytorch#175344, #189312; not measured here);
``:4096:2:16:8`` (8 MiB + 128 KiB) elsewhere.
"""

from __future__ import annotations

import logging
import os
import re

from optbench.errors import ConfigError

log = logging.getLogger(__name__)

KIB = 1024
STEP_THREADS = 2  # the Python thread (forward, optimizer step) and autograd's device thread (backward)
HOPPER_ON = (9, 10, 11, 12)  # compute capability majors torch gives ":4096:8" by default
HOPPER_DEFAULT, OTHER_DEFAULT = ":4096:8", ":4096:2:16:8"
GPU_CAPABILITY = {"h100": 9, "h200": 9, "a100": 8}  # estimate.gpu -> compute capability major
_PAIR = re.compile(r":([0-9]+):([0-9]+)")
MAX_WORKSPACE = 2**40  # bytes: no GPU holds a terabyte; a larger workspace is a typo (KiB given as bytes...)


def parse_workspace_config(config: str) -> int:
    """Bytes of one workspace from a ``CUBLAS_WORKSPACE_CONFIG`` value, as torch parses it: the
    ``:SIZE_KIB:COUNT`` pairs in it, summed (0 when it holds none)."""
    return sum(int(size) * int(count) for size, count in _PAIR.findall(config)) * KIB


def workspace_bytes(capability_major: int, env: dict[str, str] | None = None) -> int:
    """One cuBLAS workspace on a GPU of this compute capability (``CUBLAS_WORKSPACE_CONFIG`` first)."""
    default = parse_workspace_config(HOPPER_DEFAULT if capability_major in HOPPER_ON else OTHER_DEFAULT)
    config = (os.environ if env is None else env).get("CUBLAS_WORKSPACE_CONFIG")
    if not config:
        return default
    size = parse_workspace_config(config)
    if size > MAX_WORKSPACE:
        raise ConfigError(
            f"CUBLAS_WORKSPACE_CONFIG={config} asks cuBLAS for {size / 2**30:,.0f} GiB per workspace, more than "
            f"any GPU holds; give :SIZE_KIB:COUNT pairs in KiB (torch's default is {HOPPER_DEFAULT}) or unset it")
    if not size:
        log.warning("CUBLAS_WORKSPACE_CONFIG=%r holds no ':SIZE_KIB:COUNT' pair: torch ignores it, and so does "
                    "the estimate (its default, %d bytes per workspace)", config, default)
        return default
    return size


def step_workspace_bytes(capability_major: int, env: dict[str, str] | None = None) -> int:
    """What cuBLAS holds through a training step: one workspace per thread that multiplies."""
    return STEP_THREADS * workspace_bytes(capability_major, env)
