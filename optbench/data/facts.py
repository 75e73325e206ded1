"""What a caption says about one time step, computed exactly from the field: ``Fact``s, each a
number with the words around it, rendered into text and parsed back out of text (a model's
generated text is scored against the field's facts: ``optbench.generate.score``).

``Describer`` computes a step's facts from the raw (physical-unit) fields of a layout:

- the temperature (the lowest level: the highest pressure value, or the only channel) in degrees
  Celsius, cos(latitude)-weighted, over the area: "Global mean" on a global grid (all longitudes,
  latitudes from 60S or further to 60N or further), "Mean" of the named box on a regional one
  ("Area 49-61N 11W-2E.");
- its anomaly against the training period's climatology (``optbench.data.netcdf.climatology``: the
  mean of the training steps only, by hour of day), as "1.2 K above normal" / "below" / "near";
- its trend: the change over the history window the model sees (describe mode: the first to the
  last input step) or from the last input step to the target (forecast mode), "warming 0.4 K in
  12 h" / "cooling" / "steady";
- the mean of named regions that fit the grid: on a global grid three latitude bands (north of
  30N, the tropics, south of 30S) and four quadrants; on a regional grid its four compass
  sub-boxes ("northwest" ...: quarters of the box, named as such) — nothing about a hemisphere or
  band the grid does not hold;
- the value at two named grid points ("at 52.2N 1.0W"), coordinates rounded to what the grid
  resolves (to a quarter of its spacing);
- the area mean of the other variables present: surface pressure (hPa), the mean wind (speed and
  the compass point it blows from), humidity (g/kg, or % for relative humidity).

Values are rounded as written (temperatures to 0.1, pressure to 1 hPa, wind to 1 m/s); a fact's
``value`` is the rounded number the text says.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from optbench.config.roles import PHYSICAL_BOUNDS
from optbench.errors import ConfigError

COMPASS = ("north", "northeast", "east", "southeast", "south", "southwest", "west", "northwest")
NUMBER = r"(?P<v>-?\d+(?:\.\d+)?)"
KELVIN_UNITS = ("K", "kelvin", "degK", "Kelvin")


@dataclass(frozen=True)
class Fact:
    """One number of a caption: ``key`` is unique within a caption, ``quantity`` the family the
    number score groups keys by, ``value`` the rounded number the ``text`` says, ``signed`` whether
    its sign is a word (anomalies, trends: the number score also counts their signs)."""

    key: str
    quantity: str
    value: float
    text: str
    pattern: str
    signed: bool = False

    def parse(self, text: str) -> float | None:
        """The number this fact's words carry in ``text`` (None: not said)."""
        match = re.search(self.pattern, text, flags=re.IGNORECASE)
        if match is None:
            return None
        groups = match.groupdict()
        if groups.get("z"):
            return 0.0
        value = float(groups["v"])
        return -value if (groups.get("s") or "").lower() in ("below", "cooling") else value


def value_fact(key: str, quantity: str, *, label: str, value: float, unit: str, decimals: int) -> Fact:
    rounded = round(float(value), decimals) + 0.0  # no "-0.0"
    text = f"{label} {rounded:.{decimals}f} {unit}"
    return Fact(key, quantity, rounded, text, rf"(?<![\w.-]){re.escape(label)} {NUMBER} {re.escape(unit)}(?!\w)")


def anomaly_fact(value: float) -> Fact:
    rounded = round(float(value), 1) + 0.0
    text = "near normal" if rounded == 0 else f"{abs(rounded):.1f} K {'above' if rounded > 0 else 'below'} normal"
    pattern = r"(?:(?P<v>\d+(?:\.\d+)?) K (?P<s>above|below) normal|(?P<z>near normal))"
    return Fact("anomaly", "anomaly", rounded, text, pattern, signed=True)


def trend_fact(value: float, *, span: str) -> Fact:
    rounded = round(float(value), 1) + 0.0
    word = "steady" if rounded == 0 else f"{'warming' if rounded > 0 else 'cooling'} {abs(rounded):.1f} K"
    pattern = r"(?:(?P<s>warming|cooling) (?P<v>\d+(?:\.\d+)?) K|(?P<z>steady))"
    return Fact("trend", "trend", rounded, word + span, pattern, signed=True)


def render(sentences: list[list[Fact]], *, header: str = "") -> str:
    """Facts joined by commas into sentences, each starting with a capital letter."""
    parts = [header] if header else []
    for facts in sentences:
        if facts:
            sentence = ", ".join(f.text for f in facts)
            parts.append(sentence[0].upper() + sentence[1:] + ".")
    return " ".join(parts)


def time_label(value: object) -> str | int:
    """The JSON form of one time coordinate: ISO 8601 to the second, or the step index."""
    if isinstance(value, np.datetime64):
        return str(np.datetime_as_string(value, unit="s"))
    if isinstance(value, (int, np.integer)):
        return int(value)
    if hasattr(value, "isoformat"):  # cftime dates of non-standard calendars
        return str(value.isoformat()).replace(" ", "T")[:19]
    return str(value)


# ------------------------------------------------------------------------------------ the grid
def coordinate_decimals(values: np.ndarray) -> int:
    """The fewest decimals that keep every coordinate within a quarter of the grid spacing."""
    spacing = float(np.min(np.abs(np.diff(values)))) if len(values) > 1 else 1.0
    for decimals in range(4):
        if np.max(np.abs(np.round(values, decimals) - values)) <= spacing / 4 + 1e-9:
            return decimals
    return 4


def lat_label(value: float, decimals: int) -> str:
    return f"{abs(value):.{decimals}f}{'N' if value >= 0 else 'S'}"


def lon_label(value: float, decimals: int) -> str:
    value = (value + 180.0) % 360.0 - 180.0
    return f"{abs(value):.{decimals}f}{'E' if value >= 0 else 'W'}"


def is_global(lat: np.ndarray, *, global_lon: bool) -> bool:
    return bool(global_lon and lat.min() <= -60.0 and lat.max() >= 60.0)


def named_regions(lat: np.ndarray, lon: np.ndarray, *, global_grid: bool) -> list[tuple[str, np.ndarray]]:
    """(name, mask over the grid) of each region that has grid points: latitude bands and
    quadrants of a global grid, compass quarters of a regional box."""
    lat2, lon2 = np.meshgrid(lat, (lon + 180.0) % 360.0 - 180.0, indexing="ij")
    regions: list[tuple[str, np.ndarray]] = []
    if global_grid:
        regions += [("north of 30N", lat2 >= 30.0), ("tropics", np.abs(lat2) < 30.0), ("south of 30S", lat2 <= -30.0)]
        north, east = lat2 >= 0.0, lon2 >= 0.0
    else:
        rows, cols = np.indices((len(lat), len(lon)))
        north = rows >= len(lat) // 2 if lat[0] < lat[-1] else rows < (len(lat) + 1) // 2
        east = cols >= len(lon) // 2 if lon[0] < lon[-1] else cols < (len(lon) + 1) // 2
        if len(lat) < 2 or len(lon) < 2:
            return []
    regions += [("northwest", north & ~east), ("northeast", north & east), ("southwest", ~north & ~east),
                ("southeast", ~north & east)]
    return [(name, mask) for name, mask in regions if mask.any()]


def area_header(lat: np.ndarray, lon: np.ndarray) -> str:
    """"Area 49-61N 11W-2E." for a regional box (its bounds, to the degree)."""
    def span(lo: float, hi: float, label) -> str:
        a, b = label(lo, 0), label(hi, 0)
        if a[-1] == b[-1]:
            return f"{a[:-1]}-{b}"
        return f"{a}-{b}"
    lons = (np.asarray(lon) + 180.0) % 360.0 - 180.0
    return f"Area {span(float(lat.min()), float(lat.max()), lat_label)} {span(float(lons.min()), float(lons.max()), lon_label)}."


def wind_from(u: float, v: float) -> str:
    """The compass point the wind blows from (meteorological convention)."""
    angle = (np.degrees(np.arctan2(-u, -v)) + 360.0) % 360.0  # 0 = from the north, clockwise
    return COMPASS[int((angle + 22.5) // 45.0) % 8]


# ---------------------------------------------------------------------------------- describer
class Describer:
    """The facts of a layout's time steps (``sentences``) and their caption (``caption``).

    ``mode``: ``describe`` (the step is the last input step; the trend spans the ``history``
    window) or ``forecast`` (the step is the target; the trend is from the last input step).
    ``climatology``: the training period's (None: no anomaly). ``step_hours``: the time step in
    hours (None: trends are said in steps)."""

    def __init__(self, layout, *, history: int, mode: str, climatology=None, step_hours: float | None) -> None:
        self.history, self.mode, self.climatology, self.step_hours = history, mode, climatology, step_hours
        self.files, self.times = layout.files, layout.times
        channels = self.channels = layout.channels
        self.index: dict[str, int] = {}
        for role in ("temperature", "pressure", "humidity", "u_wind", "v_wind"):
            found = [i for i, ch in enumerate(channels) if ch.role == role]
            if found:  # the lowest level: the highest pressure value (or the only channel)
                self.index[role] = max(found, key=lambda i: channels[i].level if channels[i].level is not None else 0)
        self.units = {role: channels[i].units.strip() for role, i in self.index.items()}
        lat, lon = np.asarray(layout.lat, dtype=np.float64), np.asarray(layout.lon, dtype=np.float64)
        self.weight = np.clip(np.cos(np.deg2rad(lat)), 0.0, None)[:, None] * np.ones(len(lon))[None, :]
        global_grid = is_global(lat, global_lon=layout.global_lon)
        self.regions = named_regions(lat, lon, global_grid=global_grid)
        self.header = "" if global_grid else area_header(lat, lon)
        self.mean_label = "global mean" if global_grid else "mean"
        lat_d, lon_d = coordinate_decimals(lat), coordinate_decimals(lon)
        picks = sorted({(len(lat) // 4, len(lon) // 4), ((3 * len(lat)) // 4, (3 * len(lon)) // 4)})
        self.points = [(f"{lat_label(lat[i], lat_d)} {lon_label(lon[j], lon_d)}", i, j) for i, j in picks]

    # --- arithmetic ----------------------------------------------------------------------------
    def _mean(self, field: np.ndarray, mask: np.ndarray | None = None) -> float:
        weight = self.weight * np.isfinite(field)
        if mask is not None:
            weight = weight * mask
        return float(np.nansum(field * weight) / max(weight.sum(), 1e-12))

    def _celsius(self, field: np.ndarray) -> np.ndarray:
        return field - 273.15 if self.units.get("temperature", "K") in KELVIN_UNITS else field

    def trend_start(self, t: int) -> int | None:
        """The step the trend of step ``t`` starts from (None: no trend)."""
        start = t - (self.history - 1) if self.mode == "describe" else t - 1
        return start if 0 <= start < t else None

    # --- what can be described ------------------------------------------------------------------
    def _physical(self, role: str, field: np.ndarray) -> tuple[np.ndarray, str, tuple[float, float]]:
        """``field`` in the unit ``PHYSICAL_BOUNDS`` gives ``role`` (the caption's, or kelvin), that
        unit and the bounds."""
        units = self.units[role]
        if role == "temperature":
            kelvin = units in KELVIN_UNITS
            return (field if kelvin else field + 273.15), ("K" if kelvin else "K (from C)"), PHYSICAL_BOUNDS[role]
        if role == "pressure":
            return field * (0.01 if units == "Pa" else 1.0), "hPa", PHYSICAL_BOUNDS[role]
        if role == "humidity" and units in ("%", "percent"):
            return field, "%", PHYSICAL_BOUNDS["relative_humidity"]
        if role == "humidity":
            return field * (1.0 if units.startswith("g") else 1000.0), "g/kg", PHYSICAL_BOUNDS[role]
        return field, "m/s", PHYSICAL_BOUNDS[role]

    def check(self, now: np.ndarray, *, step: int) -> None:
        """ConfigError naming the file, variable and time when a described field of step ``step``
        (``now``: ``(C, lat, lon)``, raw) has no finite value or one no weather has
        (``PHYSICAL_BOUNDS``: an undeclared fill value); missing (NaN, ±inf) points are left out."""
        for role, i in self.index.items():
            values, unit, (lo, hi) = self._physical(role, now[i])
            finite = values[np.isfinite(values)]
            problem = None
            if finite.size == 0:  # the reader makes ±inf missing (NaN), as it does for training
                problem = "has no finite value (all NaN or ±inf)"
            elif finite.min() < lo or finite.max() > hi:
                worst = float(finite.min() if finite.min() < lo else finite.max())
                problem = f"holds {worst:g} {unit}, outside {lo:g} to {hi:g} {unit.split()[0]}"
            if problem is not None:
                path = next((f.path for f in self.files if f.start <= step < f.stop), self.files[0].path)
                raise ConfigError(
                    f"{path}: {self.channels[i].label} ({role}) at {time_label(self.times[step])} {problem}: an "
                    "undeclared fill value or a broken step? declare it as the variable's _FillValue or "
                    "missing_value (read as missing), or leave that step out of the file")

    # --- facts ---------------------------------------------------------------------------------
    def sentences(self, block: np.ndarray, t: int, *, step: int) -> list[list[Fact]]:
        """The facts of step ``t`` of ``block`` ``(T, C, lat, lon)`` (raw values; absolute step
        ``step``, for the climatology), sentence by sentence; ConfigError (``check``) for a step,
        or the step its trend starts from, that cannot be described."""
        self.check(block[t], step=step)
        start = self.trend_start(t)
        if start is not None and "temperature" in self.index:
            self.check(block[start], step=step - (t - start))
        out: list[list[Fact]] = []
        if "temperature" in self.index:
            out += self._temperature(block, t, step=step)
        out.append(self._others(block[t]))
        return [s for s in out if s]

    def _temperature(self, block: np.ndarray, t: int, *, step: int) -> list[list[Fact]]:
        ti = self.index["temperature"]
        temp = self._celsius(block[t, ti])
        first = [value_fact("mean", "area mean", label=self.mean_label, value=self._mean(temp), unit="C", decimals=1)]
        if self.climatology is not None:
            normal = self._celsius(self.climatology.mean[self.climatology.group_of_step[step], ti])
            first.append(anomaly_fact(self._mean(temp - normal)))
        start = self.trend_start(t)
        if start is not None:
            hours = (t - start) * self.step_hours if self.step_hours else None
            span = f" in {hours:g} h" if hours else f" in {t - start} steps"
            first.append(trend_fact(self._mean(temp) - self._mean(self._celsius(block[start, ti])), span=span))
        regions = [value_fact(f"region:{name}", "regions", label=name, value=self._mean(temp, mask), unit="C",
                              decimals=1) for name, mask in self.regions]
        points = [value_fact(f"point:{label}", "points", label=f"at {label}", value=float(temp[i, j]), unit="C",
                             decimals=1) for label, i, j in self.points if np.isfinite(temp[i, j])]
        return [first, regions, points]

    def _others(self, now: np.ndarray) -> list[Fact]:
        facts = []
        if "pressure" in self.index:
            scale = 0.01 if self.units["pressure"] == "Pa" else 1.0
            facts.append(value_fact("pressure", "pressure", label="pressure",
                                    value=self._mean(now[self.index["pressure"]]) * scale, unit="hPa", decimals=0))
        if "u_wind" in self.index and "v_wind" in self.index:
            u, v = self._mean(now[self.index["u_wind"]]), self._mean(now[self.index["v_wind"]])
            fact = value_fact("wind", "wind", label="wind", value=float(np.hypot(u, v)), unit="m/s", decimals=0)
            facts.append(Fact(**{**fact.__dict__, "text": f"{fact.text} from the {wind_from(u, v)}"}))
        if "humidity" in self.index:
            q = self._mean(now[self.index["humidity"]])
            units = self.units["humidity"]
            if units in ("%", "percent"):
                facts.append(value_fact("humidity", "humidity", label="humidity", value=q, unit="%", decimals=0))
            else:
                scale = 1.0 if units.startswith("g") else 1000.0  # kg/kg -> g/kg
                facts.append(value_fact("humidity", "humidity", label="humidity", value=q * scale, unit="g/kg",
                                        decimals=1))
        return facts

    def facts(self, block: np.ndarray, t: int, *, step: int) -> dict[str, Fact]:
        return {f.key: f for sentence in self.sentences(block, t, step=step) for f in sentence}

    def caption(self, block: np.ndarray, t: int, *, step: int) -> str:
        return render(self.sentences(block, t, step=step), header=self.header)
