"""Reading time ranges of a layout as float32 ``(time, channel, lat, lon)`` arrays."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from optbench.data.netcdf.files import open_dataset
from optbench.data.netcdf.layout import Layout, VarSpec


class ClimateSource:
    """Reads time ranges of the layout as ``(time, channel, lat, lon)`` float32 arrays.

    Files are opened lazily once per process (so the source can be sent to DataLoader workers)."""

    def __init__(self, layout: Layout, *, regrid: bool) -> None:
        self.layout = layout
        self.regrid = regrid
        self._handles: dict[Path, Any] = {}
        self._pid = os.getpid()

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_handles"] = {}
        return state

    def _dataset(self, path: Path) -> Any:
        if self._pid != os.getpid():  # a forked worker must not share HDF5 handles
            self._handles, self._pid = {}, os.getpid()
        if path not in self._handles:
            self._handles[path] = open_dataset(path)
        return self._handles[path]

    def close(self) -> None:
        for ds in self._handles.values():
            ds.close()
        self._handles = {}

    def read(self, start: int, stop: int) -> np.ndarray:
        """Steps ``[start, stop)`` as float32 ``(T, C, H, W)``: one read per variable per file."""
        layout = self.layout
        lat_count, lon_count = len(layout.lat), len(layout.lon)
        out = np.empty((stop - start, layout.num_channels, lat_count, lon_count), dtype=np.float32)
        for span in layout.files:
            lo, hi = max(start, span.start), min(stop, span.stop)
            if lo >= hi:
                continue
            ds = self._dataset(span.path)
            channel = 0
            for spec in layout.variables:
                out[lo - start : hi - start, channel : channel + spec.num_channels] = self._read_var(
                    ds, spec, slice(lo - span.start, hi - span.start)
                )
                channel += spec.num_channels
        if layout.lat_descending:
            out = out[:, :, ::-1, :]
        if self.regrid:
            out = self._regrid(out)
        return np.ascontiguousarray(out)

    def _read_var(self, ds: Any, spec: VarSpec, steps: slice) -> np.ndarray:
        layout = self.layout
        indexers: dict[str, Any] = {layout.time_dim: steps}
        if spec.level_dim is not None:
            indexers[spec.level_dim] = _as_slice(spec.level_index)
        data = np.asarray(ds.variables[spec.name].isel(indexers).values)
        order = [spec.dims.index(layout.time_dim)]
        if spec.level_dim is not None:
            order.append(spec.dims.index(spec.level_dim))
        order += [spec.dims.index(layout.lat_dim), spec.dims.index(layout.lon_dim)]
        data = data.transpose(order)
        return data if spec.level_dim is not None else data[:, None]

    def _regrid(self, block: np.ndarray) -> np.ndarray:
        """Linear interpolation with xarray's interp; a global grid wraps around in longitude."""
        import xarray as xr

        layout = self.layout
        lon = layout.lon
        if layout.global_lon:
            step = float(np.median(np.diff(lon)))
            lon = np.concatenate([lon[-1:] - 360.0 * np.sign(step), lon, lon[:1] + 360.0 * np.sign(step)])
            block = np.concatenate([block[..., -1:], block, block[..., :1]], axis=-1)
        array = xr.DataArray(block, dims=("time", "channel", "lat", "lon"),
                             coords={"lat": layout.lat, "lon": lon})
        return array.interp(lat=layout.out_lat, lon=layout.out_lon, method="linear").values.astype(np.float32)



def _as_slice(index: list[int]) -> slice | list[int]:
    """Consecutive indices as a slice: h5py and zarr read a slice as one hyperslab, a list as
    point-by-point fancy indexing (several times slower)."""
    if index and index == list(range(index[0], index[-1] + 1)):
        return slice(index[0], index[-1] + 1)
    return index
