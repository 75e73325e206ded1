"""``optbench data synth OUT.nc``: a small, physically plausible climate dataset in CF conventions.

Fields on pressure levels (temperature, specific humidity, eastward and northward wind) and at the
surface (surface air pressure), on a regular global grid, every ``step_hours`` hours:

- temperature falls from ~300 K at the equator to ~255 K at the poles and with height (a dry
  lapse of T ~ p^0.19, ~230 K at 250 hPa); a seasonal cycle (warm NH in July) grows with latitude,
  a diurnal cycle follows local solar time and fades with height;
- travelling mid-latitude waves (zonal wavenumbers 3, 5, 7 moving east) perturb temperature,
  pressure and, through a stream function, the winds, on top of westerly jets (~30 m/s at 250 hPa
  near 40 degrees) and surface trade easterlies;
- specific humidity is a relative humidity in [0.05, 0.98] times saturation (Tetens' formula), so
  it stays in 0 .. ~0.025 kg/kg; surface pressure carries the waves and a semidiurnal tide;
- a little seeded noise on every field.

It is written with h5netcdf (NetCDF4/HDF5), chunked along time, one chunk at a time, so a large
file never needs to fit in memory. ``synthetic_dataset`` builds the same fields as an in-memory
xarray Dataset (tests turn it into real-world variants: packed, renamed, flipped, split).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from optbench.errors import ConfigError
from optbench.files import atomic_path, free_bytes, os_error_message

TIME_UNITS = "hours since 2000-01-01 00:00:00"
DEFAULT_LEVELS = (1000.0, 850.0, 500.0, 250.0)

ATTRS = {
    "temperature": {"standard_name": "air_temperature", "long_name": "air temperature", "units": "K"},
    "humidity": {"standard_name": "specific_humidity", "long_name": "specific humidity", "units": "kg kg-1"},
    "u_wind": {"standard_name": "eastward_wind", "long_name": "eastward wind", "units": "m s-1"},
    "v_wind": {"standard_name": "northward_wind", "long_name": "northward wind", "units": "m s-1"},
    "pressure": {"standard_name": "surface_air_pressure", "long_name": "surface pressure", "units": "Pa"},
}
LEVEL_VARIABLES = ("temperature", "humidity", "u_wind", "v_wind")
SURFACE_VARIABLES = ("pressure",)

_WAVES = ((3, 1.0, 0.3), (5, 0.6, 1.7), (7, 0.35, 4.1))  # (zonal wavenumber, amplitude, phase)
_WAVE_SPEED_DEG_PER_DAY = 10.0


def grid(nlat: int, nlon: int) -> tuple[np.ndarray, np.ndarray]:
    """Cell-centre latitudes (ascending) and longitudes 0..360 of a regular global grid."""
    dlat, dlon = 180.0 / nlat, 360.0 / nlon
    return -90.0 + dlat * (np.arange(nlat) + 0.5), dlon * np.arange(nlon)


def _travelling_waves(t: np.ndarray, *, phi: np.ndarray, lam: np.ndarray) -> tuple[np.ndarray, ...]:
    """Travelling waves and their stream function, centred on the mid-latitudes of each hemisphere:
    (envelope, its latitude derivative, the wave, its longitude derivative)."""
    envelope = np.exp(-(((np.abs(phi) - np.deg2rad(45.0)) / np.deg2rad(20.0)) ** 2))
    d_envelope = envelope * -2 * (np.abs(phi) - np.deg2rad(45.0)) / np.deg2rad(20.0) ** 2 * np.sign(phi)
    omega = np.deg2rad(_WAVE_SPEED_DEG_PER_DAY) / 24.0
    wave = np.zeros(np.broadcast_shapes(t.shape, lam.shape))
    wave_dlam = np.zeros_like(wave)
    for k, amp, phase in _WAVES:
        angle = k * (lam - omega * t) + phase
        wave = wave + amp * np.sin(angle)
        wave_dlam = wave_dlam + amp * k * np.cos(angle)
    return envelope, d_envelope, wave, wave_dlam


def synthetic_fields(
    hours: np.ndarray, *, lat: np.ndarray, lon: np.ndarray, levels: np.ndarray, seed: int
) -> dict[str, np.ndarray]:
    """The five fields at ``hours`` (since 2000-01-01): level fields ``(T, L, lat, lon)``,
    surface pressure ``(T, lat, lon)``, float32."""
    t = np.asarray(hours, dtype=np.float64)[:, None, None, None]
    p = np.asarray(levels, dtype=np.float64)[None, :, None, None] / 1000.0
    phi = np.deg2rad(lat)[None, None, :, None]
    lam = np.deg2rad(lon)[None, None, None, :]
    rng = np.random.default_rng([seed, int(hours[0]) if len(hours) else 0])

    day_of_year = (t / 24.0) % 365.25
    season = np.cos(2 * np.pi * (day_of_year - 200.0) / 365.25)
    local_hour = (t + np.rad2deg(lam) / 15.0) % 24.0
    diurnal = np.cos(2 * np.pi * (local_hour - 15.0) / 24.0)

    envelope, d_envelope, wave, wave_dlam = _travelling_waves(t, phi=phi, lam=lam)

    surface_t = 300.0 - 45.0 * np.sin(phi) ** 2 + 15.0 * np.sin(phi) * season
    temperature = (
        surface_t * p**0.19
        + 4.0 * np.cos(phi) * diurnal * p**4
        + 6.0 * envelope * wave
        + rng.normal(0.0, 0.3, size=(len(hours), p.shape[1], len(lat), len(lon)))
    )

    jet = 35.0 * np.exp(-(((np.abs(phi) - np.deg2rad(40.0)) / np.deg2rad(12.0)) ** 2)) * (1.15 - p)
    trades = -6.0 * np.exp(-((phi / np.deg2rad(15.0)) ** 2)) * p
    u_wind = jet + trades - 4.0 * d_envelope * wave * (0.5 + (1 - p))
    v_wind = 1.5 * envelope * wave_dlam / np.maximum(np.cos(phi), 0.2) * (0.5 + (1 - p))
    u_wind = u_wind + rng.normal(0.0, 0.5, size=u_wind.shape)
    v_wind = v_wind + rng.normal(0.0, 0.5, size=v_wind.shape)

    celsius = temperature - 273.15
    saturation_vapour = 611.2 * np.exp(17.67 * celsius / (temperature - 29.65))
    q_sat = 0.622 * saturation_vapour / (p * 1e5)
    relative = np.clip(0.6 + 0.25 * envelope * wave + 0.2 * np.cos(phi) ** 4 - 0.15 * (1 - p), 0.05, 0.98)
    relative = np.clip(relative * rng.normal(1.0, 0.02, size=relative.shape), 0.0, 1.0)
    humidity = relative * q_sat

    surface = (
        101325.0
        - 800.0 * np.cos(2 * phi[:, 0]) ** 2
        + 1200.0 * envelope[:, 0] * np.roll(wave, len(lon) // 12, axis=-1)[:, 0]
        + 200.0 * np.sin(phi[:, 0]) * season[:, 0]
        + 100.0 * np.cos(phi[:, 0]) ** 3 * np.cos(2 * np.pi * 2 * (local_hour[:, 0] - 10.0) / 24.0)
        + rng.normal(0.0, 30.0, size=(len(hours), len(lat), len(lon)))
    )
    return {
        "temperature": temperature.astype(np.float32),
        "humidity": humidity.astype(np.float32),
        "u_wind": np.broadcast_to(u_wind, temperature.shape).astype(np.float32),
        "v_wind": np.broadcast_to(v_wind, temperature.shape).astype(np.float32),
        "pressure": np.broadcast_to(surface, (len(hours), len(lat), len(lon))).astype(np.float32),
    }


def _check_sizes(*, days: float, step_hours: float, nlat: int, nlon: int, levels: tuple[float, ...]) -> int:
    if step_hours <= 0 or days <= 0:
        raise ConfigError(f"--days ({days}) and --step-hours ({step_hours}) must be positive")
    if nlat < 2 or nlon < 2:
        raise ConfigError(f"--nlat ({nlat}) and --nlon ({nlon}) must be at least 2")
    if not levels or any(lv <= 0 for lv in levels):
        raise ConfigError(f"--levels must be positive pressures in hPa, got {list(levels)}")
    repeated = sorted({lv for lv in levels if levels.count(lv) > 1})
    if repeated:  # a level axis with a repeated value cannot be selected by value (data.levels)
        raise ConfigError(f"--levels repeats {', '.join(f'{lv:g}' for lv in repeated)} hPa; give each level once")
    steps = int(round(days * 24 / step_hours))
    if steps < 2:
        raise ConfigError(f"--days {days} at --step-hours {step_hours} gives {steps} time step(s); need at least 2")
    return steps


def synthetic_dataset(
    *, days: float = 10, step_hours: float = 6, nlat: int = 16, nlon: int = 32,
    levels: tuple[float, ...] = DEFAULT_LEVELS, seed: int = 0,
) -> Any:
    """The synthetic fields as an in-memory xarray Dataset with CF attributes."""
    import xarray as xr

    steps = _check_sizes(days=days, step_hours=step_hours, nlat=nlat, nlon=nlon, levels=levels)
    lat, lon = grid(nlat, nlon)
    hours = step_hours * np.arange(steps)
    fields = synthetic_fields(hours, lat=lat, lon=lon, levels=np.asarray(levels), seed=seed)
    data_vars = {
        name: (("time", "level", "lat", "lon") if name in LEVEL_VARIABLES else ("time", "lat", "lon"),
               fields[name], dict(ATTRS[name]))
        for name in (*LEVEL_VARIABLES, *SURFACE_VARIABLES)
    }
    coords = {
        "time": ("time", hours, {"standard_name": "time", "units": TIME_UNITS, "calendar": "standard", "axis": "T"}),
        "level": ("level", np.asarray(levels, dtype=np.float64),
                  {"standard_name": "air_pressure", "units": "hPa", "positive": "down", "axis": "Z"}),
        "lat": ("lat", lat, {"standard_name": "latitude", "units": "degrees_north", "axis": "Y"}),
        "lon": ("lon", lon, {"standard_name": "longitude", "units": "degrees_east", "axis": "X"}),
    }
    ds = xr.Dataset(data_vars, coords=coords, attrs=_global_attrs(seed))
    return xr.decode_cf(ds)


def _global_attrs(seed: int) -> dict[str, str]:
    return {
        "Conventions": "CF-1.8",
        "title": "optbench synthetic climate data",
        "source": f"optbench data synth (seed {seed}): analytic fields with seasonal, diurnal and wave cycles",
    }


def write_synthetic(
    out: str | Path, *, days: float = 60, step_hours: float = 6, nlat: int = 32, nlon: int = 64,
    levels: tuple[float, ...] = DEFAULT_LEVELS, seed: int = 0, time_chunk: int = 8, compress: bool = True,
) -> dict[str, Any]:
    """Write the dataset to ``out`` (NetCDF4 via h5netcdf), ``time_chunk`` steps at a time."""

    steps = _check_sizes(days=days, step_hours=step_hours, nlat=nlat, nlon=nlon, levels=levels)
    if time_chunk < 1:
        raise ConfigError(f"--time-chunk must be at least 1, got {time_chunk}")
    out = Path(out)
    if out.is_dir():
        raise ConfigError(f"{out} is a directory; give the file to write, e.g. {out / 'data.nc'}")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        _check_room(out, steps * (len(LEVEL_VARIABLES) * len(levels) + len(SURFACE_VARIABLES)) * nlat * nlon * 4)
        with atomic_path(out) as tmp:  # a failure leaves no temporary behind
            _write(tmp, steps=steps, step_hours=step_hours, nlat=nlat, nlon=nlon, levels=levels, seed=seed,
                   time_chunk=time_chunk, compress=compress)
    except OSError as exc:
        raise ConfigError(os_error_message(exc, "write the dataset")) from None
    channels = len(LEVEL_VARIABLES) * len(levels) + len(SURFACE_VARIABLES)
    return {"path": str(out), "steps": steps, "channels": channels, "grid": (nlat, nlon),
            "bytes": out.stat().st_size, "raw_bytes": steps * channels * nlat * nlon * 4}


def _check_room(out: Path, raw_bytes: int) -> None:
    """Refuse before writing when the data may not fit: HDF5 does not stop at a failed write (a full
    disk, a file-size limit) but goes on and may crash the process. ``raw_bytes`` is the size
    uncompressed, an upper bound."""
    import resource

    free = free_bytes(out.parent)
    soft, _ = resource.getrlimit(resource.RLIMIT_FSIZE)
    room = min(x for x in (free, None if soft == resource.RLIM_INFINITY else soft, 2**63) if x is not None)
    if raw_bytes > room:
        what = "a file-size limit (ulimit -f)" if soft != resource.RLIM_INFINITY and soft == room else "free space"
        raise ConfigError(
            f"{out}: the dataset may need up to {raw_bytes / 1e6:,.1f} MB (uncompressed) and {what} allows "
            f"{room / 1e6:,.1f} MB; write it elsewhere, or make it smaller (--days, --nlat, --nlon, --levels)"
        )


def _write(tmp: Path, *, steps: int, step_hours: float, nlat: int, nlon: int, levels: tuple[float, ...],
           seed: int, time_chunk: int, compress: bool) -> None:
    import h5netcdf

    lat, lon = grid(nlat, nlon)
    hours = step_hours * np.arange(steps)
    level_values = np.asarray(levels, dtype=np.float64)
    compression = {"compression": "gzip", "compression_opts": 1, "shuffle": True} if compress else {}
    with h5netcdf.File(tmp, "w") as f:
        f.attrs.update(_global_attrs(seed))
        f.dimensions = {"time": steps, "level": len(levels), "lat": nlat, "lon": nlon}
        for name, values, attrs in (
            ("time", hours, {"standard_name": "time", "units": TIME_UNITS, "calendar": "standard", "axis": "T"}),
            ("level", level_values, {"standard_name": "air_pressure", "units": "hPa", "positive": "down", "axis": "Z"}),
            ("lat", lat, {"standard_name": "latitude", "units": "degrees_north", "axis": "Y"}),
            ("lon", lon, {"standard_name": "longitude", "units": "degrees_east", "axis": "X"}),
        ):
            var = f.create_variable(name, (name,), "f8")
            var[:] = values
            var.attrs.update(attrs)
        variables = {}
        chunk = min(time_chunk, steps)
        for name in (*LEVEL_VARIABLES, *SURFACE_VARIABLES):
            dims = ("time", "level", "lat", "lon") if name in LEVEL_VARIABLES else ("time", "lat", "lon")
            shape = tuple(f.dimensions[d].size for d in dims)
            var = f.create_variable(name, dims, "f4", chunks=(chunk, *shape[1:]), **compression)
            var.attrs.update(ATTRS[name])
            variables[name] = var
        for start in range(0, steps, chunk):
            fields = synthetic_fields(hours[start : start + chunk], lat=lat, lon=lon, levels=level_values, seed=seed)
            for name, var in variables.items():
                var[start : start + chunk] = fields[name]
