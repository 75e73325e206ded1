"""Reading one variable's time steps of one file into a region of a block, decoded and normalized.

A block is float32 ``(T, C, H, W)`` (latitude ascending); a variable fills its channels
``dest = block[t0:t1, c0:c0 + levels]``. ``ChunkReader`` reads chunk by chunk (see ``chunk_locator``):
uncompressed float32 steps go straight from the file into ``dest`` and are masked and normalized
there; anything else (packed integers, big-endian values, descending latitude, compressed chunks)
goes through one reused buffer of the stored type and is decoded into ``dest`` in one pass.
``XarrayReader`` reads through xarray (NetCDF3, and any layout ``chunk_locator`` does not handle).
Both raise ``DataFileError`` naming the file, the variable and the time steps when the data cannot
be read or decoded (a corrupt chunk).
"""

from __future__ import annotations

import zlib
from typing import Any

import numpy as np

from optbench.data.netcdf.chunk_locator import Chunks, read_exactly
from optbench.data.netcdf.decode import Affine, Decoding, decode_into
from optbench.data.netcdf.layout import VarSpec
from optbench.errors import ConfigError

READ_ERRORS = (OSError, RuntimeError, ValueError, KeyError, IndexError, TypeError, zlib.error)


class DataFileError(ConfigError):
    """A file's data cannot be read or decoded: one line naming the file, variable and time range.

    Raised in a DataLoader worker process, torch re-raises it in the training process as
    ``DataFileError("Caught DataFileError in DataLoader worker process 0.\\nOriginal Traceback
    ...")``; the constructor keeps only the original message, so the run still fails in one line."""

    def __init__(self, message: str) -> None:
        if message.startswith("Caught ") and "\nOriginal Traceback" in message:
            last = [line for line in message.splitlines() if line.strip()][-1]
            message = last.split(": ", 1)[1] if last.startswith(type(self).__name__ + ":") else last
        super().__init__(message)


class ChunkError(Exception):
    """A chunk could not be read or decoded: the file's steps ``[first, stop)`` it holds and why."""

    def __init__(self, first: int, stop: int, error: BaseException) -> None:
        super().__init__(str(error))
        self.first, self.stop, self.error = first, stop, error


def _level_groups(levels: list[int], level_chunk: int) -> list[tuple[int, slice, slice, np.ndarray | None]]:
    """Per level chunk holding selected levels: (chunk index, the level range read in the chunk,
    the destination channels, the picks within that range when they are not all of it)."""
    groups = []
    positions = np.asarray(levels)
    for cl in sorted({lv // level_chunk for lv in levels}):
        inside = np.flatnonzero(positions // level_chunk == cl)
        within = positions[inside] - cl * level_chunk
        span = slice(int(within[0]), int(within[-1]) + 1)
        picks = None if len(within) == span.stop - span.start else within - span.start
        groups.append((cl, span, slice(int(inside[0]), int(inside[-1]) + 1), picks))
    return groups


class ChunkReader:
    """One variable of one file read chunk by chunk (see the module docstring)."""

    def __init__(self, chunks: Chunks, *, decoding: Decoding, levels: list[int] | None, flip: bool) -> None:
        self.chunks, self.decoding, self.flip = chunks, decoding, flip
        self.groups = _level_groups(levels if levels is not None else [0], chunks.chunks[1])
        self.direct = not chunks.compressed and decoding.is_float32 and np.dtype(chunks.dtype) == decoding.dtype \
            and not flip
        self.path = ("straight into the block" if self.direct else "through one buffer") + f" ({chunks.label})"
        self._scratch = np.empty(0, dtype=chunks.dtype)
        self._bytes = bytearray()
        self._decoded: dict[int, tuple[tuple | None, np.ndarray]] = {}  # level chunk -> (coords, decoded chunk)

    def read(self, dest: np.ndarray, lo: int, hi: int, *, affine: Affine | None) -> None:
        """Steps ``[lo, hi)`` of the file into ``dest`` ``(hi - lo, levels, H, W)``."""
        tc = self.chunks.chunks[0]
        spans = range(lo // tc, (hi - 1) // tc + 1)
        if self.chunks.compressed:  # the disk reads the block's later chunks while this thread decodes
            for ct in spans[1:]:
                for cl, *_ in self.groups:
                    self.chunks.will_need((ct, cl, 0, 0))
        for ct in spans:
            a, b = max(lo, ct * tc), min(hi, ct * tc + tc)
            for cl, span, channels, picks in self.groups:
                out = dest[a - lo : b - lo, channels]
                part = None if affine is None else affine.channels(channels.start, channels.stop)
                try:
                    where = self.chunks.locate((ct, cl, 0, 0))
                    if self.chunks.compressed or where is None:
                        src = self._decoded_chunk((ct, cl, 0, 0))[a - ct * tc : b - ct * tc, span]
                    else:
                        src = self._raw_steps(out if self.direct and picks is None else None, where, a - ct * tc,
                                              b - ct * tc, span)
                except READ_ERRORS as exc:
                    raise ChunkError(ct * tc, min(ct * tc + tc, self.chunks.shape[0]), exc) from exc
                if picks is not None:
                    src = src[:, picks]
                decode_into(out, src[:, :, ::-1] if self.flip else src, decoding=self.decoding, affine=part)

    def _raw_steps(self, dest: np.ndarray | None, where: tuple, first: int, stop: int, span: slice) -> np.ndarray:
        """Steps ``[first, stop)`` of an uncompressed chunk, levels ``span``: read into ``dest``
        when given (returned), else into the reused buffer of the stored type."""
        source, offset, _, _ = where
        _, lc, h, w = self.chunks.chunks
        levels = span.stop - span.start
        if dest is None:
            need = (stop - first) * levels * h * w
            if self._scratch.size < need:
                self._scratch = np.empty(need, dtype=self.chunks.dtype)
            dest = self._scratch[:need].reshape(stop - first, levels, h, w)
        itemsize = np.dtype(self.chunks.dtype).itemsize
        start = offset + ((first * lc) + span.start) * h * w * itemsize
        buffers = [memoryview(dest[i]).cast("B") for i in range(stop - first)]
        if levels == lc:  # whole steps: one contiguous range of the file
            read_exactly(source, buffers, start)
        else:
            for i, buffer in enumerate(buffers):
                read_exactly(source, [buffer], start + i * lc * h * w * itemsize)
        return dest

    def _decoded_chunk(self, coords: tuple[int, int, int, int]) -> np.ndarray:
        """The whole chunk at ``coords``, decoded into the level chunk's reused buffer (kept: the
        next block often starts in the chunk this one ended in)."""
        cl = coords[1]
        held, chunk = self._decoded.get(cl, (None, None))
        if held == coords:
            return chunk
        if chunk is None:
            chunk = np.empty(self.chunks.chunks, dtype=self.chunks.dtype)
        self._decoded[cl] = (None, chunk)  # not valid until decoded (an error leaves it so)
        self._bytes = self.chunks.decode_chunk(coords, chunk, self._bytes)
        self._decoded[cl] = (coords, chunk)
        return chunk


class XarrayReader:
    """One variable of one file read with xarray's ``isel`` (xarray decodes it)."""

    def __init__(self, variable: Any, *, spec: VarSpec, dims: tuple[str, str, str], flip: bool, why: str) -> None:
        self.variable, self.spec, self.dims, self.flip = variable, spec, dims, flip
        self.path = f"through xarray ({why})"

    def read(self, dest: np.ndarray, lo: int, hi: int, *, affine: Affine | None) -> None:
        from optbench.data.netcdf.decode import PHYSICAL

        time_dim, lat_dim, lon_dim = self.dims
        spec = self.spec
        indexers: dict[str, Any] = {time_dim: slice(lo, hi)}
        order = [spec.dims.index(time_dim)]
        if spec.level_dim is not None:
            indexers[spec.level_dim] = _as_slice(spec.level_index or [])
            order.append(spec.dims.index(spec.level_dim))
        order += [spec.dims.index(lat_dim), spec.dims.index(lon_dim)]
        data = np.asarray(self.variable.isel(indexers).values).transpose(order)
        if spec.level_dim is None:
            data = data[:, None]
        decode_into(dest, data[:, :, ::-1] if self.flip else data, decoding=PHYSICAL, affine=affine)


def _as_slice(index: list[int]) -> slice | list[int]:
    """Consecutive indices as a slice: h5py and zarr read a slice as one hyperslab, a list as
    point-by-point fancy indexing (several times slower)."""
    if index and index == list(range(index[0], index[-1] + 1)):
        return slice(index[0], index[-1] + 1)
    return index
