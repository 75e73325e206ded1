"""Finding and opening the files of ``data.paths``: globs, the format of each (NetCDF4/HDF5,
NetCDF3 classic, a Zarr store) told from its bytes, and the xarray engine that reads it lazily:
h5netcdf, scipy (NetCDF3, memory-mapped) or zarr."""

from __future__ import annotations

import glob
import logging
import os
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from optbench.errors import ConfigError

log = logging.getLogger(__name__)

HDF5_SIGNATURE = b"\x89HDF\r\n\x1a\n"
NETCDF3_SIGNATURES = (b"CDF\x01", b"CDF\x02", b"CDF\x05")


ZARR_MARKERS = (".zgroup", ".zarray", "zarr.json", ".zmetadata")


@dataclass(frozen=True)
class Format:
    """What a path holds and the xarray engine that reads it."""

    label: str  # "NetCDF4/HDF5", "NetCDF3 (classic)", "Zarr"
    engine: str  # "h5netcdf", "scipy", "zarr"


NETCDF4 = Format("NetCDF4/HDF5", "h5netcdf")
NETCDF3 = Format("NetCDF3 (classic)", "scipy")
ZARR = Format("Zarr", "zarr")


def is_zarr_store(path: Path) -> bool:
    return path.is_dir() and any((path / marker).is_file() for marker in ZARR_MARKERS)


def resolve_paths(patterns: list[str]) -> list[Path]:
    """Files and Zarr stores named by ``data.paths`` (paths or globs), each once, in the order given."""
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
            if path.is_dir() and not is_zarr_store(path):
                raise ConfigError(
                    f"{path} is a directory but not a Zarr store (none of {', '.join(ZARR_MARKERS)} in it); "
                    "give the store's root directory (the one holding .zgroup or zarr.json) or NetCDF files"
                )
            if not path.is_file() and not path.is_dir():
                raise ConfigError(
                    f"{path} does not exist or is not a file; give data.paths=[FILE.nc] "
                    "(`optbench data synth data.nc` writes a small one)"
                )
            if path not in paths:
                paths.append(path)
    return paths


def detect_format(path: Path) -> Format:
    """The format from the bytes (never the name): the HDF5 or NetCDF3 signature, or a Zarr store."""
    if path.is_dir():
        if is_zarr_store(path):
            return ZARR
        raise ConfigError(f"{path} is a directory but not a Zarr store; give the store's root directory")
    with open(path, "rb") as f:
        head = f.read(8)
    if head[:4] in NETCDF3_SIGNATURES:
        return NETCDF3
    if head == HDF5_SIGNATURE or _has_hdf5_userblock_signature(path):
        return NETCDF4
    raise ConfigError(
        f"{path} is not a NetCDF4/HDF5, NetCDF3 or Zarr dataset (no HDF5 or CDF signature): it is corrupt or "
        "another format; check the file (e.g. `ncdump -h`) or download it again"
    )


def check_signature(path: Path) -> None:
    """Refuse what no engine can read before xarray fails with an obscure message."""
    detect_format(path)


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


def _open(path: Path, fmt: Format, **kwargs: Any) -> Any:
    import xarray as xr

    if fmt is ZARR:
        # consolidated metadata when the store has it, chunks=None: lazy arrays without dask
        return xr.open_dataset(path, engine="zarr", chunks=None, consolidated=None, **kwargs)
    return xr.open_dataset(path, engine=fmt.engine, **kwargs)


def open_dataset(path: Path) -> Any:
    """``xarray.open_dataset`` with the engine of the path's format, lazily (h5netcdf and zarr read
    on indexing, scipy memory-maps a NetCDF3 file); CF decoding (scale_factor, add_offset,
    _FillValue -> NaN, time units and calendars) is xarray's. ``ds.encoding["optbench_format"]``
    and ``["optbench_engine"]`` name the format and the engine that read it."""
    fmt = detect_format(path)
    try:
        try:
            ds = _open(path, fmt, decode_timedelta=False)
        except ValueError as exc:
            if "decode time" not in str(exc):
                raise
            # e.g. 'months since' in a standard calendar: keep the time numbers (they only order
            # the files; build_layout checks that every file uses the same units)
            log.info("%s: time kept as numbers (%s)", path, str(exc).splitlines()[0])
            ds = _open(path, fmt, decode_times=False, decode_timedelta=False)
    except ImportError as exc:
        raise ConfigError(f"{path} is a {fmt.label} store and reading it needs {exc.name or 'zarr'}: "
                          "pip install zarr (optbench's dependencies include it)") from exc
    except (OSError, ValueError, KeyError, TypeError, RuntimeError, zlib.error) as exc:  # RuntimeError: Blosc
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ConfigError(
            f"{path} could not be read as {fmt.label} ({reason}); the file is corrupt or truncated: "
            "check it with `ncdump -h` (or zarr's metadata) or download it again"
        ) from exc
    ds.encoding["optbench_format"] = fmt.label
    ds.encoding["optbench_engine"] = fmt.engine
    return ds


def fingerprint(path: Path) -> list:
    """What identifies a version of a file or store for caches: (path, size, mtime) of the file, or
    of a Zarr store's metadata files (rewritten whenever its arrays change shape or attributes; the
    chunks of a store of ERA5 are too many to stat)."""
    if not path.is_dir():
        st = path.stat()
        return [str(path.resolve()), st.st_size, st.st_mtime_ns]
    parts: list = [str(path.resolve())]
    dirs = [path] + sorted(d for d in path.iterdir() if d.is_dir())  # the group and its arrays
    for meta in (d / marker for d in dirs for marker in (*ZARR_MARKERS, ".zattrs")):
        if not meta.is_file():
            continue
        st = meta.stat()
        parts.append([str(meta.relative_to(path)), st.st_size, st.st_mtime_ns])
    return parts
