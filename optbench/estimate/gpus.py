"""``estimate.fits_on``: the same step traced on other GPU counts (one GPU: ``parallel=single``;
more: FSDP2 across them), each judged against the device — "does the plan's fused model fit one
80 GB GPU, or how many does it need?" answered in one command."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from optbench.config import Config
from optbench.estimate.tracer import step_tracer


def gpu_counts(cfg: Config) -> list[int]:
    """``estimate.fits_on``, or its default: 1, 2 and 4 GPUs for a fused model, none otherwise."""
    if cfg.estimate.fits_on is not None:
        return sorted(set(cfg.estimate.fits_on))
    return [1, 2, 4] if cfg.fusion.name != "none" else []


def on_gpus(cfg: Config, gpus: int) -> Config:
    """``cfg`` on ``gpus`` GPUs: one process alone, or FSDP2 over ``gpus`` (the run's own FSDP2
    settings when it has them)."""
    if gpus == 1:
        parallel = dataclasses.replace(cfg.parallel, name="single", nproc_per_node=1, cpu_offload=False)
    else:
        parallel = dataclasses.replace(cfg.parallel, name="fsdp2", nproc_per_node=gpus)
    return dataclasses.replace(cfg, parallel=parallel)


def fits_on(cfg: Config, *, device: dict[str, Any], verdict: Callable[[int, dict[str, Any]], str], workspaces: int,
            known: dict[tuple[str, int], int]) -> list[dict[str, Any]]:
    """One row per GPU count of ``gpu_counts``: the traced peak per device and the verdict.
    ``known``: peaks already traced, by (parallel mode, world size), reused instead of traced again."""
    rows = []
    for gpus in gpu_counts(cfg):
        variant = on_gpus(cfg, gpus)
        key = (variant.parallel.name, gpus)
        if key not in known:
            with step_tracer(variant, world_size=gpus, target="cuda", stacked=cfg.estimate.stacked,
                             workspaces=workspaces) as tracer:
                known[key] = tracer(cfg.train.batch_size).steady_peak().total
        peak = known[key]
        rows.append({"gpus": gpus, "parallel": variant.parallel.name, "peak_bytes": peak,
                     "verdict": verdict(peak, device), "used_fraction": peak / device["capacity_bytes"]})
    return rows


def with_fits(cfg: Config, *, result: dict[str, Any], world_size: int, device: dict[str, Any] | None,
              workspaces: int, verdict: Callable[[int, dict[str, Any]], str]) -> dict[str, Any]:
    """``result`` (the estimate) with ``fits_on``: its rows, or None (no device to judge against,
    or no GPU count asked). The run's own trace is reused for its own GPU count."""
    counts = gpu_counts(cfg)
    result["fits_on"] = None if device is None or not counts else fits_on(
        cfg, device=device, verdict=verdict, workspaces=workspaces,
        known={(cfg.parallel.name, world_size): result["memory"]["traced"]["total"]})
    return result
