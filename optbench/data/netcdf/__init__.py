"""Climate fields from NetCDF4/HDF5, NetCDF3 and Zarr, described by xarray and read chunk by chunk.

``build_layout(cfg.data)`` opens every file (metadata only), finds the time, latitude, longitude
and level dimensions whatever they are called, resolves ``data.variables`` (names or roles) and
checks that the files agree; every problem is a ``ConfigError`` naming the file and the fix.
``ClimateSource`` reads a range of time steps as one float32 array ``(time, channel, lat, lon)``
— channels are (variable x level), latitude ascending, NaN where the file has ``_FillValue``/NaN/
±inf, optionally regridded — into a caller's block, decoded and normalized in one pass, chunk by
chunk where the storage allows (uncompressed chunks straight into the block), through xarray
elsewhere; a chunk that cannot be read is a ``DataFileError`` naming file, variable and steps.

``ClimateStream`` is the training split as an endless ``IterableDataset`` of batches: each epoch
permutes blocks of ``block_size`` consecutive samples (aligned with the file's time chunks) and
shuffles samples within each block; rank ``r`` of ``w`` takes the ``r``-th contiguous share of
that order and DataLoader worker ``i`` of ``W`` the ``i``-th share of the rank's, so every sample is
seen once per epoch (the tail that does not divide is dropped; a different one every epoch) and a
block is read by one worker, or, where a share boundary cuts it, split in time: each side reads
only its part. ``shard(rank=, world_size=, seed=, start=, batch_size=)``
sets that up; ``start`` is the number of samples this rank already consumed, so a resumed run
continues exactly where it stopped (with the same world size, num_workers and batch size).
``ClimateWindows`` is the eval split as a map-style dataset that reads a batch in one block.

Modules: ``files`` (finding and opening), ``cf`` (CF detection of dimensions and roles),
``layout`` (what the files hold, checked), ``chunk_locator`` (where a variable's chunks are, h5py/zarr),
``decode`` (CF decoding fused with the normalization), ``readers`` (one variable into a block),
``source`` (reading blocks), ``buffers`` (reused block and batch memory), ``prefetch`` (threads),
``chunk_cost`` (what a layout costs, for ``data inspect``), ``stats`` (normalization statistics and
their cache), ``dataset`` (splits, the stream, the windows, ``build_climate_data``). Everything
other modules use is re-exported here. docs/climate-loader.md describes the loader.
"""

from __future__ import annotations

from optbench.config.roles import ROLE_NAMES, ROLE_STANDARD_NAMES
from optbench.data.netcdf.cf import (
    HUMIDITY_BOUNDS,
    LAT_NAMES,
    LON_NAMES,
    TIME_NAMES,
    find_lat_dim,
    find_lon_dim,
    find_time_dim,
    humidity_bounds,
    role_of,
)
from optbench.data.netcdf.dataset import (
    ClimateData,
    ClimateStream,
    ClimateWindows,
    Split,
    auto_block_size,
    build_climate_data,
    split_steps,
)
from optbench.data.netcdf.files import (
    HDF5_SIGNATURE,
    NETCDF3_SIGNATURES,
    check_signature,
    open_dataset,
    resolve_paths,
)
from optbench.data.netcdf.layout import (
    Channel,
    FileSpan,
    Layout,
    VarSpec,
    build_layout,
    regrid_axes,
)
from optbench.data.netcdf.readers import DataFileError
from optbench.data.netcdf.source import (
    ClimateSource,
)
from optbench.data.netcdf.stats import (
    Stats,
    compute_stats,
    load_or_compute_stats,
    stats_key,
)

__all__ = [
    "Channel",
    "ClimateData",
    "ClimateSource",
    "ClimateStream",
    "ClimateWindows",
    "DataFileError",
    "FileSpan",
    "HDF5_SIGNATURE",
    "HUMIDITY_BOUNDS",
    "LAT_NAMES",
    "LON_NAMES",
    "Layout",
    "NETCDF3_SIGNATURES",
    "ROLE_NAMES",
    "ROLE_STANDARD_NAMES",
    "Split",
    "Stats",
    "TIME_NAMES",
    "VarSpec",
    "auto_block_size",
    "build_climate_data",
    "build_layout",
    "check_signature",
    "compute_stats",
    "find_lat_dim",
    "find_lon_dim",
    "find_time_dim",
    "humidity_bounds",
    "load_or_compute_stats",
    "open_dataset",
    "regrid_axes",
    "resolve_paths",
    "role_of",
    "split_steps",
    "stats_key",
]
