"""``optbench data captions DATA.nc PAIRS.jsonl``: text computed from the climate fields themselves.

Real users pair their NetCDF data with their own text (weather bulletins, reports). For tests and
demos this writes one caption per time step, computed from the fields at that step and the
``history`` steps before it, so the text is genuinely predictable from the climate input and a
fused model can be checked for using it. A caption reads like

    Warmer than average. Global mean 13.9 C, warming 0.4 K in 12 h. North 8.1 C, south 19.6 C. Warmest 31.2 C at
    8N 141E, coldest -41.0 C at 84S 39W. Lowest pressure 985 hPa at 50N 170W. Strongest wind
    19 m/s from the southwest at 47N 96E. Humidity 9.7 g/kg.

where "average" is the mean over all the time steps of the file of the global mean temperature
(within 0.1 K of it: "Near average"); temperatures are at the lowest level (highest pressure) in degrees Celsius, cos(latitude)-weighted
means, extremes and their grid point, the change of the global mean over the history window, the
lowest surface pressure, the strongest wind at the lowest level and where it blows from (8 compass
points), and the mean specific humidity. Sentences whose variable is absent are left out.

The file format (what ``data.text`` reads) is JSON lines, one object per line:
``{"time": "2000-01-01T06:00:00", "text": "..."}``; ``time`` is an ISO 8601 date-time equal to one
of the time coordinates of the NetCDF data (or the integer step index for files without a time
coordinate).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from optbench.config import NetCDFDataConfig

COMPASS = ("north", "northeast", "east", "southeast", "south", "southwest", "west", "northwest")


def time_label(value: object) -> str | int:
    """The JSON form of one time coordinate: ISO 8601 to the second, or the step index."""
    if isinstance(value, np.datetime64):
        return str(np.datetime_as_string(value, unit="s"))
    if isinstance(value, (int, np.integer)):
        return int(value)
    if hasattr(value, "isoformat"):  # cftime dates of non-standard calendars
        return str(value.isoformat()).replace(" ", "T")[:19]
    return str(value)


def _lat(value: float) -> str:
    return f"{abs(value):.0f}{'N' if value >= 0 else 'S'}"


def _lon(value: float) -> str:
    value = (value + 180.0) % 360.0 - 180.0
    return f"{abs(value):.0f}{'E' if value >= 0 else 'W'}"


def _wind_from(u: float, v: float) -> str:
    """The compass point the wind blows from (meteorological convention)."""
    angle = (np.degrees(np.arctan2(-u, -v)) + 360.0) % 360.0  # 0 = from the north, clockwise
    return COMPASS[int((angle + 22.5) // 45.0) % 8]


class CaptionWriter:
    """Captions of a layout's time steps from the raw (physical-unit) fields."""

    def __init__(self, layout, *, history: int, step_hours: float | None) -> None:
        self.layout = layout
        self.history = history
        self.step_hours = step_hours
        channels = layout.channels
        self.index: dict[str, int] = {}
        for role in ("temperature", "pressure", "humidity", "u_wind", "v_wind"):
            found = [i for i, ch in enumerate(channels) if ch.role == role]
            if found:  # the lowest level: the highest pressure value (or the only channel)
                self.index[role] = max(found, key=lambda i: channels[i].level if channels[i].level is not None else 0)
        self.units = {role: channels[i].units for role, i in self.index.items()}
        lat = layout.lat
        self.weight = np.clip(np.cos(np.deg2rad(lat)), 0.0, None)[:, None] * np.ones(len(layout.lon))[None, :]
        self.north = lat[:, None] >= 0
        self.normal: float | None = None  # the time-mean of the global mean temperature (set_normal)

    def global_mean(self, block: np.ndarray) -> np.ndarray:
        """The global mean temperature (C) of each step of ``block``."""
        i = self.index["temperature"]
        return np.array([self._mean(self._celsius(step[i])) for step in block])

    def _mean(self, field: np.ndarray, mask: np.ndarray | None = None) -> float:
        weight = self.weight * np.isfinite(field)
        if mask is not None:
            weight = weight * mask
        return float(np.nansum(field * weight) / max(weight.sum(), 1e-12))

    def _celsius(self, field: np.ndarray) -> np.ndarray:
        return field - 273.15 if self.units.get("temperature", "K").strip() in ("K", "kelvin", "degK") else field

    def _where(self, field: np.ndarray, pick) -> tuple[float, str]:
        flat = int(pick(np.where(np.isfinite(field), field, np.nan)))
        i, j = np.unravel_index(flat, field.shape)
        return float(field[i, j]), f"{_lat(float(self.layout.lat[i]))} {_lon(float(self.layout.lon[j]))}"

    def caption(self, block: np.ndarray, t: int) -> str:
        """The caption of step ``t`` of ``block`` ``(T, C, lat, lon)``; steps before ``t`` give the trend."""
        now = block[t]
        parts: list[str] = []
        if "temperature" in self.index:
            temp = self._celsius(now[self.index["temperature"]])
            mean = self._mean(temp)
            if self.normal is not None:
                anomaly = mean - self.normal
                parts.append("Warmer than average." if anomaly > 0.1 else "Colder than average." if anomaly < -0.1
                             else "Near average.")
            sentence = f"Global mean {mean:.1f} C"
            if t >= self.history and self.history > 0:
                change = mean - self._mean(self._celsius(block[t - self.history][self.index["temperature"]]))
                trend = "warming" if change > 0.05 else "cooling" if change < -0.05 else "steady"
                span = f" in {self.history * self.step_hours:g} h" if self.step_hours else ""
                sentence += f", {trend} {abs(change):.1f} K{span}" if trend != "steady" else f", steady{span}"
            parts.append(sentence + ".")
            parts.append(f"North {self._mean(temp, self.north):.1f} C, south {self._mean(temp, ~self.north):.1f} C.")
            hot, hot_at = self._where(temp, np.nanargmax)
            cold, cold_at = self._where(temp, np.nanargmin)
            parts.append(f"Warmest {hot:.1f} C at {hot_at}, coldest {cold:.1f} C at {cold_at}.")
        if "pressure" in self.index:
            field = now[self.index["pressure"]]
            scale = 0.01 if self.units.get("pressure", "Pa").strip() == "Pa" else 1.0
            low, low_at = self._where(field * scale, np.nanargmin)
            parts.append(f"Lowest pressure {low:.0f} hPa at {low_at}.")
        if "u_wind" in self.index and "v_wind" in self.index:
            u, v = now[self.index["u_wind"]], now[self.index["v_wind"]]
            speed, at = self._where(np.hypot(u, v), np.nanargmax)
            i, j = np.unravel_index(int(np.nanargmax(np.hypot(u, v))), u.shape)
            parts.append(f"Strongest wind {speed:.0f} m/s from the {_wind_from(float(u[i, j]), float(v[i, j]))} at {at}.")
        if "humidity" in self.index:
            q = self._mean(now[self.index["humidity"]])
            scale = 1000.0 if q < 1.0 else 1.0  # kg/kg -> g/kg
            parts.append(f"Humidity {q * scale:.1f} g/kg.")
        return " ".join(parts)


def _step_hours(times: np.ndarray) -> float | None:
    if len(times) < 2 or not np.issubdtype(np.asarray(times).dtype, np.datetime64):
        return None
    return float(np.median(np.diff(times)) / np.timedelta64(1, "h"))


def write_captions(paths: list[str], out: str | Path, *, variables: list[str] | None = None,
                   history: int = 2, block: int = 64, lines: str | Path | None = None) -> dict:
    """Write one caption per time step of the NetCDF ``paths`` to ``out`` (JSON lines) and, with
    ``lines``, the texts alone one per line (for ``optbench data tokenize``: a ``task=lm`` base)."""
    from optbench.data.netcdf import ClimateSource, build_layout

    cfg = NetCDFDataConfig(paths=list(paths), history=max(2, history),  # the layout's; the trend's is ``history``
                           **({"variables": variables} if variables else {}))
    layout = build_layout(cfg)
    writer = CaptionWriter(layout, history=history, step_hours=_step_hours(layout.times))
    source = ClimateSource(layout, regrid=False)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    lengths = []
    if "temperature" in writer.index:
        means = [writer.global_mean(source.read(lo, min(layout.num_steps, lo + block)))
                 for lo in range(0, layout.num_steps, block)]
        writer.normal = float(np.mean(np.concatenate(means)))
    try:
        with tmp.open("w") as f:
            for lo in range(0, layout.num_steps, block):
                first = max(0, lo - history)
                data = source.read(first, min(layout.num_steps, lo + block))
                for t in range(lo - first, len(data)):
                    text = writer.caption(data, t) if t >= 0 else ""
                    step = first + t
                    if step < lo:
                        continue
                    lengths.append(len(text.encode()))
                    f.write(json.dumps({"time": time_label(layout.times[step]), "text": text}) + "\n")
        tmp.replace(out)
        if lines is not None:
            texts = [json.loads(line)["text"] for line in out.read_text().splitlines()]
            Path(lines).write_text("".join(text + "\n" for text in texts))
    finally:
        source.close()
        tmp.unlink(missing_ok=True)
    return {"captions": len(lengths), "max_bytes": max(lengths, default=0),
            "mean_bytes": float(np.mean(lengths)) if lengths else 0.0}
