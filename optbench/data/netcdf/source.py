"""Reading time ranges of a layout as float32 ``(time, channel, lat, lon)`` blocks.

Each file is opened once per process: xarray (h5netcdf, scipy or zarr engine) for its CF encoding
and as the general reader, and h5py or zarr for its chunks. Every variable gets the fastest reader
that applies (``readers``): chunk by chunk, straight into the block where the bytes on disk are the
values, else through one reused buffer; through xarray where the layout needs it (NetCDF3, tiled
or transposed storage, ``data.reader=xarray``). ``ClimateSource.read_into`` decodes and
normalizes into a caller's block; ``read`` returns physical values in a new array.
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path
from typing import Any

import numpy as np

from optbench.data.netcdf.chunk_locator import hdf5_chunks, zarr_chunks
from optbench.data.netcdf.decode import PHYSICAL, Affine, decode_into, decoding_of
from optbench.data.netcdf.files import NETCDF4, ZARR, detect_format, open_dataset
from optbench.data.netcdf.layout import Layout, VarSpec
from optbench.data.netcdf.readers import READ_ERRORS, ChunkError, ChunkReader, DataFileError, XarrayReader
from optbench.errors import ConfigError

log = logging.getLogger(__name__)

READERS = ("auto", "xarray")


class _OpenFile:
    """One file's handles in this process and a reader per variable."""

    def __init__(self, path: Path, layout: Layout, *, reader: str) -> None:
        self.path = path
        self.ds = open_dataset(path)
        self.h5: Any = None
        self.fd: int | None = None
        self.group: Any = None
        fmt = detect_format(path)
        try:
            if reader == "auto" and fmt is NETCDF4:
                import h5py

                self.h5 = h5py.File(path, "r")
                self.fd = os.open(path, os.O_RDONLY)
            elif reader == "auto" and fmt is ZARR:
                import zarr

                self.group = zarr.open_group(path, mode="r")
        except (OSError, ValueError, KeyError) as exc:
            self.close()
            raise ConfigError(f"{path} could not be opened for reading ({str(exc).splitlines()[0]}); the file is "
                              "corrupt or truncated: check it or download it again") from exc
        self.readers = {spec.name: self._reader(spec, layout, fmt=fmt, reader=reader) for spec in layout.variables}

    def _reader(self, spec: VarSpec, layout: Layout, *, fmt: Any, reader: str) -> ChunkReader | XarrayReader:
        dims3 = (layout.time_dim, layout.lat_dim, layout.lon_dim)
        flip = layout.lat_descending
        stored = (layout.time_dim, *((spec.level_dim,) if spec.level_dim else ()), layout.lat_dim, layout.lon_dim)
        decoding = decoding_of(self.ds[spec.name])
        why = None
        if reader == "xarray":
            why = "data.reader=xarray"
        elif self.h5 is None and self.group is None:
            why = f"{fmt.label}: no chunks to read directly"
        elif decoding is None:
            why = "a CF encoding xarray applies (_Unsigned or non-numeric storage)"
        elif spec.dims != stored:
            why = f"stored as ({', '.join(spec.dims)}), not (time, [level,] lat, lon)"
        if why is None:
            has_level = spec.level_dim is not None
            chunks = (hdf5_chunks(self.h5, self.fd, spec.name, has_level=has_level) if self.h5 is not None
                      else zarr_chunks(self.group, self.path, spec.name, has_level=has_level))
            if not isinstance(chunks, str):
                assert decoding is not None
                return ChunkReader(chunks, decoding=decoding, levels=spec.level_index, flip=flip)
            why = chunks
        return XarrayReader(self.ds.variables[spec.name], spec=spec, dims=dims3, flip=flip, why=why)

    def close(self) -> None:
        for handle in (self.ds, self.h5):
            if handle is not None:
                handle.close()
        if self.fd is not None:
            os.close(self.fd)
        self.ds = self.h5 = self.fd = None


class ClimateSource:
    """Reads time ranges of the layout as ``(time, channel, lat, lon)`` float32 arrays.

    Files are opened lazily once per process (so the source can be sent to DataLoader workers).
    One thread reads at a time: a file's readers reuse their buffers (compressed bytes, the last
    decoded chunk), and training's read-ahead thread and the evaluation in the main thread read
    through the same source. Two reads at once decoded each other's bytes."""

    def __init__(self, layout: Layout, *, regrid: bool, reader: str = "auto") -> None:
        if reader not in READERS:
            raise ConfigError(f"data.reader={reader} is unknown; use one of {', '.join(READERS)}")
        self.layout = layout
        self.regrid = regrid
        self.reader = reader
        self._files: dict[Path, _OpenFile] = {}
        self._pid = os.getpid()
        self._lock = threading.Lock()

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_files"] = {}
        del state["_lock"]
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def _this_process(self) -> None:
        """A forked worker opens its own handles (HDF5's must not be shared) and takes a new lock
        (the parent's may have been held by a thread the fork did not copy)."""
        if self._pid != os.getpid():
            self._files, self._pid, self._lock = {}, os.getpid(), threading.Lock()

    def _reading(self) -> threading.Lock:
        self._this_process()
        return self._lock

    def _file(self, path: Path) -> _OpenFile:
        self._this_process()
        if path not in self._files:
            self._files[path] = _OpenFile(path, self.layout, reader=self.reader)
        return self._files[path]

    def xarray_dataset(self, path: Path) -> Any:
        """The xarray dataset of ``path`` as this process opened it (CF-decoded, lazy)."""
        return self._file(path).ds

    def read_paths(self) -> dict[str, str]:
        """How each variable of the first file is read (for logs and ``data inspect``)."""
        opened = self._file(self.layout.files[0].path)
        return {name: reader.path for name, reader in opened.readers.items()}

    def close(self) -> None:
        with self._reading():
            for opened in self._files.values():
                opened.close()
            self._files = {}

    def read(self, start: int, stop: int) -> np.ndarray:
        """Steps ``[start, stop)`` as physical float32 ``(T, C, H, W)`` values (a new array)."""
        out = np.empty((stop - start, self.layout.num_channels, *self.layout.grid), dtype=np.float32)
        return self.read_into(out, start, stop)

    def read_into(self, out: np.ndarray, start: int, stop: int, *, affine: Affine | None = None) -> np.ndarray:
        """Steps ``[start, stop)`` into ``out[:stop - start]`` (C-contiguous float32 on the output
        grid), decoded then mapped by ``affine`` (the normalization; None: physical values); ±inf
        and fill values become NaN. Returns that part of ``out``."""
        block = out[: stop - start]
        with self._reading():
            if self.regrid:
                native = np.empty((stop - start, self.layout.num_channels, len(self.layout.lat), len(self.layout.lon)),
                                  dtype=np.float32)
                self._read_native(native, start, stop, affine=None)
                decode_into(block, self._regrid(native), decoding=PHYSICAL, affine=affine)
            else:
                self._read_native(block, start, stop, affine=affine)
        return block

    def _read_native(self, block: np.ndarray, start: int, stop: int, *, affine: Affine | None) -> None:
        for span in self.layout.files:
            lo, hi = max(start, span.start), min(stop, span.stop)
            if lo >= hi:
                continue
            opened = self._file(span.path)
            channel = 0
            for spec in self.layout.variables:
                count = spec.num_channels
                dest = block[lo - start : hi - start, channel : channel + count]
                part = None if affine is None else affine.channels(channel, channel + count)
                try:
                    opened.readers[spec.name].read(dest, lo - span.start, hi - span.start, affine=part)
                except ChunkError as exc:  # the chunk's own steps
                    raise DataFileError(self._read_error(span.path, spec.name, span.start + exc.first,
                                                         span.start + exc.stop, exc.error)) from exc
                except READ_ERRORS as exc:
                    raise DataFileError(self._read_error(span.path, spec.name, lo, hi, exc)) from exc
                channel += count

    def _read_error(self, path: Path, name: str, lo: int, hi: int, exc: BaseException) -> str:
        times = self.layout.times
        kind = type(exc).__name__ if type(exc).__module__ == "builtins" else f"{type(exc).__module__}.{type(exc).__name__}"
        reason = f"{kind}: {str(exc).splitlines()[0]}" if str(exc) else kind
        return (f"{path}: variable '{name}', time steps {lo}..{hi - 1} ({_when(times[lo])} .. {_when(times[hi - 1])}) "
                f"could not be read ({reason}); the file is corrupt or truncated: check it "
                f"(ncdump -v {name}, or the store's chunk files) or download it again")

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


def _when(value: Any) -> str:
    text = str(value)
    return text[:19].replace("T", " ") if len(text) >= 19 and text[4] == "-" else text
