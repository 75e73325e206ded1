"""The layout of ``data.paths``: the files in time order, the variables and levels asked for (as
channels), the grid and the output grid; ``build_layout`` checks that the files agree."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from optbench.config import NetCDFDataConfig
from optbench.config.roles import ROLE_NAMES
from optbench.data.netcdf.cf import find_lat_dim, find_lon_dim, find_time_dim, humidity_bounds, role_of
from optbench.data.netcdf.files import open_dataset, resolve_paths
from optbench.errors import ConfigError


@dataclass
class VarSpec:
    name: str
    role: str
    units: str
    standard_name: str | None
    dims: tuple[str, ...]
    level_dim: str | None
    level_index: list[int] | None  # indices into the level dimension (sorted), None = no level dim
    levels: list[float] | None

    @property
    def num_channels(self) -> int:
        return 1 if self.level_index is None else len(self.level_index)


@dataclass
class FileSpan:
    path: Path
    start: int  # global time index of the file's first step
    stop: int


@dataclass(frozen=True)
class Channel:
    variable: str
    role: str
    level: float | None
    units: str

    @property
    def label(self) -> str:
        return self.variable if self.level is None else f"{self.variable}@{self.level:g}"


@dataclass
class Layout:
    files: list[FileSpan]
    variables: list[VarSpec]
    time_dim: str
    lat_dim: str
    lon_dim: str
    times: np.ndarray
    lat: np.ndarray  # ascending (the source grid)
    lon: np.ndarray
    lat_descending: bool
    out_lat: np.ndarray  # the grid samples are on (regridded or the source)
    out_lon: np.ndarray
    global_lon: bool
    humidity_bounds: dict[str, tuple[float, float]] = field(default_factory=dict)
    time_chunk: int | None = None

    @property
    def channels(self) -> list[Channel]:
        out = []
        for var in self.variables:
            for level in var.levels if var.levels is not None else [None]:
                out.append(Channel(var.name, var.role, level, var.units))
        return out

    @property
    def num_channels(self) -> int:
        return sum(v.num_channels for v in self.variables)

    @property
    def num_steps(self) -> int:
        return len(self.times)

    @property
    def grid(self) -> tuple[int, int]:
        return len(self.out_lat), len(self.out_lon)

    @property
    def step_bytes(self) -> int:
        return 4 * self.num_channels * len(self.out_lat) * len(self.out_lon)


def _resolve_variable(ds: Any, path: Path, wanted: str, roles: dict[str, str]) -> str:
    if wanted in ds.data_vars:
        return wanted
    candidates = [str(v) for v in ds.data_vars if role_of(str(v), ds[v].attrs, roles) == wanted]
    if len(candidates) == 1:
        return candidates[0]
    if len(candidates) > 1:
        raise ConfigError(
            f"data.variables: role '{wanted}' matches several variables in {path} ({', '.join(candidates)}); "
            f"name the one you want, e.g. data.variables=[{candidates[0]}, ...]"
        )
    have = ", ".join(f"{v} ({role_of(str(v), ds[v].attrs, roles)})" for v in ds.data_vars) or "none"
    raise ConfigError(
        f"data.variables: '{wanted}' is not in {path}; its variables (role) are: {have}; "
        f"set data.variables=[...] to names it has, or give a role with data.roles.NAME={wanted}"
    )


def _variable_spec(ds: Any, path: Path, name: str, *, cfg: NetCDFDataConfig, dims3: tuple[str, str, str],
                   requested_role: str | None) -> VarSpec:
    time_dim, lat_dim, lon_dim = dims3
    var = ds[name]
    dims = tuple(str(d) for d in var.dims)
    missing = [label for label, dim in (("time", time_dim), ("latitude", lat_dim), ("longitude", lon_dim))
               if dim not in dims]
    extra = [d for d in dims if d not in dims3]
    if missing or len(extra) > 1:
        problem = f"it has no {' or '.join(missing)} dimension" if missing else (
            f"it has {len(extra)} dimensions besides time/lat/lon ({', '.join(extra)})")
        raise ConfigError(
            f"variable '{name}' in {path} has dims ({', '.join(dims)}): {problem}; optbench needs "
            "(time, [level,] lat, lon): select or reduce the other dimensions first (e.g. xarray .isel/.mean)"
        )
    attrs = var.attrs
    role = requested_role or role_of(name, attrs, cfg.roles)
    level_dim = extra[0] if extra else None
    level_index = levels = None
    if level_dim is not None:
        values = np.asarray(ds[level_dim].values if level_dim in ds.variables else np.arange(ds.sizes[level_dim]),
                            dtype=np.float64)
        if cfg.levels is None:
            level_index = list(range(len(values)))
        else:
            level_index = []
            for wanted in cfg.levels:
                hits = np.flatnonzero(np.isclose(values, wanted))
                if not hits.size:
                    raise ConfigError(
                        f"data.levels: {wanted:g} is not a level of '{name}' in {path}; its {level_dim} "
                        f"values are {', '.join(f'{v:g}' for v in values)}"
                    )
                level_index.append(int(hits[0]))
            level_index = sorted(set(level_index))
        levels = [float(values[i]) for i in level_index]
    return VarSpec(name=name, role=role, units=str(attrs.get("units", "")), standard_name=attrs.get("standard_name"),
                   dims=dims, level_dim=level_dim, level_index=level_index, levels=levels)


def _time_chunk(ds: Any, specs: list[VarSpec], time_dim: str) -> int | None:
    chunks = []
    for spec in specs:
        enc = ds[spec.name].encoding
        sizes = enc.get("chunksizes") or enc.get("chunks")  # NetCDF4 / Zarr
        if sizes:
            chunks.append(int(sizes[spec.dims.index(time_dim)]))
    return max(chunks) if chunks else None


def _dims_of(ds: Any, path: Path, time_name: str | None = None) -> tuple[str, str, str]:
    time_dim, lat_dim, lon_dim = find_time_dim(ds, time_name), find_lat_dim(ds), find_lon_dim(ds)
    if time_dim is None:
        others = [f"{d} ({n})" for d, n in ds.sizes.items() if d not in (lat_dim, lon_dim)]
        asked = f"data.time_dim={time_name} is not a dimension of {path}" if time_name else (
            f"{path} has no dimension optbench recognizes as time")
        raise ConfigError(
            f"{asked}; its candidates (dimensions besides latitude/longitude) are: {', '.join(others) or 'none'}; "
            "set data.time_dim=NAME to the one that is time"
        )
    for label, dim in (("latitude", lat_dim), ("longitude", lon_dim)):
        if dim is None:
            raise ConfigError(
                f"{path} has no {label} dimension (dims: {', '.join(map(str, ds.dims)) or 'none'}); optbench "
                f"needs variables on (time, [level,] lat, lon)"
            )
    for label, dim in (("latitude", lat_dim), ("longitude", lon_dim)):
        if dim not in ds.variables:
            raise ConfigError(f"{path}: the {label} dimension '{dim}' has no coordinate values; add them")
    assert time_dim and lat_dim and lon_dim
    return time_dim, lat_dim, lon_dim


def _monotonic_axis(values: np.ndarray, *, label: str, path: Path) -> bool:
    """True when descending; refuse an axis that is neither increasing nor decreasing."""
    diffs = np.diff(values)
    if np.all(diffs > 0):
        return False
    if np.all(diffs < 0):
        return True
    raise ConfigError(f"{path}: {label} is not monotonic; sort the file by {label} first")


def _file_times(ds: Any, time_dim: str, path: Path) -> np.ndarray:
    if time_dim not in ds.variables:
        return np.arange(ds.sizes[time_dim])
    return np.asarray(ds[time_dim].values)


def build_layout(cfg: NetCDFDataConfig) -> Layout:
    """Open every file (metadata only) and check that together they hold what ``cfg`` asks."""
    paths = resolve_paths(cfg.paths)
    opened = [(path, open_dataset(path)) for path in paths]
    try:
        return _layout_of(opened, cfg)
    finally:
        for _, ds in opened:
            ds.close()


def _file_spans(opened: list[tuple[Path, Any]], specs: list, *, cfg: NetCDFDataConfig, dims3: tuple,
                lat: np.ndarray, lon: np.ndarray) -> tuple[list[FileSpan], np.ndarray]:
    """Every file holds the same variables on the same grid; their times concatenate in order."""
    first_path = opened[0][0]
    pieces = []
    units: set[str | None] = set()
    for path, ds in opened:
        if _dims_of(ds, path, cfg.time_dim) != dims3:
            raise ConfigError(f"{path} names its dimensions {_dims_of(ds, path, cfg.time_dim)}, {first_path} {dims3}; "
                              "give files of one dataset")
        for spec in specs:
            if spec.name not in ds.data_vars:
                raise ConfigError(f"data.variables: '{spec.name}' is in {first_path} but not in {path}; "
                                  f"its variables are: {', '.join(map(str, ds.data_vars))}")
            other = _variable_spec(ds, path, spec.name, cfg=cfg, dims3=dims3, requested_role=spec.role)
            if other.dims != spec.dims or other.levels != spec.levels:
                raise ConfigError(f"'{spec.name}' has dims {other.dims} / levels {other.levels} in {path} but "
                                  f"{spec.dims} / {spec.levels} in {first_path}; give files of one dataset")
        for dim, ref in ((dims3[1], lat), (dims3[2], lon)):
            values = np.asarray(ds[dim].values, dtype=np.float64)
            if values.shape != ref.shape or not np.allclose(values, ref):
                raise ConfigError(f"{path} is on another {dim} grid than {first_path}; regrid the files to one grid")
        pieces.append((path, _file_times(ds, dims3[0], path)))
        units.add(str(ds[dims3[0]].attrs.get("units")) if dims3[0] in ds.variables else None)
    if len(units) > 1 and not any(np.issubdtype(t.dtype, np.datetime64) or t.dtype == object for _, t in pieces):
        raise ConfigError(
            f"the files' times are numbers in different units ({', '.join(sorted(map(str, units)))}) that "
            "xarray cannot decode, so they cannot be put in order; give them one time unit"
        )
    pieces.sort(key=lambda item: item[1][0] if len(item[1]) else 0)
    spans, times = [], []
    offset = 0
    for path, file_times in pieces:
        spans.append(FileSpan(path=path, start=offset, stop=offset + len(file_times)))
        offset += len(file_times)
        times.append(file_times)
    all_times = np.concatenate(times)
    if len(all_times) > 1 and not np.all(all_times[1:] > all_times[:-1]):
        bad = int(np.flatnonzero(~(all_times[1:] > all_times[:-1]))[0])
        span = next(s for s in spans if s.start <= bad + 1 < s.stop)
        within = span.start <= bad  # both steps in one file: its own order, not the files'
        fix = (f"{span.path} itself is not in time order (or repeats a time, or has a missing one): sort it by time "
               "and drop repeated steps (xarray: ds.sortby('time').drop_duplicates('time'))" if within else
               "remove overlapping or duplicated files")
        raise ConfigError(
            f"time is not strictly increasing across {', '.join(str(p) for p, _ in pieces)} (step {bad + 1}: "
            f"{all_times[bad + 1]} after {all_times[bad]}); {fix}"
        )

    return spans, all_times


def _humidity_bounds(specs: list, cfg: NetCDFDataConfig) -> dict[str, tuple[float, float]]:
    """The physical bounds of each humidity variable, from data.humidity_bounds or its units."""
    bounds = {}
    for spec in specs:
        if spec.role == "humidity":
            found = tuple(cfg.humidity_bounds) if cfg.humidity_bounds else humidity_bounds(spec.units, spec.standard_name)
            if found is None:
                raise ConfigError(
                    f"cannot tell the physical bounds of humidity '{spec.name}' from its units '{spec.units}'; "
                    "set data.humidity_bounds=[low,high] (e.g. [0,0.05] for kg/kg, [0,100] for %)"
                )
            bounds[spec.name] = (float(found[0]), float(found[1]))
    return bounds


def _layout_of(opened: list[tuple[Path, Any]], cfg: NetCDFDataConfig) -> Layout:
    first_path, first = opened[0]
    dims3 = _dims_of(first, first_path, cfg.time_dim)
    names = []
    requested_roles: dict[str, str | None] = {}
    for wanted in cfg.variables:
        name = _resolve_variable(first, first_path, wanted, cfg.roles)
        if name in names:
            raise ConfigError(f"data.variables names '{name}' twice (as '{wanted}'); list each variable once")
        names.append(name)
        requested_roles[name] = wanted if wanted != name and wanted in ROLE_NAMES else None
    specs = [_variable_spec(first, first_path, n, cfg=cfg, dims3=dims3, requested_role=requested_roles[n])
             for n in names]
    lat = np.asarray(first[dims3[1]].values, dtype=np.float64)
    lon = np.asarray(first[dims3[2]].values, dtype=np.float64)
    lat_desc = _monotonic_axis(lat, label="latitude", path=first_path)
    _monotonic_axis(lon, label="longitude", path=first_path)

    spans, all_times = _file_spans(opened, specs, cfg=cfg, dims3=dims3, lat=lat, lon=lon)

    lat_sorted = lat[::-1] if lat_desc else lat
    global_lon = _is_global(lon)
    out_lat, out_lon = lat_sorted, lon
    if cfg.resolution is not None:
        out_lat, out_lon = regrid_axes(lat_sorted, lon, cfg.resolution, global_lon=global_lon)
    bounds = _humidity_bounds(specs, cfg)
    return Layout(
        files=spans, variables=specs, time_dim=dims3[0], lat_dim=dims3[1], lon_dim=dims3[2], times=all_times,
        lat=lat_sorted, lon=lon, lat_descending=lat_desc, out_lat=out_lat, out_lon=out_lon,
        global_lon=global_lon, humidity_bounds=bounds, time_chunk=_time_chunk(first, specs, dims3[0]),
    )


def _is_global(lon: np.ndarray) -> bool:
    if len(lon) < 2:
        return False
    step = abs(float(np.median(np.diff(lon))))
    return abs(step * len(lon) - 360.0) < 0.5 * step


def regrid_axes(lat: np.ndarray, lon: np.ndarray, resolution: float, *, global_lon: bool) -> tuple[np.ndarray, np.ndarray]:
    """A regular grid of ``resolution`` degrees inside the source's latitude range and over its
    longitudes (all 360 degrees for a global grid)."""
    new_lat = np.arange(lat[0], lat[-1] + 1e-9, resolution)
    lon_lo = float(np.min(lon))
    if global_lon:
        count = int(np.ceil(360.0 / resolution - 1e-9))
    else:
        count = int(np.floor((float(np.max(lon)) - lon_lo) / resolution + 1e-9)) + 1
    new_lon = lon_lo + resolution * np.arange(max(count, 1))
    if lon[0] > lon[-1]:
        new_lon = new_lon[::-1]
    if len(new_lat) < 2 or len(new_lon) < 2:
        raise ConfigError(f"data.resolution={resolution} leaves fewer than 2 points in latitude or longitude; lower it")
    return new_lat, new_lon

