"""Convert the ERA5 GRIB sample (2 m temperature over the UK, March 2019, hourly) into the small
NetCDF file the fusion benchmark reads (``era5uk_2019-03_t2m_3h.nc``): every third hour, ``t2m``
packed as int16 (scale 0.002 K), CF time coordinate. Run once at development time; it needs
``cfgrib`` and ``eccodes`` (not dependencies of optbench, whose runs read the NetCDF file):

    pip install --target /tmp/grib cfgrib eccodes
    PYTHONPATH=/tmp/grib python bench/data/convert_era5uk.py era5uk.grib bench/data/era5uk_2019-03_t2m_3h.nc
"""

from __future__ import annotations

import sys

import numpy as np
import xarray as xr


def main(grib: str, out: str) -> None:
    ds = xr.open_dataset(grib, engine="cfgrib")
    t2m = ds["t2m"].isel(time=slice(0, None, 3)).drop_vars(["number", "step", "surface", "valid_time"],
                                                           errors="ignore")
    small = xr.Dataset({"t2m": t2m})
    small["t2m"].attrs = {"standard_name": "air_temperature", "long_name": "2 metre temperature", "units": "K"}
    small.attrs = {"source": "ERA5 hourly single levels (Copernicus Climate Change Service), via the GRIB sample "
                             "of github.com/pydata/xarray-data (era5-2mt-2019-03-uk.grib); every third hour",
                   "licence": "Copernicus ERA5 licence (contains modified Copernicus Climate Change Service information 2019)"}
    offset = float(np.floor(float(t2m.min())))
    encoding = {"t2m": {"dtype": "int16", "scale_factor": 0.002, "add_offset": offset + 60.0, "_FillValue": -32768},
                "time": {"units": "hours since 2019-03-01 00:00:00", "dtype": "int32"}}
    small.to_netcdf(out, encoding=encoding, format="NETCDF3_64BIT")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
