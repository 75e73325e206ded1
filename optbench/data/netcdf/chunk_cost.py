"""What a file's chunking costs the loader, and the command that rechunks it (``data inspect``).

The loader reads a block of ``block`` samples as ``block + extra`` consecutive steps. Chunks that
each hold whole lat/lon grids are read chunk by chunk (``source``); two layouts cost more:

- chunks that **tile the grid** (e.g. 1 x 1 x 10 x 10) are many per step and go through xarray;
- **compressed chunks longer than a block** (e.g. 744 steps x grid): every block decodes whole
  chunks, so an epoch decodes ``decoded / needed`` times the data (uncompressed chunks are read
  step by step, so their length costs nothing).

``reading_report`` gives one line per variable and, when a layout is costly, the ``nccopy``
command (NetCDF) or the xarray call (Zarr) that writes a copy with full-grid chunks of a few steps.
"""

from __future__ import annotations

import math
from typing import Any

from optbench.data.netcdf.files import ZARR, detect_format
from optbench.data.netcdf.layout import Layout, VarSpec

CODECS = ("zlib", "szip", "zstd", "blosc", "bzip2")
TARGET_CHUNK_BYTES = 32 << 20  # a rechunked chunk: up to 8 steps, at most ~32 MB


def stored_chunks(variable: Any) -> tuple[int, ...] | None:
    """The variable's chunk shape in its stored dimension order (None: contiguous)."""
    enc = variable.encoding
    sizes = enc.get("chunksizes") or enc.get("chunks")
    return tuple(int(s) for s in sizes) if sizes else None


def codec_of(variable: Any) -> str | None:
    """The compression of a NetCDF4 or Zarr variable, None when it is stored uncompressed."""
    enc = variable.encoding
    for codec in CODECS:
        if enc.get(codec):
            return codec
    compressors = enc.get("compressors") or ()
    if compressors:
        return ", ".join(type(c).__name__.replace("Codec", "").lower() for c in compressors)
    return None


def variable_cost(variable: Any, spec: VarSpec, layout: Layout, *, block: int, extra: int) -> tuple[str, bool]:
    """(description of what reading ``spec`` costs, whether a rechunk would help)."""
    shape = tuple(int(n) for n in variable.shape)
    chunks = stored_chunks(variable) or shape
    codec = codec_of(variable)
    axis = {d: i for i, d in enumerate(spec.dims)}
    tc = chunks[axis[layout.time_dim]]
    spatial = [d for d in spec.dims if d != layout.time_dim]
    per_step = math.prod(-(-shape[axis[d]] // chunks[axis[d]]) for d in spatial)
    tiles = any(chunks[axis[d]] < shape[axis[d]] for d in (layout.lat_dim, layout.lon_dim))
    storage = "contiguous" if stored_chunks(variable) is None else "chunks " + "x".join(map(str, chunks))
    text = f"{storage}, {codec or 'uncompressed'}"
    costly = False
    if tiles:
        text += f": {per_step:,} chunks per step tile the lat/lon grid"
        costly = True
    if codec is not None:
        needed = block + extra
        decoded = min(max(tc, -(-needed // tc) * tc), shape[axis[layout.time_dim]])
        ratio = decoded / needed
        text += f"; a block decodes {decoded} steps for the {needed} it needs ({ratio:.2f}x)"
        costly = costly or ratio > 1.5
    return text, costly


def rechunk_command(layout: Layout, variables: dict[str, Any], path: Any) -> str:
    """A command that writes ``path`` again with full-grid chunks of a few steps."""
    step_bytes = max(4 * math.prod(int(n) for d, n in zip(v.dims, v.shape, strict=True) if d != layout.time_dim)
                     for v in variables.values())
    steps = max(1, min(8, TARGET_CHUNK_BYTES // max(1, step_bytes)))
    sizes: dict[str, int] = {layout.time_dim: steps}
    for var in variables.values():
        for dim, n in zip(var.dims, var.shape, strict=True):
            sizes.setdefault(str(dim), int(n))
    if detect_format(path) is ZARR:
        chunks = ", ".join(f"'{d}': {n}" for d, n in sizes.items())
        return (f"python -c \"import xarray as xr; ds = xr.open_zarr('{path}', chunks={{{chunks}}}); "
                "[v.encoding.pop(k, None) for v in ds.variables.values() for k in ('chunks', 'preferred_chunks')]; "
                f"ds.to_zarr('{path.with_name(path.stem + '_rechunked.zarr')}')\"  (needs dask)")
    spec = ",".join(f"{d}/{n}" for d, n in sizes.items())
    return f"nccopy -c {spec} {path} {path.with_name(path.stem + '_rechunked' + path.suffix)}"


def reading_report(ds: Any, layout: Layout, *, paths: dict[str, str], block: int, extra: int) -> list[str]:
    """Lines for ``data inspect``: per variable how it is read and what its chunking costs (from
    the first file ``ds``), then the rechunk command when that would pay."""
    lines = [f"reading (blocks of {block} samples = {block + extra} steps)"]
    width = max(len(spec.name) for spec in layout.variables)
    costly = False
    for spec in layout.variables:
        text, bad = variable_cost(ds[spec.name], spec, layout, block=block, extra=extra)
        costly = costly or bad
        lines.append(f"  {spec.name:<{width}}  {text}; read {paths[spec.name]}{' <- costly' if bad else ''}")
    if costly:
        variables = {spec.name: ds[spec.name] for spec in layout.variables}
        lines.append("  rechunk to full-grid chunks of a few steps: "
                     + rechunk_command(layout, variables, layout.files[0].path))
    return lines
