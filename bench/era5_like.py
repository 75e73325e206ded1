"""A real-like regional ERA5 file: 2 m temperature (``t2m``) over a UK box, written with xarray as
the Copernicus Climate Data Store's NetCDF download of ERA5 single levels is laid out — NetCDF3
(64-bit offset), ``t2m`` packed as int16 with ``scale_factor``/``add_offset``, ``_FillValue`` and
``missing_value`` -32767, ``units: K``, ``long_name: 2 metre temperature`` (no ``standard_name``),
dimensions ``(time, latitude, longitude)``, latitude *descending* (north first), longitude in
degrees east from -11 to 2, time as int32 ``hours since 1900-01-01 00:00:00.0`` (gregorian), a
0.25 degree grid, ``Conventions: CF-1.6``.

The values are a plausible synthetic climate, not reanalysis (nothing is downloaded): a land mask
of two ellipses (Great Britain, Ireland), a seasonal cycle (land: larger, peaking late July; sea:
smaller, a month later), a diurnal cycle in local solar time (large over land), a north-south
gradient, travelling synoptic anomalies (warm and cold blobs moving east), a persistent box-wide
anomaly (AR(1), e-folding five days), and a little noise.

    python bench/era5_like.py OUT.nc [--days 365] [--step-hours 6]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

BOX = (49.0, 61.0, -11.0, 2.0)  # south, north, west, east


def land_mask(lat: np.ndarray, lon: np.ndarray) -> np.ndarray:
    """Two rotated ellipses, roughly Great Britain and Ireland."""
    la, lo = np.meshgrid(lat, lon, indexing="ij")

    def ellipse(clat, clon, a, b, angle):
        x, y = (lo - clon) * np.cos(np.deg2rad(clat)), la - clat
        c, s = np.cos(np.deg2rad(angle)), np.sin(np.deg2rad(angle))
        return ((x * c + y * s) / a) ** 2 + ((-x * s + y * c) / b) ** 2 <= 1.0

    return ellipse(54.5, -2.5, 2.0, 5.0, -20.0) | ellipse(53.4, -8.0, 1.3, 1.9, 0.0)


def t2m_field(times: np.ndarray, lat: np.ndarray, lon: np.ndarray, *, seed: int) -> np.ndarray:
    """(time, lat, lon) 2 m temperature in K."""
    rng = np.random.default_rng(seed)
    land = land_mask(lat, lon).astype(np.float64)[None]
    day = (times - np.datetime64("2000-01-01")) / np.timedelta64(1, "D")
    doy, hour = (day % 365.25)[:, None, None], ((day % 1.0) * 24.0)[:, None, None]
    la, lo = lat[None, :, None], lon[None, None, :]
    season = land * 7.0 * -np.cos(2 * np.pi * (doy - 22) / 365.25) + (1 - land) * 4.5 * -np.cos(
        2 * np.pi * (doy - 52) / 365.25)
    diurnal = (land * 4.0 + (1 - land) * 0.6) * np.cos(2 * np.pi * (hour + lo / 15.0 - 15.0) / 24.0)
    field = 283.0 - 0.45 * (la - 55.0) + season + diurnal
    spell = np.zeros(len(times))  # a box-wide persistent anomaly
    rho = np.exp(-np.median(np.diff(day)) / 5.0)
    for k in range(1, len(times)):
        spell[k] = rho * spell[k - 1] + np.sqrt(1 - rho**2) * 2.5 * rng.standard_normal()
    field = field + spell[:, None, None] * (1.0 + 0.5 * land)
    for _ in range(int(len(times) * np.median(np.diff(day)) / 2.0)):  # a blob every ~2 days
        start, amp = rng.uniform(day[0] - 3, day[-1]), rng.normal(0.0, 3.0)
        clat, speed = rng.uniform(48.0, 62.0), rng.uniform(6.0, 12.0)  # degrees of longitude per day
        centre = -20.0 + speed * (day - start)
        alive = ((day >= start) & (centre < 10.0))[:, None, None]
        dist2 = ((lo - centre[:, None, None]) * 0.6) ** 2 + (la - clat) ** 2
        field = field + alive * amp * np.exp(-dist2 / (2 * 3.0**2))
    return field + 0.3 * rng.standard_normal(field.shape)


def era5_like_dataset(*, days: float = 365.0, step_hours: float = 6.0, seed: int = 0, box=BOX,
                      resolution: float = 0.25):
    """The dataset (xarray), with the encoding ERA5's CDS NetCDF files have."""
    import xarray as xr

    south, north, west, east = box
    lat = np.round(np.arange(north, south - 1e-9, -resolution), 4)  # descending, as ERA5
    lon = np.round(np.arange(west, east + 1e-9, resolution), 4)
    steps = int(round(days * 24 / step_hours))
    times = np.datetime64("2000-01-01T00:00") + np.arange(steps) * np.timedelta64(int(step_hours * 60), "m")
    values = t2m_field(times, lat, lon, seed=seed).astype(np.float32)
    ds = xr.Dataset(
        {"t2m": (("time", "latitude", "longitude"), values, {"units": "K", "long_name": "2 metre temperature"})},
        coords={"longitude": ("longitude", lon.astype(np.float32), {"units": "degrees_east", "long_name": "longitude"}),
                "latitude": ("latitude", lat.astype(np.float32), {"units": "degrees_north", "long_name": "latitude"}),
                "time": ("time", times, {"long_name": "time"})},
        attrs={"Conventions": "CF-1.6", "history": "optbench bench/era5_like.py: an ERA5-like synthetic t2m"},
    )
    lo, hi = float(values.min()), float(values.max())
    scale = (hi - lo) / (2**16 - 4)
    ds["t2m"].encoding = {"dtype": "int16", "scale_factor": scale, "add_offset": (hi + lo) / 2,
                          "_FillValue": np.int16(-32767), "missing_value": np.int16(-32767)}
    ds["time"].encoding = {"dtype": "int32", "units": "hours since 1900-01-01 00:00:00.0", "calendar": "gregorian"}
    return ds


def write_era5_like(path: str | Path, **kwargs) -> Path:
    """Write ``era5_like_dataset(**kwargs)`` as NetCDF3 64-bit offset (scipy), as the CDS did."""
    path = Path(path)
    era5_like_dataset(**kwargs).to_netcdf(path, format="NETCDF3_64BIT", engine="scipy")
    return path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--days", type=float, default=365.0)
    parser.add_argument("--step-hours", type=float, default=6.0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    write_era5_like(args.out, days=args.days, step_hours=args.step_hours, seed=args.seed)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
