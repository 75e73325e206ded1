"""CF conventions: which dimension is time / latitude / longitude, which role a variable has, and
the physical bounds of humidity by its units. Role names themselves live in ``optbench.config.roles``."""

from __future__ import annotations

from typing import Any

import numpy as np

from optbench.config.roles import ROLE_NAMES, ROLE_STANDARD_NAMES

TIME_NAMES = ("time", "valid_time", "t", "times", "date", "Time", "forecast_time", "time_counter", "month", "months",
              "day", "days", "year", "years", "step", "init_time")
LAT_NAMES = ("lat", "latitude", "nav_lat", "lats", "y_lat", "Latitude")
LON_NAMES = ("lon", "longitude", "nav_lon", "lons", "x_lon", "Longitude")

# physical bounds of humidity by units (specific humidity in kg/kg or g/kg; relative in % or 1)
HUMIDITY_BOUNDS = {
    "kg kg-1": (0.0, 0.05), "kg/kg": (0.0, 0.05), "kg kg**-1": (0.0, 0.05), "kg.kg-1": (0.0, 0.05),
    "g kg-1": (0.0, 50.0), "g/kg": (0.0, 50.0), "%": (0.0, 100.0), "percent": (0.0, 100.0),
}



def _coord_attrs(ds: Any, dim: str) -> dict:
    return dict(ds[dim].attrs) if dim in ds.variables else {}


def find_time_dim(ds: Any, name: str | None = None) -> str | None:
    """``name`` when given (``data.time_dim``) and a dimension of ``ds``; else the dimension that CF
    marks as time (standard_name, axis T, decoded datetimes), else one named like a time axis
    (``TIME_NAMES``: time, valid_time, t, month, ...; its coordinate may be plain integers)."""
    if name is not None:
        return name if name in ds.dims else None
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

