"""The physical roles of climate variables, in one place: the config validates against them, the
NetCDF reader assigns them (by CF standard_name, then by name), the physics losses and the
augmentation act on them. Import-free: the config's own layer, below the data that uses it."""

PHYSICAL_ROLES = ("temperature", "pressure", "humidity", "u_wind", "v_wind")
CLIMATE_ROLES = (*PHYSICAL_ROLES, "other")

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
assert set(ROLE_NAMES) == set(PHYSICAL_ROLES) == set(ROLE_STANDARD_NAMES.values())

# The values each role can physically take, in the unit captions state it in (temperature in
# kelvin, surface/level pressure in hPa, specific humidity in g/kg, relative humidity in %, winds in
# m/s): anything outside is an undeclared fill value (1e30, -9999) or a unit mix-up, never weather.
# Wide on purpose (the coldest and hottest air ever measured, 1 hPa aloft, jet streams under
# 200 m/s); slightly negative humidity is reanalysis rounding.
PHYSICAL_BOUNDS = {
    "temperature": (150.0, 350.0),
    "pressure": (1.0, 1100.0),
    "humidity": (-1.0, 100.0),
    "relative_humidity": (-1.0, 150.0),
    "u_wind": (-200.0, 200.0),
    "v_wind": (-200.0, 200.0),
}
