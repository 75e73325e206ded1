"""The files of ``make bench-data`` part 2 and the two limits the loader is measured against.

- ``write_formats``: one synthetic datacube (``write_synthetic``, 1-degree grid, 8 steps per chunk)
  as uncompressed NetCDF4 and Zarr v2/v3, and a shorter one compressed as NetCDF4 (zlib level 1
  with shuffle, what ``optbench data synth`` writes), Zarr v2 (Blosc, zarr's v2 default: lz4 with
  shuffle) and Zarr v3 (Blosc zstd with shuffle).
- ``raw_read``: every byte of a file (store) read sequentially in 16 MiB reads: the disk's limit.
- ``decode_only``: every chunk of a compressed file decoded once from memory, with the same codec
  the file was written with (zlib + byte unshuffle for HDF5, numcodecs' Blosc for Zarr), written
  here against h5py/zarr/numcodecs directly (no optbench code), and for HDF5 also with the loader's
  own ``inflate`` (faster than ``zlib.decompress``): the decoder's limit is the faster.
"""

from __future__ import annotations

import math
import os
import time
import warnings
import zlib
from pathlib import Path

import numpy as np

from optbench.data.netcdf.synth import write_synthetic

VARIABLES = ("temperature", "humidity", "u_wind", "v_wind", "pressure")


def files_of(path: Path) -> list[Path]:
    return [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())


def drop_page_cache(path: Path) -> None:
    """Evict the file's (or store's) pages so the next read comes from the disk (clean pages only:
    ``os.sync()`` ran after writing)."""
    for file in files_of(path):
        fd = os.open(file, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def raw_read(path: Path) -> tuple[float, int]:
    """Seconds and bytes to read every byte of the file (store) sequentially in 16 MiB reads."""
    buffer = bytearray(16 << 20)
    view = memoryview(buffer)
    total = 0
    start = time.perf_counter()
    for file in files_of(path):
        with open(file, "rb", buffering=0) as f:
            while n := f.readinto(view):
                total += n
    return time.perf_counter() - start, total


def _zarr_copy(nc: Path, store: Path, *, zarr_format: int, compressor: str | None) -> None:
    import xarray as xr

    with xr.open_dataset(nc, engine="h5netcdf") as ds:
        if compressor is None:
            codec: dict = {"compressors": None}
        elif zarr_format == 2:
            import numcodecs

            codec = {"compressors": numcodecs.Blosc(cname="lz4", clevel=5, shuffle=numcodecs.Blosc.SHUFFLE)}
        else:
            from zarr.codecs import BloscCodec

            codec = {"compressors": BloscCodec(cname="zstd", clevel=5, shuffle="shuffle")}
        encoding = {v: {"chunks": (8, *ds[v].shape[1:]), **codec} for v in ds.data_vars}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # zarr's note on consolidated metadata in format 3
            ds.to_zarr(store, encoding=encoding, mode="w", zarr_format=zarr_format)


def write_formats(tmp: Path, *, gigabytes: float, compressed_gb: float, nlat: int, nlon: int) -> dict[str, Path]:
    """Label -> path of every format measured (see the module docstring)."""
    step_bytes = 17 * nlat * nlon * 4
    out: dict[str, Path] = {}
    for size, compress, stem in ((gigabytes, False, "raw"), (compressed_gb, True, "packed")):
        if size <= 0:
            continue
        steps = math.ceil(size * 1e9 / step_bytes / 8) * 8
        nc = tmp / f"{stem}.nc"
        start = time.perf_counter()
        meta = write_synthetic(nc, days=steps * 6 / 24, nlat=nlat, nlon=nlon, compress=compress)
        names = ("NetCDF4 zlib", "Zarr v2 Blosc-lz4", "Zarr v3 Blosc-zstd") if compress else (
            "NetCDF4", "Zarr v2", "Zarr v3")
        out[names[0]] = nc
        for name, zarr_format in zip(names[1:], (2, 3), strict=True):
            out[name] = tmp / f"{stem}_v{zarr_format}.zarr"
            _zarr_copy(nc, out[name], zarr_format=zarr_format, compressor="blosc" if compress else None)
        os.sync()
        print(f"  {', '.join(names)}: {meta['steps']} steps x 17 channels on a {nlat}x{nlon} grid, "
              f"{meta['raw_bytes'] / 1e9:.2f} GB of float32 ({', '.join(f'{_bytes(out[n]) / 1e9:.2f}' for n in names)} GB "
              f"on disk; written in {time.perf_counter() - start:.0f} s)")
    return out


def _bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in files_of(path))


def _hdf5_chunks(path: Path) -> list[tuple[bytes, int]]:
    """(compressed bytes, decoded size) of every chunk of the data variables."""
    import h5py

    chunks = []
    with h5py.File(path, "r") as f:
        for name in VARIABLES:
            dset = f[name]
            infos: list = []
            dset.id.chunk_iter(infos.append)
            size = int(np.prod(dset.chunks)) * dset.dtype.itemsize
            chunks += [(dset.id.read_direct_chunk(info.chunk_offset)[1], size) for info in infos]
    return chunks


def _zarr_chunks(path: Path) -> tuple[list[tuple[bytes, int]], object]:
    import numcodecs
    import zarr

    group = zarr.open_group(path, mode="r")
    chunks = []
    for name in VARIABLES:
        array = group[name]
        size = int(np.prod(array.chunks)) * np.dtype(array.dtype).itemsize
        chunks += [(f.read_bytes(), size) for f in sorted((path / name).rglob("*")) if f.is_file()
                   and not f.name.startswith((".z", "zarr.json"))]
    return chunks, numcodecs.Blosc()  # Blosc frames describe themselves: lz4 or zstd, shuffle


def decode_only(path: Path) -> dict[str, float]:
    """Decoded MB/s of every chunk of ``path``, decoded once from memory (chunks read first), by
    each decoder of its codec: for a Zarr store numcodecs' Blosc (``"numcodecs"``); for NetCDF4
    zlib ``zlib.decompress`` + unshuffle as HDF5's filters run (``"zlib"``, no optbench code) and
    the loader's own ``inflate`` (``"optbench inflate"``: the same checks, faster). Each decoder
    decodes every chunk twice, in the order A B B A (neither gains from going second), and its
    faster pass counts. The limit is the fastest of them."""
    import numcodecs

    decoders = {}
    if path.is_dir():
        chunks, codec = _zarr_chunks(path)
        decoders["numcodecs"] = lambda raw, out: codec.decode(raw, out=out)
    else:
        from optbench.data.netcdf.chunk_locator import inflate

        chunks = _hdf5_chunks(path)
        unshuffle = numcodecs.Shuffle(elementsize=4)
        decoders["zlib"] = lambda raw, out: unshuffle.decode(zlib.decompress(raw, bufsize=out.nbytes), out=out)
        decoders["optbench inflate"] = lambda raw, out: unshuffle.decode(inflate(raw, out.nbytes), out=out)
    out = np.empty(max(size for _, size in chunks), dtype=np.uint8)
    total = sum(size for _, size in chunks)
    rates: dict[str, float] = {}
    names = list(decoders)
    for name in names + names[::-1]:
        start = time.perf_counter()
        for raw, size in chunks:
            decoders[name](raw, out[:size])
        rates[name] = max(rates.get(name, 0.0), total / (time.perf_counter() - start) / 1e6)
    return rates
