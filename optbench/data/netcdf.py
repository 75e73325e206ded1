"""Climate fields from NetCDF4/HDF5 files, read lazily with xarray's h5netcdf engine.

``build_layout(cfg.data)`` opens every file (metadata only), finds the time, latitude, longitude
and level dimensions whatever they are called, resolves ``data.variables`` (names or roles) and
checks that the files agree; every problem is a ``ConfigError`` naming the file and the fix.
``ClimateSource`` reads a range of time steps as one float32 array ``(time, channel, lat, lon)``
— channels are (variable x level), latitude ascending, NaN where the file has ``_FillValue``/NaN,
optionally regridded — with one read per variable per block, never one per sample.

``ClimateStream`` is the training split as an endless ``IterableDataset`` of batches: each epoch
permutes blocks of ``block_size`` consecutive samples (aligned with the file's time chunks) and
shuffles samples within each block; rank ``r`` of ``w`` takes the ``r``-th contiguous share of
that order and DataLoader worker ``i`` of ``W`` the ``i``-th share of the rank's, so each block is
read by one worker and every sample is seen once per epoch (the tail that does not divide is
dropped; a different one every epoch). ``shard(rank=, world_size=, seed=, start=, batch_size=)``
sets that up; ``start`` is the number of samples this rank already consumed, so a resumed run
continues exactly where it stopped (with the same world size, num_workers and batch size).
``ClimateWindows`` is the eval split as a map-style dataset that reads a batch in one block.
"""

from __future__ import annotations

import copy
import glob
import hashlib
import json
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, IterableDataset, get_worker_info

from optbench.config import NetCDFDataConfig
from optbench.errors import ConfigError

log = logging.getLogger(__name__)

HDF5_SIGNATURE = b"\x89HDF\r\n\x1a\n"
NETCDF3_SIGNATURES = (b"CDF\x01", b"CDF\x02", b"CDF\x05")

ROLE_STANDARD_NAMES = {
    "air_temperature": "temperature",
    "surface_temperature": "temperature",
    "air_pressure": "pressure",
    "surface_air_pressure": "pressure",
    "air_pressure_at_mean_sea_level": "pressure",
    "air_pressure_at_sea_level": "pressure",
    "specific_humidity": "humidity",
    "relative_humidity": "humidity",
    "eastward_wind": "u_wind",
    "x_wind": "u_wind",
    "northward_wind": "v_wind",
    "y_wind": "v_wind",
}
ROLE_NAMES = {
    "temperature": ("temperature", "temp", "t", "ta", "tas", "t2m", "air", "air_temperature"),
    "pressure": ("pressure", "pres", "sp", "ps", "msl", "mslp", "slp", "psl", "surface_pressure"),
    "humidity": ("humidity", "q", "hus", "huss", "shum", "specific_humidity", "r", "rh", "hur", "rhum"),
    "u_wind": ("u_wind", "u", "ua", "u10", "uas", "uwnd", "eastward_wind"),
    "v_wind": ("v_wind", "v", "va", "v10", "vas", "vwnd", "northward_wind"),
}
TIME_NAMES = ("time", "valid_time", "t", "times", "date", "Time", "forecast_time")
LAT_NAMES = ("lat", "latitude", "nav_lat", "lats", "y_lat", "Latitude")
LON_NAMES = ("lon", "longitude", "nav_lon", "lons", "x_lon", "Longitude")

# physical bounds of humidity by units (specific humidity in kg/kg or g/kg; relative in % or 1)
HUMIDITY_BOUNDS = {
    "kg kg-1": (0.0, 0.05), "kg/kg": (0.0, 0.05), "kg kg**-1": (0.0, 0.05), "kg.kg-1": (0.0, 0.05),
    "g kg-1": (0.0, 50.0), "g/kg": (0.0, 50.0), "%": (0.0, 100.0), "percent": (0.0, 100.0),
}


# ----------------------------------------------------------------------------------- opening files
def resolve_paths(patterns: list[str]) -> list[Path]:
    """Files named by ``data.paths`` (files or globs), each once, in the order given."""
    paths: list[Path] = []
    for pattern in patterns:
        if glob.has_magic(pattern):
            matches = sorted(glob.glob(os.path.expanduser(pattern)))
            if not matches:
                raise ConfigError(f"data.paths: no file matches {pattern}; check the pattern")
            found = [Path(m) for m in matches]
        else:
            found = [Path(os.path.expanduser(pattern))]
        for path in found:
            if not path.is_file():
                raise ConfigError(
                    f"{path} does not exist or is not a file; give data.paths=[FILE.nc] "
                    "(`optbench data synth data.nc` writes a small one)"
                )
            if path not in paths:
                paths.append(path)
    return paths


def check_signature(path: Path) -> None:
    """Refuse what h5netcdf cannot read before it fails with an obscure HDF5 message."""
    with open(path, "rb") as f:
        head = f.read(8)
    if head[:4] in NETCDF3_SIGNATURES:
        raise ConfigError(
            f"{path} is a NetCDF3 (classic) file, which the h5netcdf engine cannot read; convert it "
            f"to NetCDF4 with `nccopy -k nc4 {path} {path.stem}.nc4` or in Python with "
            f"xarray.open_dataset('{path}', engine='scipy').to_netcdf('{path.stem}.nc4', engine='h5netcdf')"
        )
    if head != HDF5_SIGNATURE and not _has_hdf5_userblock_signature(path):
        raise ConfigError(
            f"{path} is not a NetCDF4/HDF5 file (no HDF5 signature): it is corrupt or another format; "
            "check the file (e.g. `ncdump -h`) or download it again"
        )


def _has_hdf5_userblock_signature(path: Path) -> bool:
    """HDF5 allows a user block: the signature may sit at 512, 1024, 2048, ... bytes."""
    size = path.stat().st_size
    offset = 512
    with open(path, "rb") as f:
        while offset + 8 <= size:
            f.seek(offset)
            if f.read(8) == HDF5_SIGNATURE:
                return True
            offset *= 2
    return False


def open_dataset(path: Path) -> Any:
    """``xarray.open_dataset`` with the h5netcdf engine, lazily; CF decoding (scale_factor,
    add_offset, _FillValue -> NaN, time units and calendars) is xarray's."""
    import xarray as xr

    check_signature(path)
    try:
        try:
            return xr.open_dataset(path, engine="h5netcdf", decode_timedelta=False)
        except ValueError as exc:
            if "decode time" not in str(exc):
                raise
            # e.g. 'months since' in a standard calendar: keep the time numbers (they only order
            # the files; build_layout checks that every file uses the same units)
            log.info("%s: time kept as numbers (%s)", path, str(exc).splitlines()[0])
            return xr.open_dataset(path, engine="h5netcdf", decode_times=False, decode_timedelta=False)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ConfigError(
            f"{path} could not be read as NetCDF4 ({reason}); the file is corrupt or truncated: "
            "check it with `ncdump -h` or download it again"
        ) from exc


# ------------------------------------------------------------------------------------ dimensions
def _coord_attrs(ds: Any, dim: str) -> dict:
    return dict(ds[dim].attrs) if dim in ds.variables else {}


def find_time_dim(ds: Any) -> str | None:
    for dim in ds.dims:
        attrs = _coord_attrs(ds, dim)
        if attrs.get("standard_name") == "time" or attrs.get("axis") == "T":
            return str(dim)
        if dim in ds.variables and np.issubdtype(ds[dim].dtype, np.datetime64):
            return str(dim)
        if dim in ds.variables and ds[dim].dtype == object and ds.sizes[dim] and hasattr(ds[dim].values[0], "calendar"):
            return str(dim)  # cftime dates (non-standard calendars)
    for name in TIME_NAMES:
        if name in ds.dims:
            return name
    return None


def _find_horizontal_dim(ds: Any, *, standard_name: str, units: tuple[str, ...], names: tuple[str, ...],
                         axis: str) -> str | None:
    for dim in ds.dims:
        attrs = _coord_attrs(ds, dim)
        if attrs.get("standard_name") == standard_name or attrs.get("units") in units:
            return str(dim)
    for dim in ds.dims:
        if str(dim) in names or str(dim).lower() in names:
            return str(dim)
    for dim in ds.dims:
        if _coord_attrs(ds, dim).get("axis") == axis:
            return str(dim)
    return None


def find_lat_dim(ds: Any) -> str | None:
    return _find_horizontal_dim(
        ds, standard_name="latitude", units=("degrees_north", "degree_north", "degrees_N", "degreesN"),
        names=LAT_NAMES, axis="Y",
    )


def find_lon_dim(ds: Any) -> str | None:
    return _find_horizontal_dim(
        ds, standard_name="longitude", units=("degrees_east", "degree_east", "degrees_E", "degreesE"),
        names=LON_NAMES, axis="X",
    )


def role_of(name: str, attrs: dict, roles: dict[str, str]) -> str:
    """Config mapping first, then the CF standard_name, then the variable's name."""
    if name in roles:
        return roles[name]
    standard = attrs.get("standard_name")
    if standard in ROLE_STANDARD_NAMES:
        return ROLE_STANDARD_NAMES[standard]
    for role, names in ROLE_NAMES.items():
        if name.lower() in names:
            return role
    return "other"


def humidity_bounds(units: str, standard_name: str | None) -> tuple[float, float] | None:
    units = (units or "").strip()
    if units in HUMIDITY_BOUNDS:
        return HUMIDITY_BOUNDS[units]
    if units in ("1", "", "fraction", "kg kg**-1"):
        return (0.0, 1.0) if standard_name == "relative_humidity" else (0.0, 0.05)
    return None


# ------------------------------------------------------------------------------------------ layout
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
        sizes = ds[spec.name].encoding.get("chunksizes")
        if sizes:
            chunks.append(int(sizes[spec.dims.index(time_dim)]))
    return max(chunks) if chunks else None


def _dims_of(ds: Any, path: Path) -> tuple[str, str, str]:
    time_dim, lat_dim, lon_dim = find_time_dim(ds), find_lat_dim(ds), find_lon_dim(ds)
    for label, dim in (("time", time_dim), ("latitude", lat_dim), ("longitude", lon_dim)):
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


def _layout_of(opened: list[tuple[Path, Any]], cfg: NetCDFDataConfig) -> Layout:
    first_path, first = opened[0]
    dims3 = _dims_of(first, first_path)
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

    # every file: the same variables on the same grid; times concatenate in order
    pieces = []
    units: set[str | None] = set()
    for path, ds in opened:
        if _dims_of(ds, path) != dims3:
            raise ConfigError(f"{path} names its dimensions {_dims_of(ds, path)}, {first_path} {dims3}; "
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
        raise ConfigError(
            f"time is not strictly increasing across {', '.join(str(p) for p, _ in pieces)} (step {bad + 1}: "
            f"{all_times[bad + 1]} after {all_times[bad]}); remove overlapping or duplicated files"
        )

    lat_sorted = lat[::-1] if lat_desc else lat
    global_lon = _is_global(lon)
    out_lat, out_lon = lat_sorted, lon
    if cfg.resolution is not None:
        out_lat, out_lon = regrid_axes(lat_sorted, lon, cfg.resolution, global_lon=global_lon)
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


# ------------------------------------------------------------------------------------------ reading
class ClimateSource:
    """Reads time ranges of the layout as ``(time, channel, lat, lon)`` float32 arrays.

    Files are opened lazily once per process (so the source can be sent to DataLoader workers)."""

    def __init__(self, layout: Layout, *, regrid: bool) -> None:
        self.layout = layout
        self.regrid = regrid
        self._handles: dict[Path, Any] = {}
        self._pid = os.getpid()

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_handles"] = {}
        return state

    def _dataset(self, path: Path) -> Any:
        if self._pid != os.getpid():  # a forked worker must not share HDF5 handles
            self._handles, self._pid = {}, os.getpid()
        if path not in self._handles:
            self._handles[path] = open_dataset(path)
        return self._handles[path]

    def close(self) -> None:
        for ds in self._handles.values():
            ds.close()
        self._handles = {}

    def read(self, start: int, stop: int) -> np.ndarray:
        """Steps ``[start, stop)`` as float32 ``(T, C, H, W)``: one read per variable per file."""
        layout = self.layout
        lat_count, lon_count = len(layout.lat), len(layout.lon)
        out = np.empty((stop - start, layout.num_channels, lat_count, lon_count), dtype=np.float32)
        for span in layout.files:
            lo, hi = max(start, span.start), min(stop, span.stop)
            if lo >= hi:
                continue
            ds = self._dataset(span.path)
            channel = 0
            for spec in layout.variables:
                out[lo - start : hi - start, channel : channel + spec.num_channels] = self._read_var(
                    ds, spec, slice(lo - span.start, hi - span.start)
                )
                channel += spec.num_channels
        if layout.lat_descending:
            out = out[:, :, ::-1, :]
        if self.regrid:
            out = self._regrid(out)
        return np.ascontiguousarray(out)

    def _read_var(self, ds: Any, spec: VarSpec, steps: slice) -> np.ndarray:
        layout = self.layout
        indexers: dict[str, Any] = {layout.time_dim: steps}
        if spec.level_dim is not None:
            indexers[spec.level_dim] = spec.level_index
        data = np.asarray(ds.variables[spec.name].isel(indexers).values)
        order = [spec.dims.index(layout.time_dim)]
        if spec.level_dim is not None:
            order.append(spec.dims.index(spec.level_dim))
        order += [spec.dims.index(layout.lat_dim), spec.dims.index(layout.lon_dim)]
        data = data.transpose(order)
        return data if spec.level_dim is not None else data[:, None]

    def _regrid(self, block: np.ndarray) -> np.ndarray:
        """Linear interpolation with xarray's interp; a global grid wraps around in longitude."""
        import xarray as xr

        layout = self.layout
        lon = layout.lon
        if layout.global_lon:
            step = float(np.median(np.diff(lon)))
            lon = np.concatenate([lon[-1:] - 360.0 * np.sign(step), lon, lon[:1] + 360.0 * np.sign(step)])
            block = np.concatenate([block[..., -1:], block, block[..., :1]], axis=-1)
        array = xr.DataArray(block, dims=("time", "channel", "lat", "lon"),
                             coords={"lat": layout.lat, "lon": lon})
        return array.interp(lat=layout.out_lat, lon=layout.out_lon, method="linear").values.astype(np.float32)


# ------------------------------------------------------------------------------------ normalization
@dataclass
class Stats:
    mean: np.ndarray  # (C,) float64
    std: np.ndarray
    count: np.ndarray


def _cache_root(cfg: NetCDFDataConfig) -> Path:
    if cfg.stats_cache is not None:
        return Path(os.path.expanduser(cfg.stats_cache))
    from optbench.metrics import cache_dir

    return cache_dir() / "netcdf-stats"


def stats_key(layout: Layout, *, train_steps: int) -> str:
    """Files (path, size, mtime), variables, levels and the train time range: a change to any of
    them means different statistics."""
    files = []
    for span in layout.files:
        st = span.path.stat()
        files.append([str(span.path.resolve()), st.st_size, st.st_mtime_ns])
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
    raw = ClimateSource(source.layout, regrid=False)
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
    path = _cache_root(cfg) / f"{key}.json"
    if path.is_file():
        cached = json.loads(path.read_text())
        log.info("normalization statistics from cache %s", path)
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


# ------------------------------------------------------------------------------------------ splits
@dataclass(frozen=True)
class Split:
    """Samples ``0 .. num_samples-1`` of a split: sample ``i`` is steps ``first + i .. first + i +
    history`` (``history`` inputs, then the target)."""

    first: int
    num_samples: int


def split_steps(num_steps: int, *, history: int, eval_fraction: float, paths: str) -> tuple[Split, Split]:
    window = history + 1
    if num_steps < window:
        raise ConfigError(
            f"{paths} {'has' if ', ' not in paths else 'have'} {num_steps} time steps; data.history={history} "
            f"needs at least {window} (history + the step to predict): lower data.history or add files"
        )
    eval_steps = max(window, int(round(num_steps * eval_fraction)))
    train_steps = num_steps - eval_steps
    if train_steps < window:
        raise ConfigError(
            f"{paths} has {num_steps} time steps: too few for a train and an eval split of at least "
            f"{window} steps each (data.history={history}, data.eval_fraction={eval_fraction}); "
            "lower data.history or data.eval_fraction, or add files"
        )
    return Split(0, train_steps - history), Split(train_steps, eval_steps - history)


def auto_block_size(layout: Layout, *, history: int, block_mb: int) -> int:
    """Samples per read: a whole number of the file's time chunks, at least 32 steps, at most
    ``block_mb`` MiB per block."""
    chunk = layout.time_chunk or 1
    size = chunk * -(-32 // chunk)
    cap = max(1, (block_mb << 20) // max(1, layout.step_bytes) - history)
    return max(1, min(size, cap))


# ------------------------------------------------------------------------------------------ datasets
class _Normalizer:
    def __init__(self, stats: Stats) -> None:
        self.mean = stats.mean.astype(np.float32)[:, None, None]
        self.inv_std = (1.0 / stats.std).astype(np.float32)[:, None, None]

    def __call__(self, block: np.ndarray) -> np.ndarray:
        block -= self.mean
        block *= self.inv_std
        return block


def _gather(block: np.ndarray, offsets: np.ndarray, window: int) -> np.ndarray:
    """``(len(offsets), window, C, H, W)`` windows of a block in one fancy-indexing copy."""
    return block[offsets[:, None] + np.arange(window)[None, :]]


class ClimateStream(IterableDataset):
    """The training split as an endless stream of batches (see the module docstring)."""

    def __init__(self, source: ClimateSource, *, stats: Stats, split: Split, history: int, block_size: int) -> None:
        self.source = source
        self.normalize = _Normalizer(stats)
        self.split = split
        self.history = history
        self.block_size = min(block_size, split.num_samples)
        self.num_blocks = -(-split.num_samples // self.block_size)
        self.rank = 0
        self.world_size = 1
        self.seed = 0
        self.start = 0
        self.batch_size: int | None = None

    def shard(self, *, rank: int, world_size: int, seed: int, start: int, batch_size: int) -> ClimateStream:
        """A copy that yields rank ``rank``'s batches of ``batch_size``, its data order seeded by
        ``seed``, skipping the ``start`` samples this rank already consumed (a whole number of batches)."""
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in [0, {world_size})")
        if start % batch_size:
            raise ValueError(f"start={start} is not a whole number of batches of {batch_size}")
        if self.split.num_samples < world_size:
            raise ConfigError(f"{self.split.num_samples} training samples cannot be split over {world_size} ranks; "
                              "add time steps or use fewer ranks")
        shard = copy.copy(self)
        shard.rank, shard.world_size, shard.seed, shard.start, shard.batch_size = rank, world_size, seed, start, batch_size
        return shard

    # --- the order ---------------------------------------------------------------------------
    def epoch_order(self, epoch: int) -> np.ndarray:
        """All sample indices of one epoch: blocks permuted, samples shuffled inside each block."""
        rng = np.random.default_rng([self.seed, epoch, 0xC11A7E])
        block_rank = np.empty(self.num_blocks, dtype=np.int64)
        block_rank[rng.permutation(self.num_blocks)] = np.arange(self.num_blocks)
        samples = np.arange(self.split.num_samples)
        return samples[np.lexsort((rng.random(samples.size), block_rank[samples // self.block_size]))]

    def per_worker(self, num_workers: int, *, world_size: int | None = None) -> int:
        """Samples per epoch for each of ``num_workers`` workers of a rank (of ``world_size``)."""
        world_size = world_size or self.world_size
        per_rank = self.split.num_samples // world_size
        count = per_rank // num_workers
        if count < 1:
            raise ConfigError(
                f"{self.split.num_samples} training samples cannot feed {world_size} rank(s) x {num_workers} "
                "DataLoader worker(s); lower dataloader.num_workers or add time steps"
            )
        return count

    def worker_samples(self, worker: int, num_workers: int, *, skip: int = 0) -> Iterator[np.ndarray]:
        """Worker ``worker``'s share of each epoch from stream position ``skip``, in runs of one block."""
        per_worker = self.per_worker(num_workers)
        per_rank = self.split.num_samples // self.world_size
        epoch, offset = divmod(skip, per_worker)
        while True:
            lo = self.rank * per_rank + worker * per_worker
            part = self.epoch_order(epoch)[lo + offset : lo + per_worker]
            blocks = part // self.block_size
            cuts = np.flatnonzero(np.diff(blocks)) + 1
            yield from np.split(part, cuts)
            epoch, offset = epoch + 1, 0

    def resume_position(self, worker: int, num_workers: int) -> tuple[int, int]:
        """(canonical worker, samples it already produced) for this loader's worker ``worker``:
        the DataLoader takes batches from its workers in turn starting at worker 0, so after ``n``
        batches the next one is canonical worker ``n % W``'s."""
        assert self.batch_size is not None
        batches = self.start // self.batch_size
        canonical = (batches + worker) % num_workers
        done = max(0, -(-(batches - canonical) // num_workers))
        return canonical, done * self.batch_size

    # --- reading -----------------------------------------------------------------------------
    def read_block(self, block: int) -> np.ndarray:
        first = block * self.block_size
        last = min(self.split.num_samples, first + self.block_size)
        start = self.split.first + first
        return self.normalize(self.source.read(start, start + last - first + self.history))

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        info = get_worker_info()
        worker, num_workers = (info.id, info.num_workers) if info is not None else (0, 1)
        return self.batches(worker, num_workers)

    def batches(self, worker: int, num_workers: int) -> Iterator[dict[str, torch.Tensor]]:
        """The endless batches DataLoader worker ``worker`` of ``num_workers`` yields."""
        if self.batch_size is None:
            raise RuntimeError("ClimateStream needs shard(...) before iteration")
        canonical, skip = self.resume_position(worker, num_workers)
        window = self.history + 1
        cached_id, cached = -1, np.empty(0)
        parts: list[np.ndarray] = []
        ids: list[np.ndarray] = []
        need = self.batch_size
        for run in self.worker_samples(canonical, num_workers, skip=skip):
            block = int(run[0]) // self.block_size
            if block != cached_id:
                cached_id, cached = block, self.read_block(block)
            pos = 0
            while pos < len(run):
                take = run[pos : pos + need]
                parts.append(_gather(cached, take - block * self.block_size, window))
                ids.append(take)
                need -= len(take)
                pos += len(take)
                if need == 0:
                    frames = parts[0] if len(parts) == 1 else np.concatenate(parts)
                    yield {"frames": torch.from_numpy(frames),
                           "sample": torch.from_numpy(np.concatenate(ids) + self.split.first)}
                    parts, ids, need = [], [], self.batch_size


class ClimateWindows(Dataset):
    """A split as a map-style dataset in time order (the eval split); ``__getitems__`` reads all
    the windows of a batch with one block read."""

    def __init__(self, source: ClimateSource, *, stats: Stats, split: Split, history: int) -> None:
        self.source = source
        self.normalize = _Normalizer(stats)
        self.split = split
        self.history = history

    def __len__(self) -> int:
        return self.split.num_samples

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return self.__getitems__([index])[0]

    def __getitems__(self, indices: list[int]) -> list[dict[str, torch.Tensor]]:
        for i in indices:
            if not 0 <= i < self.split.num_samples:
                raise IndexError(i)
        idx = np.asarray(indices)
        lo, hi = int(idx.min()), int(idx.max())
        start = self.split.first + lo
        block = self.normalize(self.source.read(start, start + hi - lo + self.history + 1))
        frames = _gather(block, idx - lo, self.history + 1)
        return [{"frames": torch.from_numpy(f), "sample": torch.tensor(self.split.first + i)}
                for f, i in zip(frames, indices, strict=True)]


# ------------------------------------------------------------------------------------------ building
@dataclass
class ClimateData:
    layout: Layout
    stats: Stats
    train: ClimateStream
    eval: ClimateWindows
    block_size: int


def build_climate_data(cfg: NetCDFDataConfig) -> ClimateData:
    """Layout, splits, cached statistics and the two datasets of ``data=netcdf``."""
    layout = build_layout(cfg)
    paths = ", ".join(str(s.path) for s in layout.files)
    train_split, eval_split = split_steps(layout.num_steps, history=cfg.history, eval_fraction=cfg.eval_fraction,
                                          paths=paths)
    block = cfg.block_size or auto_block_size(layout, history=cfg.history, block_mb=cfg.block_mb)
    source = ClimateSource(layout, regrid=cfg.resolution is not None)
    stats = load_or_compute_stats(source, cfg=cfg, train_steps=train_split.num_samples + cfg.history,
                                  block=block + cfg.history)
    log.info(
        "netcdf: %d file(s), %d steps, %d channels on a %dx%d grid; %d train / %d eval samples, blocks of %d",
        len(layout.files), layout.num_steps, layout.num_channels, *layout.grid, train_split.num_samples,
        eval_split.num_samples, block,
    )
    train = ClimateStream(source, stats=stats, split=train_split, history=cfg.history, block_size=block)
    evaluation = ClimateWindows(source, stats=stats, split=eval_split, history=cfg.history)
    return ClimateData(layout=layout, stats=stats, train=train, eval=evaluation, block_size=block)
