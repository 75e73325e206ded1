"""``optbench data inspect FILE...``: what a NetCDF file or Zarr store holds and whether optbench
can train on it.

Per file: format, the xarray engine that reads it (h5netcdf, scipy or zarr) and size, dimensions, the time / latitude / longitude / level coordinates it
found, and per variable its dims, dtype (packed or not, fill value), units, CF standard_name, the
role optbench gives it and its chunking. Then, for all files together, the verdict of the same
checks training runs — the climate task is built from the very overrides suggested (layout, split,
normalization statistics, which refuse an all-NaN variable, and the augmentation's grid checks) — and
the command to train, quoted for the shell and for Hydra so that it runs as printed; or the reason
it cannot be used.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from optbench.config import NetCDFDataConfig
from optbench.data.netcdf import (
    find_lat_dim,
    find_lon_dim,
    find_time_dim,
    open_dataset,
    resolve_paths,
    role_of,
)
from optbench.errors import ConfigError


def _size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:,.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1000
    return f"{n:.1f} GB"


def _bytes_of(path: Path) -> int:
    if path.is_dir():  # a Zarr store
        return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
    return path.stat().st_size


def _fmt(value: Any) -> str:
    text = str(value)
    return text[:19].replace("T", " ") if len(text) >= 19 and text[4] == "-" else text


def _duration(delta: Any) -> str:
    if isinstance(delta, np.timedelta64):
        hours = delta / np.timedelta64(1, "h")
    elif hasattr(delta, "total_seconds"):
        hours = delta.total_seconds() / 3600
    else:
        return str(delta)
    return f"{hours / 24:g} days" if hours >= 24 and hours % 24 == 0 else f"{hours:g} h"


def _axis_line(ds: Any, dim: str | None, label: str) -> str:
    if dim is None:
        return f"  {label:<11} not found"
    if dim not in ds.variables:
        return f"  {label:<11} '{dim}': {ds.sizes[dim]} points, no coordinate values"
    values = np.asarray(ds[dim].values)
    if not len(values):
        return f"  {label:<11} '{dim}': 0 {'steps' if label == 'time' else 'points'} (empty)"
    if label == "time":
        step = f", every {_duration(values[1] - values[0])}" if len(values) > 1 else ""
        calendar = ds[dim].encoding.get("calendar", "")
        return (f"  {label:<11} '{dim}': {len(values)} steps, {_fmt(values[0])} .. {_fmt(values[-1])}{step}"
                + (f" (calendar {calendar})" if calendar else ""))
    order = "descending" if len(values) > 1 and values[1] < values[0] else "ascending"
    extra = ""
    if label == "longitude" and len(values) > 1:
        step = abs(float(np.median(np.diff(values))))
        extra = ", global" if abs(step * len(values) - 360) < 0.5 * step else ", regional"
    return f"  {label:<11} '{dim}': {len(values)} points, {values[0]:g} .. {values[-1]:g} ({order}{extra})"


def _dtype(var: Any) -> str:
    enc = var.encoding
    stored = enc.get("dtype", var.dtype)
    text = str(stored)
    if "scale_factor" in enc or "add_offset" in enc:
        text += f" packed (scale {enc.get('scale_factor', 1):g}, offset {enc.get('add_offset', 0):g})"
    if "_FillValue" in enc:
        text += f" fill {enc['_FillValue']}"
    return text


def _chunks(var: Any) -> str:
    enc = var.encoding
    sizes = enc.get("chunksizes") or enc.get("chunks")
    if not sizes:
        return "contiguous"
    text = "x".join(str(s) for s in sizes)
    for codec in ("zlib", "szip", "zstd", "blosc", "bzip2"):
        if enc.get(codec):
            text += f" {codec}"
    return text


def describe_file(path: Path, *, roles: dict[str, str]) -> str:
    ds = open_dataset(path)
    try:
        time_dim, lat_dim, lon_dim = find_time_dim(ds), find_lat_dim(ds), find_lon_dim(ds)
        lines = [f"{path}  ({ds.encoding['optbench_format']}, read with xarray engine "
                 f"'{ds.encoding['optbench_engine']}', {_size(_bytes_of(path))})",
                 "  dims        " + (", ".join(f"{d} {n}" for d, n in ds.sizes.items()) or "none"),
                 _axis_line(ds, time_dim, "time"), _axis_line(ds, lat_dim, "latitude"),
                 _axis_line(ds, lon_dim, "longitude")]
        rows = [("variable", "role", "units", "standard_name", "dims", "dtype", "chunks")]
        for name in ds.data_vars:
            var = ds[name]
            rows.append((str(name), role_of(str(name), var.attrs, roles), str(var.attrs.get("units", "-")),
                         str(var.attrs.get("standard_name", "-")),
                         "(" + ", ".join(f"{d}={ds.sizes[d]}" for d in var.dims) + ")", _dtype(var), _chunks(var)))
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines.append("  variables")
        lines += ["    " + "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows]
        return "\n".join(lines)
    finally:
        ds.close()


def _gridded_variables(paths: list[Path]) -> list[str]:
    ds = open_dataset(paths[0])
    try:
        dims = {find_time_dim(ds), find_lat_dim(ds), find_lon_dim(ds)}
        return [str(v) for v in ds.data_vars if dims <= set(map(str, ds[v].dims)) and len(ds[v].dims) <= 4]
    finally:
        ds.close()


_HYDRA_PLAIN = re.compile(r"[A-Za-z0-9_/.+\-@]+")


def hydra_value(text: str) -> str:
    """``text`` as a Hydra override value: as it is when Hydra's grammar reads it unquoted, else
    double-quoted with backslashes and quotes escaped (spaces, commas, brackets, non-ASCII)."""
    if _HYDRA_PLAIN.fullmatch(text) and not text[0].isdigit():
        return text
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def suggested_overrides(files: list[str], *, variables: list[str] | None, history: int,
                        roles: dict[str, str]) -> list[str]:
    """The overrides of the training command for ``files`` (each a Hydra override, unquoted for the shell)."""
    overrides = ["task=climate", "data=netcdf", "data.paths=[" + ",".join(hydra_value(f) for f in files) + "]"]
    if variables is not None:
        overrides.append("data.variables=[" + ",".join(hydra_value(v) for v in variables) + "]")
    overrides += [f"data.roles.{hydra_value(k)}={v}" for k, v in roles.items()]
    if history != NetCDFDataConfig.history:
        overrides.append(f"data.history={history}")
    return overrides


def command_line(overrides: list[str]) -> str:
    return "optbench train " + " ".join(shlex.quote(o) for o in overrides)


# builds the climate task from these overrides as ``optbench train`` does: a short description of
# what it found and how each variable is read with what its chunking costs, raising ConfigError where
# training would (``optbench.tasks.climate.describe_training_data``, handed in by the caller: the
# task is a layer above the data)
TrainingCheck = Callable[[list[str]], tuple[str, list[str]]]


def usability(files: list[str], *, check: TrainingCheck, variables: list[str] | None, history: int,
              roles: dict[str, str]) -> tuple[bool, str, list[str]]:
    """(usable, one line, how the variables are read): the checks training runs (``check``), on all
    ``files`` together, and the command."""
    def attempt(names: list[str] | None) -> tuple[str, list[str]]:
        overrides = suggested_overrides(files, variables=names, history=history, roles=roles)
        description, reading = check(overrides)
        return f"yes: {description}; train with:\n  {command_line(overrides)}", reading

    try:
        return True, *attempt(variables)
    except ConfigError as first_error:
        if variables:
            return False, f"no: {first_error}", []
        candidates = _gridded_variables([Path(f) for f in files])
        if not candidates:
            return False, f"no: {first_error}", []
        try:
            return True, *attempt(candidates)
        except ConfigError as error:
            return False, f"no: with data.variables=[{','.join(candidates)}]: {error}", []


def inspect_files(paths: list[str], *, check: TrainingCheck, variables: list[str] | None = None, history: int = 2,
                  roles: dict[str, str] | None = None) -> tuple[bool, str]:
    """The report for ``paths`` and whether optbench can use them (``check``: the checks training
    runs); a file that cannot be read at all (missing, corrupt, a directory that is not a Zarr
    store) raises ConfigError."""
    roles = roles or {}
    files = resolve_paths(paths)
    blocks = [describe_file(path, roles=roles) for path in files]
    usable, line, reading = usability([str(f) for f in files], check=check, variables=variables, history=history,
                                      roles=roles)
    if reading:
        blocks.append("\n".join(reading))
    blocks.append(f"usable by optbench: {line}")
    return usable, "\n\n".join(blocks)
