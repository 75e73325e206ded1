"""Per-channel normalization statistics of the training steps, computed once and cached as JSON."""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from optbench.caches import note_reused
from optbench.config import NetCDFDataConfig
from optbench.data.netcdf.files import fingerprint
from optbench.data.netcdf.layout import Layout
from optbench.data.netcdf.source import ClimateSource
from optbench.errors import ConfigError

log = logging.getLogger(__name__)


@dataclass
class Stats:
    mean: np.ndarray  # (C,) float64
    std: np.ndarray
    count: np.ndarray


def cache_root(cfg: NetCDFDataConfig) -> Path:
    if cfg.stats_cache is not None:
        return Path(os.path.expanduser(cfg.stats_cache))
    from optbench.caches import cache_dir

    return cache_dir() / "netcdf-stats"


def stats_key(layout: Layout, *, train_steps: int) -> str:
    """Files (path, size, mtime), variables, levels and the train time range: a change to any of
    them means different statistics."""
    files = [fingerprint(span.path) for span in layout.files]
    blob = {
        "version": 1, "files": files, "train_steps": train_steps,
        "variables": [[v.name, v.levels] for v in layout.variables],
    }
    return hashlib.sha256(json.dumps(blob, sort_keys=True).encode()).hexdigest()[:16]


def compute_stats(source: ClimateSource, *, stop: int, block: int) -> Stats:
    """Per-channel mean and std over the valid (finite) points of steps ``[0, stop)`` of the
    native grid, accumulated in float64 one block at a time; NaN/_FillValue never enter them."""
    channels = source.layout.num_channels
    total, total_sq, count = np.zeros(channels), np.zeros(channels), np.zeros(channels)
    raw = ClimateSource(source.layout, regrid=False, reader=source.reader)
    try:
        for lo in range(0, stop, block):
            data = raw.read(lo, min(stop, lo + block)).astype(np.float64)
            valid = np.isfinite(data)
            data = np.where(valid, data, 0.0)
            total += data.sum(axis=(0, 2, 3))
            total_sq += np.square(data).sum(axis=(0, 2, 3))
            count += valid.sum(axis=(0, 2, 3))
    finally:
        raw.close()
    empty = [c.label for c, n in zip(source.layout.channels, count, strict=True) if n == 0]
    if empty:
        files = ", ".join(str(s.path) for s in source.layout.files)
        raise ConfigError(
            f"{', '.join(empty)} {'is' if len(empty) == 1 else 'are'} all NaN/_FillValue in the training steps of "
            f"{files}; drop {'it' if len(empty) == 1 else 'them'} from data.variables (or data.levels) or fix the file"
        )
    mean = total / count
    std = np.sqrt(np.maximum(total_sq / count - mean**2, 0.0))
    flat = [c.label for c, s in zip(source.layout.channels, std, strict=True) if s < 1e-12]
    if flat:
        log.warning("constant channels %s: normalized with std 1", ", ".join(flat))
        std = np.where(std < 1e-12, 1.0, std)
    return Stats(mean=mean, std=std, count=count)


def load_or_compute_stats(source: ClimateSource, *, cfg: NetCDFDataConfig, train_steps: int, block: int) -> Stats:
    """Statistics of the training steps, computed once per dataset and cached as JSON."""
    key = stats_key(source.layout, train_steps=train_steps)
    path = cache_root(cfg) / f"{key}.json"
    if path.is_file():
        cached = json.loads(path.read_text())
        note_reused("netcdf-stats", f"normalization statistics of {train_steps} training steps", path,
                    path.stat().st_mtime,
                    override="data.stats_cache=another directory")
        return Stats(np.asarray(cached["mean"]), np.asarray(cached["std"]), np.asarray(cached["count"]))
    stats = compute_stats(source, stop=train_steps, block=block)
    record = {
        "files": [str(s.path) for s in source.layout.files],
        "channels": [c.label for c in source.layout.channels],
        "train_steps": train_steps,
        "mean": stats.mean.tolist(), "std": stats.std.tolist(), "count": stats.count.tolist(),
    }
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(record, indent=1) + "\n")
        tmp.replace(path)
        log.info("normalization statistics computed over %d steps, cached in %s", train_steps, path)
    except OSError as exc:
        log.warning("could not cache normalization statistics in %s: %s", path, exc)
    return stats

