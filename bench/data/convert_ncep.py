"""Write the NCEP air-temperature reanalysis of xarray's tutorial (``air_temperature``: 2013-2014,
6-hourly, North America on a 2.5 degree grid) as the compressed NetCDF file the fusion benchmark
reads (``ncep_air_2013-2014_6h.nc``): every step and point as they are, ``air`` kept as the source's
int16 (scale 0.01 K), deflated in chunks of 20 steps, CF time coordinate. Run once at development
time, from the tutorial file or any copy of it xarray opens (a NetCDF file, or the Zarr store of
github.com/scottyhq/zarrdata, ``air_temperature.zarr``):

    python bench/data/convert_ncep.py air_temperature.zarr bench/data/ncep_air_2013-2014_6h.nc
"""

from __future__ import annotations

import sys

import xarray as xr


def main(source: str, out: str) -> None:
    ds = xr.open_dataset(source, engine="zarr" if source.rstrip("/").endswith(".zarr") else None)
    air = ds[["air"]].load()
    air.attrs = {**ds.attrs, "source": "NCEP/NCAR Reanalysis 1 (NOAA PSL), 4x daily air temperature at sigma 0.995, "
                                       "the 2013-2014 North America subset of xarray's tutorial data "
                                       "(github.com/pydata/xarray-data, air_temperature.nc)",
                 "licence": "NOAA/NCEP data: public domain, no restriction on use (acknowledge NOAA PSL)"}
    encoding = {"air": {"dtype": "int16", "scale_factor": 0.01, "_FillValue": -32767, "compression": "gzip",
                        "compression_opts": 9, "shuffle": True, "chunksizes": (20, *air["air"].shape[1:])},
                "time": {"dtype": "int32", "units": "hours since 2013-01-01 00:00:00"}}
    air.to_netcdf(out, format="NETCDF4", engine="h5netcdf", encoding=encoding)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
