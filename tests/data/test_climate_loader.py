"""The climate loader's read path (issue 26): every storage layout read chunk by chunk gives what
xarray gives, and really takes the direct path it says; reused buffers are never written while a
consumer holds them (in the process, through DataLoader workers' shared memory, behind the
prefetch thread); a corrupt chunk fails in one line naming the file, the variable and the time
steps (issue 28 item 7); ±inf is missing like NaN everywhere (issue 28 item 13)."""

from __future__ import annotations

import gc
import json
import multiprocessing
import os
import threading
import warnings
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
import xarray as xr
from torch.utils.data import DataLoader

from optbench.config import NetCDFDataConfig
from optbench.data.inspect import inspect_files
from optbench.data.netcdf import ClimateSource, build_climate_data, build_layout, decode
from optbench.data.netcdf.buffers import SLOTS_PER_WORKER, BufferPool
from optbench.data.netcdf.chunk_cost import variable_cost
from optbench.data.netcdf.chunk_locator import inflate
from optbench.data.netcdf.readers import DataFileError
from optbench.data.netcdf.synth import synthetic_dataset
from optbench.run.train import train
from optbench.tasks.climate import describe_training_data
from tests.helpers import compose_cfg


def _to_zarr(ds: xr.Dataset, path: Path, **kwargs) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # zarr's note on consolidated metadata in format 3
        ds.to_zarr(path, mode="w", **kwargs)


def _packed_descending(ds: xr.Dataset, path: Path) -> None:
    """ERA5-like: temperature packed in int16 with a fill value, NaN points, latitude descending,
    one level per chunk."""
    ds = ds.copy(deep=True)
    ds["temperature"][5, 1, 2, 3] = np.nan
    ds = ds.isel(lat=slice(None, None, -1))
    enc = {v: {"chunksizes": (4, 1, *ds[v].shape[2:]) if ds[v].ndim == 4 else (4, *ds[v].shape[1:])}
           for v in ds.data_vars}
    enc["temperature"].update(dtype="int16", scale_factor=0.01, add_offset=250.0, _FillValue=np.int16(-32767))
    ds.to_netcdf(path, engine="h5netcdf", encoding=enc)


@pytest.fixture(scope="module")
def layouts(tmp_path_factory) -> dict[str, tuple[Path, str]]:
    """One dataset (36 steps: the last chunk of 8 is partial) in every layout the loader reads,
    with the read path each must take."""
    root = tmp_path_factory.mktemp("layouts")
    ds = synthetic_dataset(days=9, nlat=8, nlon=16)

    def chunked(t: int, **extra) -> dict:
        return {v: {"chunksizes": (t, *ds[v].shape[1:]), **extra} for v in ds.data_vars}

    ds.to_netcdf(root / "raw.nc", engine="h5netcdf", encoding=chunked(8))
    ds.to_netcdf(root / "gzip.nc", engine="h5netcdf", encoding=chunked(8, zlib=True, complevel=1, shuffle=True))
    ds.to_netcdf(root / "contiguous.nc", engine="h5netcdf")
    ds.to_netcdf(root / "tiled.nc", engine="h5netcdf",
                 encoding={v: {"chunksizes": (8, *ds[v].shape[1:-2], 4, 8)} for v in ds.data_vars})
    _packed_descending(ds, root / "packed.nc")
    zchunks = {v: {"chunks": (8, *ds[v].shape[1:])} for v in ds.data_vars}
    _to_zarr(ds, root / "v2raw.zarr", zarr_format=2, encoding={v: {**e, "compressors": None} for v, e in zchunks.items()})
    _to_zarr(ds, root / "v2blosc.zarr", zarr_format=2, encoding=zchunks)
    _to_zarr(ds, root / "v3raw.zarr", encoding={v: {**e, "compressors": None} for v, e in zchunks.items()})
    _to_zarr(ds, root / "v3zstd.zarr", encoding=zchunks)
    return {
        "raw": (root / "raw.nc", "straight into the block (HDF5 chunks, uncompressed)"),
        "gzip": (root / "gzip.nc", "through one buffer (HDF5 chunks (shuffle+deflate))"),
        "contiguous": (root / "contiguous.nc", "straight into the block (HDF5 contiguous, uncompressed)"),
        "tiled": (root / "tiled.nc", "through xarray (chunks of 8x4x4x8 tile the lat/lon grid)"),
        "packed": (root / "packed.nc", "through one buffer (HDF5 chunks, uncompressed)"),
        "v2raw": (root / "v2raw.zarr", "straight into the block (Zarr v2 chunks, uncompressed)"),
        "v2blosc": (root / "v2blosc.zarr", "through one buffer (Zarr v2 chunks (blosc))"),
        "v3raw": (root / "v3raw.zarr", "straight into the block (Zarr v3 chunks, uncompressed)"),
        "v3zstd": (root / "v3zstd.zarr", "through one buffer (Zarr v3 chunks (zstd))"),
    }


def _cfg(path, tmp_path: Path, **kw) -> NetCDFDataConfig:
    return NetCDFDataConfig(paths=[str(path)], stats_cache=str(tmp_path / "stats"), **kw)


@pytest.mark.parametrize("levels, piece", [(None, decode.PIECE_BYTES), ([850, 250], 1)])
def test_every_layout_reads_what_xarray_reads_on_its_direct_path(layouts, tmp_path, levels, piece, monkeypatch):
    monkeypatch.setattr(decode, "PIECE_BYTES", piece)  # 1: every step decoded as a piece of its own
    for name, (path, expected_path) in layouts.items():
        layout = build_layout(_cfg(path, tmp_path, levels=levels))
        source = ClimateSource(layout, regrid=False)
        paths = source.read_paths()
        if name == "tiled":  # the surface variable's chunks are 8x1x4x8 as (time, level, lat, lon)
            assert all(p.startswith("through xarray (chunks of 8x") for p in paths.values()), paths
        assert set(paths.values()) == {expected_path} or name in ("packed", "tiled"), (name, paths)
        if name == "packed":  # only temperature is packed; the rest is float32 but latitude is flipped
            assert paths["temperature"] == expected_path and paths["pressure"].startswith("through one buffer")
        reference = ClimateSource(layout, regrid=False, reader="xarray").read(3, 36)
        assert ClimateSource(layout, regrid=False, reader="xarray").read_paths()["pressure"].startswith("through xarray")
        block = source.read(3, 36)  # crosses chunk boundaries and ends in the partial last chunk
        assert np.array_equal(np.isnan(block), np.isnan(reference)), name
        if name == "packed":  # decoded in float32 by optbench, in float64 by xarray: 0.01 K packing
            np.testing.assert_allclose(block, reference, rtol=1e-6, atol=1e-4, equal_nan=True)
        else:
            np.testing.assert_array_equal(block, reference, err_msg=name)
        source.close()


def test_a_chunk_never_written_reads_as_missing(layouts, tmp_path):
    path = tmp_path / "holes.zarr"
    ds = synthetic_dataset(days=9, nlat=8, nlon=16)
    _to_zarr(ds, path, zarr_format=2, encoding={v: {"chunks": (8, *ds[v].shape[1:]), "compressors": None}
                                                for v in ds.data_vars})
    (path / "temperature" / "1.0.0.0").unlink()  # steps 8..15 of temperature were never written
    layout = build_layout(_cfg(path, tmp_path))
    block = ClimateSource(layout, regrid=False).read(0, 36)
    assert np.isnan(block[8:16, :4]).all() and np.isfinite(block[:8]).all() and np.isfinite(block[16:]).all()
    np.testing.assert_array_equal(block, ClimateSource(layout, regrid=False, reader="xarray").read(0, 36))



@pytest.mark.parametrize("name", ["gzip", "v3zstd"])
def test_a_compressed_read_asks_the_disk_for_the_later_chunks_before_decoding_the_first(layouts, tmp_path,
                                                                                        monkeypatch, name):
    """Steps 3..36 span chunks 0-4 of every variable: before a variable's chunk 0 is decoded the
    kernel has been asked (posix_fadvise WILLNEED, over each chunk's stored byte range) for chunks
    1-4, so it reads them while this thread decodes; the block read is what xarray reads."""
    from optbench.data.netcdf import chunk_locator as chunks_module

    layout = build_layout(_cfg(layouts[name][0], tmp_path))
    source = ClimateSource(layout, regrid=False)
    events: list = []
    advised: list = []
    will_need, decode = chunks_module.Chunks.will_need, chunks_module.Chunks.decode_chunk
    monkeypatch.setattr(os, "posix_fadvise", lambda fd, offset, size, advice: advised.append((offset, size, advice)))

    def hint(self, coords):
        events.append(("hint", id(self), coords))
        before = len(advised)
        will_need(self, coords)
        assert advised[before:] == [(*self.locate(coords)[1:3], os.POSIX_FADV_WILLNEED)]

    def decoded(self, coords, out, scratch):
        events.append(("decode", id(self), coords))
        return decode(self, coords, out, scratch)

    monkeypatch.setattr(chunks_module.Chunks, "will_need", hint)
    monkeypatch.setattr(chunks_module.Chunks, "decode_chunk", decoded)
    block = source.read(3, 36)
    variables = {owner for _, owner, _ in events}
    assert len(variables) == len(source.read_paths())  # every variable, each with its own chunks
    for owner in variables:
        mine = [(kind, coords[0]) for kind, who, coords in events if who == owner]
        assert mine == [("hint", 1), ("hint", 2), ("hint", 3), ("hint", 4),
                        ("decode", 0), ("decode", 1), ("decode", 2), ("decode", 3), ("decode", 4)], mine
    np.testing.assert_array_equal(block, ClimateSource(layout, regrid=False, reader="xarray").read(3, 36))
    source.close()


# ------------------------------------------------------------------------------------------ buffers
def test_buffer_pool_hands_out_memory_again_only_when_nothing_references_it():
    pool = BufferPool(limit=2)
    first = pool.take((4, 5))
    address = first.ctypes.data
    tensor = torch.from_numpy(first[1:])  # a view of a view, held by a tensor
    del first
    second = pool.take((4, 5))
    assert second.ctypes.data != address  # the tensor still holds the first buffer
    del tensor, second
    assert pool.take((4, 5)).ctypes.data == address  # free again: reused


def test_buffer_pool_keeps_its_memory_for_the_largest_request():
    pool = BufferPool(limit=2)
    small = [pool.take((2, 5)), pool.take((3, 5))]  # the pool is full of small buffers
    del small
    big = pool.take((8, 5))  # replaces a free smaller buffer instead of going unpooled
    assert any(np.shares_memory(big, kept) for kept in pool._buffers)
    address = big.ctypes.data
    del big
    assert pool.take((8, 5)).ctypes.data == address
    reserved = BufferPool(limit=1)
    first = reserved.take((2, 5), reserve=8 * 5 * 4)
    address = first.ctypes.data
    del first
    assert reserved.take((8, 5)).ctypes.data == address  # the reserve made room for the larger request


def test_a_worker_reads_every_block_into_the_pools_memory(layouts, tmp_path):
    """Worker shares cut blocks, so a worker's reads come in several sizes; every read must land
    in the pool's memory, and the pool allocates no more buffers than it keeps (fresh memory is
    zeroed by the kernel page by page: on this project's VM 14-18% of a zlib loader's CPU)."""
    _, stream = _stream(layouts["raw"][0], tmp_path, read_ahead=0)  # no thread: the same reads every time
    pool, allocations, outside = stream._blocks, [], []
    take = pool.take

    def counted(*args, **kwargs):
        known = [id(b) for b in pool._buffers]
        out = take(*args, **kwargs)
        allocations.extend(id(b) for b in pool._buffers if id(b) not in known)
        outside.append(not any(np.shares_memory(out, b) for b in pool._buffers))
        return out

    pool.take = counted
    sizes = set()
    read_block = stream.read_block
    stream.read_block = lambda block, lo=0, hi=None: sizes.add(hi) or read_block(block, lo, hi)
    batches = stream.batches(0, 2)
    for _ in range(8 * stream.per_worker(2) // stream.batch_size):  # eight epochs
        next(batches)
    assert len(outside) > 4 * pool.limit and len(sizes) > 1  # many reads, of blocks cut and whole
    assert not any(outside), outside
    assert len(allocations) <= pool.limit, allocations


def _stream(path: Path, tmp_path: Path, **kw):
    data = build_climate_data(_cfg(path, tmp_path, block_size=8, **kw))
    return data, data.train.shard(rank=0, world_size=1, seed=1, start=0, batch_size=4)


def test_held_batches_keep_their_values_and_released_memory_is_reused(layouts, tmp_path):
    _, stream = _stream(layouts["raw"][0], tmp_path)
    batches = stream.batches(0, 1)
    held = [next(batches) for _ in range(6)]  # more batches than the pool keeps
    copies = [b["frames"].clone() for b in held]
    assert len({b["frames"].data_ptr() for b in held}) == 6
    for _ in range(4):
        next(batches)
    for batch, copy in zip(held, copies, strict=True):
        assert torch.equal(batch["frames"], copy)  # never overwritten while held
    addresses = {b["frames"].data_ptr() for b in held}
    del held, batch, copies, copy
    gc.collect()
    assert {next(batches)["frames"].data_ptr() for _ in range(4)} & addresses  # released memory reused


def test_worker_batches_come_in_reused_shared_slots_and_are_never_overwritten_while_held(layouts, tmp_path):
    data, stream = _stream(layouts["raw"][0], tmp_path)
    reference = [b["frames"].clone() for b, _ in zip(stream.batches(0, 1), range(16), strict=False)]
    watcher = stream._shared._watcher
    slots: list[int] = []
    received = watcher.received
    watcher.received = lambda slot, frames: (slots.append(slot), received(slot, frames))[1]
    loader = iter(DataLoader(stream, batch_size=None, num_workers=1))
    for i in range(8):  # dropped at once: the worker cycles through a few slots
        assert torch.equal(next(loader)["frames"], reference[i])
    assert len(slots) == 8 and len(set(slots)) < 8
    held = [next(loader) for _ in range(8)]  # all held: no slot may be written again
    for batch, expected in zip(held, reference[8:], strict=True):
        assert torch.equal(batch["frames"], expected)
    assert len(slots) <= 16 and len(set(slots)) <= SLOTS_PER_WORKER


def test_prefetch_thread_gives_the_same_batches_raises_the_error_and_stops(layouts, tmp_path, monkeypatch):
    _, stream = _stream(layouts["raw"][0], tmp_path, prefetch=3)
    expected = [b["sample"].tolist() for b, _ in zip(stream.batches(0, 1), range(20), strict=False)]
    def ours() -> list[str]:
        return sorted(t.name for t in threading.enumerate() if t.name.startswith("optbench-"))

    before = ours()
    it = iter(DataLoader(stream, batch_size=None))  # no workers: the prefetch thread runs the stream
    assert [next(it)["sample"].tolist() for _ in range(20)] == expected
    assert ours() == sorted([*before, "optbench-prefetch", "optbench-read-ahead"])
    del it
    gc.collect()
    assert ours() == before

    def corrupt(self, block, *span):
        raise DataFileError(f"block {block} is corrupt")

    monkeypatch.setattr(type(stream), "read_block", corrupt)
    with pytest.raises(DataFileError, match="is corrupt"):
        next(iter(DataLoader(stream, batch_size=None)))


# ------------------------------------------------------------------------------- corrupt chunks
def _corrupt_hdf5_chunk(path: Path, name: str, step: int) -> None:
    import h5py

    with h5py.File(path, "r") as f:
        dset = f[name]
        info = dset.id.get_chunk_info_by_coord((step - step % dset.chunks[0],) + (0,) * (dset.ndim - 1))
        offset, size = info.byte_offset, info.size
    with open(path, "r+b") as f:
        f.seek(offset + size // 4)
        f.write(np.random.default_rng(0).bytes(size // 2))


@pytest.mark.parametrize("num_workers", [0, 1])
def test_a_corrupt_zlib_chunk_fails_training_in_one_line_naming_file_variable_and_steps(layouts, tmp_path,
                                                                                          num_workers):
    """Read by the prefetch thread (num_workers=0) or a DataLoader worker (1): the statistics and
    the climatology come from caches made before the chunk was damaged (same size and mtime), so
    the training stream is the first to read it. The failed run's worker is stopped as the run ends,
    not left to a later garbage collection (which waited 5 s for it, inside another test)."""
    path = tmp_path / "broken.nc"
    path.write_bytes(layouts["gzip"][0].read_bytes())
    overrides = ["task=climate", "data=netcdf", f"data.paths=[{path}]", f"data.stats_cache={tmp_path / 's'}",
                 "train.steps=2", "measure.warmup_steps=1", "train.device=cpu", "model=tiny", "train.batch_size=2",
                 f"dataloader.num_workers={num_workers}", "data.block_size=8", "estimate.predict=false"]
    assert train(compose_cfg(overrides), run_dir=tmp_path / "intact").status == "completed"
    stat = path.stat()
    _corrupt_hdf5_chunk(path, "humidity", 16)
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    before = set(multiprocessing.active_children())  # another test's worker that the collector has not freed
    result = train(compose_cfg([*overrides, "train.steps=12"]), run_dir=tmp_path / "run")
    assert result.status == "failed" and result.exit_code == 2, result.error
    assert "\n" not in result.error and str(path) in result.error and "variable 'humidity'" in result.error
    assert "time steps 16..23 (2000-01-05 00:00:00 .. 2000-01-06 18:00:00)" in result.error  # the chunk's steps
    assert "zlib.error" in result.error and "Traceback" not in result.error
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["status"] == "failed"
    assert set(multiprocessing.active_children()) <= before


def test_inflate_decodes_what_zlib_decodes_and_rejects_what_zlib_rejects():
    """The loader's ``inflate`` (libdeflate, zlib for what it refuses) against ``zlib.decompress``:
    the same bytes from every level, the same error for every broken stream, the checksum
    included (a flipped byte in stored data inflates fine and only the Adler-32 catches it)."""
    rng = np.random.default_rng(0)
    data = rng.normal(size=40_000).astype(np.float32).tobytes() + bytes(20_000)
    for level in (0, 1, 6, 9):
        assert inflate(zlib.compress(data, level), len(data)) == data
    stored = zlib.compress(data, 0)
    packer = zlib.compressobj(zdict=b"a preset dictionary")
    broken = {
        "a flipped byte in stored data": stored[:1000] + bytes([stored[1000] ^ 1]) + stored[1001:],
        "a flipped checksum byte": stored[:-1] + bytes([stored[-1] ^ 1]),
        "truncated": zlib.compress(data, 6)[:-100],
        "a broken header": b"\x78\x9d" + zlib.compress(data, 6)[2:],
        "a preset dictionary": packer.compress(data) + packer.flush(),
        "too short": b"\x78\x9c\x03",
    }
    for case, stream in broken.items():
        with pytest.raises(zlib.error) as expected:
            zlib.decompress(stream)
        with pytest.raises(zlib.error) as got:
            inflate(stream, len(data))
        assert str(got.value) == str(expected.value), case


def test_a_zarr_chunk_of_random_bytes_makes_inspect_say_no_in_one_line(layouts, tmp_path):
    store = tmp_path / "broken.zarr"
    _to_zarr(synthetic_dataset(days=9, nlat=8, nlon=16), store, zarr_format=2,
             encoding={v: {"chunks": (8, 4, 8, 16)} for v in ("temperature", "humidity")})
    (store / "temperature" / "1.0.0.0").write_bytes(np.random.default_rng(1).bytes(3000))
    usable, report = inspect_files([str(store)], check=describe_training_data, variables=["temperature"])
    line = report.splitlines()[-1]
    assert not usable and str(store) in line and "variable 'temperature', time steps" in line
    assert "corrupt" in line


# ------------------------------------------------------------------------------------- infinity
def test_infinity_is_missing_like_nan_in_statistics_samples_and_training(tmp_path, monkeypatch):
    ds = synthetic_dataset(days=9, nlat=8, nlon=16)
    ds["temperature"][4, 0, 3, 5] = np.inf
    ds["pressure"][10, 2, 2] = -np.inf
    path = tmp_path / "inf.nc"
    ds.to_netcdf(path, engine="h5netcdf", encoding={v: {"chunksizes": (8, *ds[v].shape[1:])} for v in ds.data_vars})
    data = build_climate_data(_cfg(path, tmp_path, block_size=8))
    raw = ClimateSource(data.layout, regrid=False).read(0, 36)
    assert np.isnan(raw[4, 0, 3, 5]) and np.isnan(raw[10, 4, 2, 2]) and not np.isinf(raw).any()
    monkeypatch.setattr(decode, "PIECE_BYTES", 1)  # checked step by step: the same values
    np.testing.assert_array_equal(ClimateSource(data.layout, regrid=False).read(0, 36), raw)
    monkeypatch.undo()
    assert data.stats.count[0] == np.isfinite(ds["temperature"].values[: data.train_steps, 0]).sum()
    assert np.isfinite(data.stats.mean).all() and np.isfinite(data.stats.std).all()
    frames = torch.cat([b["frames"] for b, _ in zip(data.train.shard(rank=0, world_size=1, seed=0, start=0,
                                                                      batch_size=4).batches(0, 1), range(8),
                                                    strict=False)])
    assert not frames.isinf().any() and frames.isnan().any()
    cfg = compose_cfg(["task=climate", "data=netcdf", f"data.paths=[{path}]", f"data.stats_cache={tmp_path / 's'}",
                       "train.steps=3", "measure.warmup_steps=1", "train.device=cpu", "model=tiny", "train.batch_size=4",
                       "data.block_size=8", "estimate.predict=false",
                       "data.augment.enabled=false"])
    result = train(cfg, run_dir=tmp_path / "run")
    assert result.status == "completed", result.error
    assert np.isfinite(json.loads((tmp_path / "run" / "summary.json").read_text())["loss"]["final"])


# ------------------------------------------------------------------------------------- inspect
def test_inspect_says_what_the_chunking_costs_and_how_to_rechunk(layouts, tmp_path):
    ds = synthetic_dataset(days=16, nlat=8, nlon=16)  # 64 steps
    path = tmp_path / "long.nc"
    ds.to_netcdf(path, engine="h5netcdf", encoding={
        v: {"chunksizes": (64, *ds[v].shape[1:-2], 4, 8), "zlib": True, "complevel": 1} for v in ds.data_vars})
    usable, report = inspect_files([str(path)], check=describe_training_data)
    assert usable, report
    reading = report[report.index("\nreading (blocks of 56 samples = 58 steps)") :]
    line = next(line for line in reading.splitlines() if line.strip().startswith("temperature "))
    assert "chunks 64x4x4x8, zlib: 4 chunks per step tile the lat/lon grid" in line and "through xarray" in line
    assert line.endswith("<- costly")
    assert f"nccopy -c time/8,level/4,lat/8,lon/16 {path} {tmp_path / 'long_rechunked.nc'}" in reading
    # compressed chunks longer than a block (a block capped by data.block_mb): decoded again per block
    layout = build_layout(_cfg(path, tmp_path))
    with xr.open_dataset(path, engine="h5netcdf") as opened:
        text, costly = variable_cost(opened["temperature"], layout.variables[0], layout, block=32, extra=2)
    assert "a block decodes 64 steps for the 34 it needs (1.88x)" in text and costly
    usable, report = inspect_files([str(layouts["raw"][0])], check=describe_training_data)
    assert "read straight into the block (HDF5 chunks, uncompressed)" in report
    assert "costly" not in report and "nccopy" not in report
    usable, report = inspect_files([str(layouts["v3zstd"][0])], check=describe_training_data)
    assert "chunks 8x4x8x16, zstd; a block decodes 32 steps for the 31 it needs (1.03x)" in report
    assert "costly" not in report


def test_the_gpu_data_check_runs_at_a_tiny_size_on_the_cpu(tmp_path):
    """``bash bench/gpu_check.sh data`` is prepared here so a lent GPU's minutes are not spent on it."""
    import subprocess
    import sys

    from tests.helpers import ROOT

    done = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_data.py"), "--tiny", "--out", str(tmp_path),
                           "--settings", "default (no workers, prefetch 2)"], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-2000:]
    table = (tmp_path / "data.md").read_text()
    row = next(line for line in table.splitlines() if line.startswith("| tiny default"))
    cells = [c.strip() for c in row.split("|")]
    assert cells[2].endswith("%") and float(cells[3].replace(",", "")) > 0, row
    assert "workers 0" in row


# ------------------------------------------------------------------------------------- threads
def test_two_threads_reading_one_source_get_what_each_reads_alone(layouts, tmp_path, monkeypatch):
    """Training reads blocks in its read-ahead thread while the evaluation reads windows in the
    main thread, through the same source. Both threads here hold their chunk's compressed bytes
    at once (a barrier after the read) before either decodes: each must still decode its own."""
    from optbench.data.netcdf import chunk_locator as chunks_module

    layout = build_layout(_cfg(layouts["gzip"][0], tmp_path))
    ranges = [(0, 8), (16, 24)]  # one whole chunk each, different chunks
    alone = [ClimateSource(layout, regrid=False).read(*r) for r in ranges]
    barrier = threading.Barrier(2, timeout=1.0)
    read = chunks_module.read_exactly

    def read_then_wait(*args, **kwargs):
        read(*args, **kwargs)
        try:
            barrier.wait()
        except threading.BrokenBarrierError:  # the other thread cannot come (reads are serialized)
            pass

    source = ClimateSource(layout, regrid=False)
    source.read(0, 36)  # its buffers exist: what a reader has after its first block
    monkeypatch.setattr(chunks_module, "read_exactly", read_then_wait)
    got: dict[int, object] = {}

    def reader(i: int) -> None:
        try:
            got[i] = source.read(*ranges[i])
        except Exception as exc:  # noqa: BLE001 - reported below
            got[i] = exc

    threads = [threading.Thread(target=reader, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i, expected in enumerate(alone):
        assert isinstance(got[i], np.ndarray), got[i]
        np.testing.assert_array_equal(got[i], expected)
