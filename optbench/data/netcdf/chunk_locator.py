"""The chunks of one variable in one file, located through h5py (NetCDF4/HDF5) or zarr (Zarr v2/v3).

A variable stored as ``(time, [level,] lat, lon)`` in chunks that each cover the whole lat/lon grid
is read chunk by chunk, without xarray's indexing machinery:

- an **uncompressed** chunk (HDF5 without filters, Zarr without compressor/filters) has the array's
  bytes at a known place in a file (``raw``: file descriptor, byte offset); the loader reads the
  time steps it needs straight into its block with ``os.preadv`` (no intermediate buffer);
- a **compressed** chunk (HDF5 deflate with or without shuffle; Zarr Blosc, Zstd or Gzip) is read
  as bytes and decoded by ``decode_chunk`` into a reused chunk-shaped buffer: zlib (``inflate``) +
  numcodecs' shuffle for HDF5, the numcodecs codec zarr itself uses for Zarr.

``open_chunks`` returns None for a layout this module does not handle (tiled lat/lon chunks,
another dimension order, other filters or codecs, sharding): such a variable is read through
xarray, which handles everything, and ``why`` says so (``optbench data inspect`` prints it).
"""

from __future__ import annotations

import os
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import deflate as libdeflate
import numpy as np

H5Z_DEFLATE, H5Z_SHUFFLE = 1, 2
IOV_MAX = 1024  # buffers per preadv call (Linux's limit)


@dataclass
class Chunks:
    """Where the chunks of one variable are, and how to decode one."""

    label: str  # e.g. "uncompressed HDF5 chunks", "Zarr v3 chunks (zstd)"
    shape: tuple[int, ...]  # the variable's shape as (time, level, lat, lon) (level 1 without one)
    chunks: tuple[int, ...]  # chunk shape, same axes
    dtype: np.dtype
    fill: Any  # the value of a chunk never written
    compressed: bool
    _locate: Any = field(repr=False)  # coords -> (fd or path, offset, size, filter_mask) | None (missing)
    _decode: Any = field(repr=False)  # (raw bytes, out chunk array, filter_mask) -> None
    _cache: dict = field(default_factory=dict, repr=False)

    def locate(self, coords: tuple[int, ...]) -> tuple[int | Path, int, int, int] | None:
        """(file descriptor or path, byte offset, stored size, filter mask) of the chunk at chunk
        ``coords``; None if it was never written (it holds the fill value)."""
        if coords not in self._cache:
            self._cache[coords] = self._locate(coords)
        return self._cache[coords]

    def will_need(self, coords: tuple[int, ...]) -> None:
        """Ask the kernel to start reading the stored bytes of the chunk at ``coords`` now
        (``posix_fadvise WILLNEED``: it returns at once, the read goes on while this thread decodes
        the chunk before it). Only a hint: where the platform has no fadvise it does nothing."""
        where = self.locate(coords)
        if where is None or not hasattr(os, "posix_fadvise"):
            return
        source, offset, size, _ = where
        try:
            if isinstance(source, Path):
                fd = os.open(source, os.O_RDONLY)
                try:
                    os.posix_fadvise(fd, offset, size, os.POSIX_FADV_WILLNEED)
                finally:
                    os.close(fd)
            else:
                os.posix_fadvise(source, offset, size, os.POSIX_FADV_WILLNEED)
        except OSError:
            pass  # a hint that cannot be given changes nothing read; the read itself reports errors

    def decode_chunk(self, coords: tuple[int, ...], out: np.ndarray, scratch: bytearray) -> bytearray:
        """The whole chunk at ``coords`` into ``out`` (chunk-shaped, stored dtype); returns the
        (possibly grown) byte buffer it used for the compressed bytes."""
        where = self.locate(coords)
        if where is None:
            out[...] = self.fill
            return scratch
        source, offset, size, mask = where
        if len(scratch) < size:
            scratch = bytearray(size)
        view = memoryview(scratch)[:size]
        read_exactly(source, [view], offset)
        self._decode(view, out, mask)
        return scratch


def read_exactly(source: int | Path, buffers: list, offset: int) -> None:
    """``os.preadv`` into ``buffers`` from a file descriptor (kept open by its owner) or a path
    (a Zarr chunk file, opened for this read); a short read is an error (a truncated file)."""
    if isinstance(source, Path):
        fd = os.open(source, os.O_RDONLY)
        try:
            _preadv(fd, buffers, offset)
        finally:
            os.close(fd)
    else:
        _preadv(source, buffers, offset)


def _preadv(fd: int, buffers: list, offset: int) -> None:
    for i in range(0, len(buffers), IOV_MAX):
        group = buffers[i : i + IOV_MAX]
        want = sum(memoryview(b).nbytes for b in group)
        got = os.preadv(fd, group, offset)
        if got != want:
            raise OSError(f"short read: {got} of {want} bytes at offset {offset} (the file is truncated)")
        offset += want


def _as_4d(shape: tuple[int, ...], has_level: bool) -> tuple[int, ...]:
    return tuple(shape) if has_level else (shape[0], 1, *shape[1:])


# ------------------------------------------------------------------------------------------- HDF5
def _hdf5_filters(dset: Any) -> tuple[bool, bool] | str:
    """(deflate, shuffle) of the dataset's filter pipeline, or why it is not handled here."""
    plist = dset.id.get_create_plist()
    codes = [plist.get_filter(i)[0] for i in range(plist.get_nfilters())]
    if codes in ([], [H5Z_DEFLATE], [H5Z_SHUFFLE, H5Z_DEFLATE], [H5Z_SHUFFLE]):
        return H5Z_DEFLATE in codes, H5Z_SHUFFLE in codes
    return f"HDF5 filters {codes} (only deflate and shuffle are decoded directly)"


def inflate(raw: memoryview | bytes, size: int) -> bytes | bytearray:
    """A zlib stream (RFC 1950: what HDF5's deflate filter writes) decoded, ``size``: the decoded
    size expected. libdeflate (the ``deflate`` package) decodes it with zlib's checks, the
    header's and the Adler-32 of the output, 2.2x as fast as zlib's raw inflate on ``make
    bench-data``'s chunks (docs/climate-data-loader.md). A stream libdeflate refuses goes to ``zlib.decompress``,
    which raises zlib's own error for it (or decodes it, when only the size differs)."""
    view = memoryview(raw)
    try:
        return libdeflate.zlib_decompress(view, size)
    except libdeflate.DeflateError:
        return zlib.decompress(view, bufsize=size)


def _hdf5_decoder(dtype: np.dtype, *, deflate: bool, shuffle: bool) -> Any:
    unshuffle = None
    if shuffle:
        import numcodecs

        unshuffle = numcodecs.Shuffle(elementsize=dtype.itemsize)
    nbytes_of = np.dtype(dtype).itemsize

    def decode(raw: memoryview, out: np.ndarray, mask: int) -> None:
        data: Any = raw
        if deflate and not mask & 2 ** (1 if shuffle else 0):  # bit i set: filter i skipped
            data = inflate(raw, out.size * nbytes_of)
        flat = out.reshape(-1).view(np.uint8)
        if unshuffle is not None and not mask & 1:
            unshuffle.decode(data, out=flat)
        else:
            flat[...] = np.frombuffer(data, dtype=np.uint8, count=flat.size)

    return decode


def hdf5_chunks(h5file: Any, fd: int, name: str, *, has_level: bool) -> Chunks | str:
    """The chunks of ``name``, stored as (time, [level,] lat, lon), in an open h5py File (``fd``:
    the same file opened for preadv); a string says why they are not read here."""
    dset = h5file[name]
    shape = _as_4d(dset.shape, has_level)
    chunks = _as_4d(dset.chunks, has_level) if dset.chunks else shape
    if chunks[2:] != shape[2:]:
        return f"chunks of {'x'.join(map(str, chunks))} tile the lat/lon grid"
    filters = _hdf5_filters(dset)
    if isinstance(filters, str):
        return filters
    deflate, shuffle = filters
    contiguous = dset.chunks is None

    def locate(coords: tuple[int, ...]) -> tuple[int, int, int, int] | None:
        if contiguous:
            offset = dset.id.get_offset()
            return None if offset is None else (fd, offset, dset.id.get_storage_size(), 0)
        element = tuple(c * n for c, n in zip(coords, chunks, strict=True))
        info = dset.id.get_chunk_info_by_coord(element if has_level else element[:1] + element[2:])
        return None if info.byte_offset is None else (fd, info.byte_offset, info.size, info.filter_mask)

    label = "HDF5 " + ("contiguous" if contiguous else "chunks") + (
        f" ({'shuffle+' if shuffle else ''}deflate)" if deflate else " (shuffle)" if shuffle else ", uncompressed")
    return Chunks(label=label, shape=shape, chunks=chunks, dtype=dset.dtype, fill=dset.fillvalue,
                  compressed=deflate or shuffle, _locate=locate,
                  _decode=_hdf5_decoder(dset.dtype, deflate=deflate, shuffle=shuffle))


# ------------------------------------------------------------------------------------------- Zarr
def _zarr_codec(array: Any) -> Any:
    """(None for raw bytes | a numcodecs codec) of the array's storage, or why it is not handled."""
    import numcodecs

    meta = array.metadata
    if meta.zarr_format == 2:
        if meta.filters or meta.order != "C":
            return "Zarr v2 filters or Fortran order"
        return meta.compressor
    names = [type(c).__name__ for c in meta.codecs]
    if not names or names[0] != "BytesCodec" or len(names) > 2:
        return f"Zarr v3 codecs {names} (sharding, transpose or several compressors)"
    if len(names) == 1:
        return None
    codecs = {"BloscCodec": numcodecs.Blosc, "ZstdCodec": numcodecs.Zstd, "GzipCodec": numcodecs.GZip}
    if names[1] not in codecs:
        return f"Zarr v3 codec {names[1]}"
    return codecs[names[1]]()  # these formats are self-describing: decoding needs no parameters


def zarr_chunks(group: Any, root: Path, name: str, *, has_level: bool) -> Chunks | str:
    """The chunks of ``name``, stored as (time, [level,] lat, lon), in an open zarr group stored in
    the directory ``root``; a string says why they are not read here."""
    array = group[name]
    if not hasattr(getattr(array, "metadata", None), "encode_chunk_key"):
        return "zarr < 3 is installed (its chunk keys are not read here)"
    shape = _as_4d(array.shape, has_level)
    chunks = _as_4d(array.chunks, has_level)
    if chunks[2:] != shape[2:]:
        return f"chunks of {'x'.join(map(str, chunks))} tile the lat/lon grid"
    codec = _zarr_codec(array)
    if isinstance(codec, str):
        return codec
    dtype = np.dtype(array.dtype)
    if dtype.byteorder == ">":
        return "big-endian Zarr data"
    folder = root / array.path

    def locate(coords: tuple[int, ...]) -> tuple[Path, int, int, int] | None:
        path = folder / array.metadata.encode_chunk_key(coords if has_level else coords[:1] + coords[2:])
        try:
            return path, 0, path.stat().st_size, 0
        except FileNotFoundError:
            return None

    def decode(raw: memoryview, out: np.ndarray, mask: int) -> None:
        codec.decode(raw, out=out.reshape(-1).view(np.uint8))

    label = f"Zarr v{array.metadata.zarr_format} chunks" + (
        f" ({type(codec).__name__.lower()})" if codec is not None else ", uncompressed")
    return Chunks(label=label, shape=shape, chunks=chunks, dtype=dtype, fill=array.fill_value,
                  compressed=codec is not None, _locate=locate, _decode=decode)
