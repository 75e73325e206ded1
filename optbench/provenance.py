"""What a run was measured with (summary.json ``provenance``, ``optbench --version``): optbench's
version and git commit (and whether the tree had uncommitted changes), the versions of every package
that changes numbers, the GPU (name, driver, CUDA/HIP, cuDNN) and the CPU model. Two runs a month
apart are told apart by it; ``optbench report`` says in one line when the runs it pools differ.

Read once per process (git and nvidia-smi are subprocesses); nothing here fails a run: what cannot
be read is null, and ``git.why`` says why the commit is."""

from __future__ import annotations

import copy
import functools
import platform
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

# the packages whose version can change a number optbench measures or computes
PACKAGES = ("torch", "transformers", "tokenizers", "safetensors", "torchao", "triton", "numpy", "scipy",
            "xarray", "h5py", "h5netcdf", "zarr", "numcodecs", "deflate", "cftime", "hydra-core", "omegaconf")


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def _run(*command: str, cwd: Path | None = None) -> str | None:
    try:
        done = subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def git_state() -> dict[str, Any]:
    """The commit of the checkout optbench runs from, and whether tracked files differ from it; null
    for an installed package (no checkout) or without git, ``why`` saying which."""
    source = Path(__file__).resolve().parent.parent
    if not (source / ".git").exists():
        return {"commit": None, "dirty": None, "why": f"optbench is not run from a git checkout ({source})"}
    commit = _run("git", "rev-parse", "HEAD", cwd=source)
    if commit is None:
        return {"commit": None, "dirty": None, "why": "git is not installed or cannot read the checkout"}
    status = _run("git", "status", "--porcelain", "--untracked-files=no", cwd=source)
    return {"commit": commit, "dirty": None if status is None else bool(status), "why": None}


def gpu_state() -> dict[str, Any] | None:
    """The GPUs torch sees (null without one): names, the driver, CUDA or HIP, cuDNN."""
    import torch

    if not torch.cuda.is_available():
        return None
    names = sorted({torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())})
    driver = _run("nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader")
    return {"names": names, "count": torch.cuda.device_count(),
            "driver": driver.splitlines()[0] if driver else None, "cuda": torch.version.cuda,
            "hip": getattr(torch.version, "hip", None),
            "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None}


def cpu_name() -> str:
    """The CPU's model name (/proc/cpuinfo), else what platform says."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def provenance() -> dict[str, Any]:
    """summary.json ``provenance``: read once per process, a fresh copy per call."""
    return copy.deepcopy(_read())


@functools.cache
def _read() -> dict[str, Any]:
    return {"optbench": _version("optbench"), "git": git_state(), "python": sys.version.split()[0],
            "packages": {p: _version(p) for p in PACKAGES}, "gpu": gpu_state(), "cpu": cpu_name(),
            "platform": platform.platform()}


def format_version() -> str:
    """``optbench --version``: the version and commit, then the packages, the GPU and the CPU."""
    p = provenance()
    git = p["git"]
    commit = (f"git {git['commit'][:12]}{' (uncommitted changes)' if git['dirty'] else ''}" if git["commit"]
              else f"git: none ({git['why']})")
    lines = [f"optbench {p['optbench']} {commit}", f"python {p['python']} on {p['platform']}"]
    lines += [f"  {name} {version}" for name, version in p["packages"].items() if version is not None]
    gpu = p["gpu"]
    lines.append("gpu   none (torch sees no CUDA device)" if gpu is None else
                 f"gpu   {gpu['count']} x {', '.join(gpu['names'])}; driver {gpu['driver']}, CUDA {gpu['cuda']}"
                 f"{', HIP ' + gpu['hip'] if gpu['hip'] else ''}, cuDNN {gpu['cudnn']}")
    lines.append(f"cpu   {p['cpu']}")
    return "\n".join(lines)


def differences(records: list[dict[str, Any] | None]) -> dict[str, list[Any]]:
    """The provenance keys (dotted) whose values differ between ``records`` (None: a run without
    one, left out), each with its distinct values."""
    flat: list[dict[str, Any]] = [_flat(r) for r in records if isinstance(r, dict)]
    keys = sorted({k for f in flat for k in f} - {"git.why"})
    out = {}
    for key in keys:
        values = list(dict.fromkeys(repr(f.get(key)) for f in flat))
        if len(values) > 1:
            out[key] = values
    return out


def _flat(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out
