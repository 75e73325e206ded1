"""Shared helpers: compose the real conf/ with overrides, run the CLI as a user would."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import DictConfig

from optbench.config import compose

ROOT = Path(__file__).resolve().parent.parent

# small and fast: a training step of the 1m model on 4 x 32 tokens takes milliseconds. The fast
# tier runs on the CPU even where CUDA is present (its determinism and MemTracker claims are CPU
# claims); tests/run/test_train_cuda.py holds the CUDA checks.
FAST = [
    "model=1m",
    "train.device=cpu",
    "train.steps=6",
    "train.batch_size=4",
    "train.seq_len=32",
    "measure.warmup_steps=2",
    "train.eval_batches=1",
    "log.progress=log",
]


def compose_cfg(overrides: list[str] | None = None) -> DictConfig:
    return compose(overrides or [])


def run_cli(*args: str, cwd: Path | None = None, env: dict | None = None, timeout: int = 300):
    """``optbench ARGS`` in a subprocess; returns the CompletedProcess (text)."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    full_env.pop("HYDRA_FULL_ERROR", None)
    if env and "HYDRA_FULL_ERROR" in env:
        full_env["HYDRA_FULL_ERROR"] = env["HYDRA_FULL_ERROR"]
    return subprocess.run(
        [sys.executable, "-m", "optbench", *args],
        cwd=cwd or ROOT,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path_factory, monkeypatch):
    """The CPU peak cache is per machine; tests share one measured value per session."""
    cache = tmp_path_factory.getbasetemp() / "optbench-cache"
    monkeypatch.setenv("OPTBENCH_CACHE_DIR", str(cache))
