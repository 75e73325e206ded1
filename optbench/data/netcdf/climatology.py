"""The climatology the forecast scores are measured against: per channel and grid point (on the
grid samples are on), the mean of the **training steps only**, by hour of day where the time axis
has datetimes with several hours of day (the diurnal cycle), else one mean. Cached beside the
normalization statistics (``.npz``), keyed on the files, the training steps, the grid and the
grouping, so it is computed once per dataset.

WeatherBench2 uses a day-of-year x hour-of-day climatology from 30 years; a training split of
optbench is usually far shorter, so day-of-year is not attempted: with hours of day the
climatology forecast keeps the diurnal cycle, and the ACC measures anomalies from it."""

from __future__ import annotations

import hashlib
import logging
import os
from dataclasses import dataclass

import numpy as np

from optbench.caches import note_reused
from optbench.config import NetCDFDataConfig
from optbench.data.netcdf.layout import Layout
from optbench.data.netcdf.source import ClimateSource
from optbench.data.netcdf.stats import cache_root, stats_key

log = logging.getLogger(__name__)


@dataclass
class Climatology:
    mean: np.ndarray  # (groups, C, H, W) float32, physical units; NaN where training never had a value
    group_of_step: np.ndarray  # (num_steps,) int64: the group of every time step
    grouping: str  # "hour of day" or "all training steps"


def _hours(times: np.ndarray) -> np.ndarray | None:
    if np.issubdtype(times.dtype, np.datetime64):
        return ((times - times.astype("datetime64[D]")) // np.timedelta64(1, "h")).astype(np.int64)
    if times.dtype == object and len(times) and hasattr(times[0], "hour"):  # cftime dates
        return np.asarray([t.hour for t in times], dtype=np.int64)
    return None


def climatology_groups(times: np.ndarray, *, train_steps: int) -> tuple[np.ndarray, str]:
    """(group of each step, what the groups are): hours of day when the steps have several and
    every hour of the eval steps occurs in the training steps; else one group."""
    hours = _hours(times)
    if hours is not None and len(np.unique(hours)) > 1 and set(hours[train_steps:]) <= set(hours[:train_steps]):
        values, groups = np.unique(hours, return_inverse=True)
        return groups.astype(np.int64), "hour of day"
    return np.zeros(len(times), dtype=np.int64), "all training steps"


def compute_climatology(source: ClimateSource, *, train_steps: int, block: int) -> Climatology:
    """The mean of the finite values per group, channel and grid point over steps ``[0, train_steps)``,
    accumulated in float64 one block at a time."""
    layout = source.layout
    groups, grouping = climatology_groups(layout.times, train_steps=train_steps)
    count = int(groups.max()) + 1
    shape = (count, layout.num_channels, *layout.grid)
    total, valid = np.zeros(shape), np.zeros(shape)
    for lo in range(0, train_steps, block):
        hi = min(train_steps, lo + block)
        data = source.read(lo, hi).astype(np.float64)
        finite = np.isfinite(data)
        data = np.where(finite, data, 0.0)
        for group in np.unique(groups[lo:hi]):
            pick = groups[lo:hi] == group
            total[group] += data[pick].sum(axis=0)
            valid[group] += finite[pick].sum(axis=0)
    with np.errstate(invalid="ignore", divide="ignore"):
        mean = np.where(valid > 0, total / valid, np.nan).astype(np.float32)
    return Climatology(mean=mean, group_of_step=groups, grouping=grouping)


def _key(layout: Layout, *, train_steps: int) -> str:
    grid = np.concatenate([layout.out_lat, layout.out_lon]).astype(np.float64).tobytes()
    return stats_key(layout, train_steps=train_steps) + "-clim-" + hashlib.sha256(grid).hexdigest()[:8]


def load_or_compute_climatology(source: ClimateSource, *, cfg: NetCDFDataConfig, train_steps: int,
                                block: int) -> Climatology:
    """The training steps' climatology, computed once per dataset and grid and cached as .npz."""
    layout = source.layout
    path = cache_root(cfg) / f"{_key(layout, train_steps=train_steps)}.npz"
    groups, grouping = climatology_groups(layout.times, train_steps=train_steps)
    if path.is_file():
        with np.load(path) as cached:
            if cached["mean"].shape[0] == int(groups.max()) + 1:
                note_reused("netcdf-stats", f"climatology ({grouping}) of {train_steps} training steps", path,
                            path.stat().st_mtime, override="data.stats_cache=another directory")
                return Climatology(mean=cached["mean"], group_of_step=groups, grouping=grouping)
    clim = compute_climatology(source, train_steps=train_steps, block=block)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.stem}.{os.getpid()}.tmp.npz")
        np.savez(tmp, mean=clim.mean)
        tmp.replace(path)
        log.info("climatology (%s) of %d training steps cached in %s", grouping, train_steps, path)
    except OSError as exc:
        log.warning("could not cache the climatology in %s: %s", path, exc)
    return clim
