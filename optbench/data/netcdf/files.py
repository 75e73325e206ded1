"""Finding and opening the files of ``data.paths``: globs, format signatures, xarray's engine."""

from __future__ import annotations

import glob
import logging
import os
from pathlib import Path
from typing import Any

from optbench.errors import ConfigError

log = logging.getLogger(__name__)

HDF5_SIGNATURE = b"\x89HDF\r\n\x1a\n"
NETCDF3_SIGNATURES = (b"CDF\x01", b"CDF\x02", b"CDF\x05")


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

