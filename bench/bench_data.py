"""``make bench-data``: the NetCDF loader against a naive one, against the disk, and the data wait.

1. Loader vs a naive loader. One synthetic CF file (``optbench data synth``: gzip, chunked along
   time) is read two ways, alternately in one process (ABAB..., the first round discarded: it warms
   the page cache), each as a ``DataLoader`` with the same batch size and no worker processes, and
   each timed over **one whole epoch** from the creation of its iterator to its last batch (a
   window that starts after a warm-up batch would favour the block reader, whose first read
   brings a whole block):
   - naive: a map-style dataset whose ``__getitem__`` does ``ds[var].isel(time=slice(i, i+h+1)).values``
     for every variable, shuffled by a RandomSampler, collated by the default collate;
   - optbench: ``ClimateStream`` (chunk-aligned block reads, windows gathered from memory, whole
     batches yielded).
   Both produce the same normalized float32 windows; samples/s are reported with their spread,
   and the ratio.
2. Against the disk. A file of ``--big-gb`` GB written by ``write_synthetic`` (what ``optbench data
   synth --no-compress`` writes) and a Zarr copy of it (same chunks, no compression). Per round,
   for each: the page cache is dropped for the file (``posix_fadvise DONTNEED``), the file is read
   sequentially in 16 MiB reads (the physical limit: raw MB/s), then, each after dropping the cache
   again, one training epoch through optbench's loader with ``dataloader.num_workers`` 0 and 1.
   Reported: the loader's decoded MB/s (float32 fields decoded per second), its share of the raw
   read speed (aim: >= 50% with a worker), and the time to process 1.88 GB (the plan's figure: 9.7 s,
   aim < 1 s).
3. Data wait. ``optbench train task=climate data=netcdf model=small`` on the first file: the
   fraction of the timed step time spent waiting for the next batch (``data_wait_frac`` in
   summary.json; aim: <= 2%), with ``dataloader.num_workers`` 0 and 1.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from optbench.config import NetCDFDataConfig  # noqa: E402
from optbench.data.netcdf import ClimateData, build_climate_data, open_dataset  # noqa: E402
from optbench.data.netcdf.synth import write_synthetic  # noqa: E402

PLAN_BYTES = 1.88e9  # the plan's NetCDF batch: 9.7 s to process, aim < 1 s


class NaiveWindows(Dataset):
    """One ``isel(...).values`` per variable per sample: what a first climate loader does."""

    def __init__(self, path: Path, *, variables: list[str], history: int, num_samples: int,
                 mean: np.ndarray, std: np.ndarray) -> None:
        self.path, self.variables, self.history, self.num_samples = path, variables, history, num_samples
        self.mean = mean.astype(np.float32)[:, None, None]
        self.std = std.astype(np.float32)[:, None, None]
        self.ds = None

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if self.ds is None:
            self.ds = open_dataset(self.path)
        parts = []
        for name in self.variables:
            values = self.ds[name].isel(time=slice(index, index + self.history + 1)).values
            parts.append(values[:, None] if values.ndim == 3 else values)
        frames = (np.concatenate(parts, axis=1).astype(np.float32) - self.mean) / self.std
        return {"frames": torch.from_numpy(frames)}


def epoch_batches(loader: DataLoader, *, batches: int) -> tuple[float, int]:
    """Seconds and samples from creating the iterator (worker start-up included) to batch ``batches``."""
    start = time.perf_counter()
    samples = 0
    for index, batch in enumerate(loader):
        samples += batch["frames"].shape[0]
        if index + 1 == batches:
            break
    return time.perf_counter() - start, samples


def spread(values: list[float], unit: str, spec: str = ".1f") -> str:
    return f"{statistics.median(values):{spec}} {unit} [{min(values):{spec}} - {max(values):{spec}}]"


def loader_vs_naive(path: Path, *, batch_size: int, rounds: int, cache: Path) -> None:
    cfg = NetCDFDataConfig(paths=[str(path)], stats_cache=str(cache), history=2)
    data = build_climate_data(cfg)
    naive = NaiveWindows(path, variables=cfg.variables, history=cfg.history, num_samples=data.train.split.num_samples,
                         mean=data.stats.mean, std=data.stats.std)
    epoch = data.train.split.num_samples // batch_size  # batches of one epoch, for both
    loaders = {
        "naive isel": lambda r: DataLoader(naive, batch_size=batch_size, shuffle=True, drop_last=True,
                                           generator=torch.Generator().manual_seed(r)),
        "optbench": lambda r: DataLoader(data.train.shard(rank=0, world_size=1, seed=r, start=0,
                                                          batch_size=batch_size), batch_size=None),
    }
    rates: dict[str, list[float]] = {name: [] for name in loaders}
    for round_index in range(rounds + 1):
        for name, make in loaders.items():
            seconds, samples = epoch_batches(make(round_index), batches=epoch)
            if round_index:  # the first round warms the page cache and the allocators
                rates[name].append(samples / seconds)
    sample_mb = data.layout.step_bytes * (cfg.history + 1) / 1e6
    print(f"1. loader vs a naive loader: {path.name}, {data.layout.num_channels} channels on a {data.layout.grid[0]}x"
          f"{data.layout.grid[1]} grid, {sample_mb:.2f} MB per sample, batch {batch_size}, blocks of "
          f"{data.block_size} samples; whole epochs of {epoch} batches, {rounds} rounds (+1 discarded), "
          "alternating, no worker processes")
    for name, values in rates.items():
        print(f"  {name:<11} {spread(values, 'samples/s')}   {statistics.median(values) * sample_mb:8.1f} MB/s of windows")
    ratio = statistics.median(rates["optbench"]) / statistics.median(rates["naive isel"])
    print(f"  ratio       {ratio:.1f}x the naive loader (medians)")


# --------------------------------------------------------------------------------- the disk limit
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


def write_zarr_copy(nc: Path, store: Path, *, time_chunk: int) -> None:
    import xarray as xr

    with xr.open_dataset(nc, engine="h5netcdf") as ds:
        encoding = {v: {"chunks": (time_chunk, *ds[v].shape[1:]), "compressors": None} for v in ds.data_vars}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # zarr's note on consolidated metadata in format 3
            ds.to_zarr(store, encoding=encoding, mode="w")


def big_files(tmp: Path, *, gigabytes: float, nlat: int, nlon: int) -> list[Path]:
    step_bytes = 17 * nlat * nlon * 4
    steps = math.ceil(gigabytes * 1e9 / step_bytes / 8) * 8
    nc = tmp / "big.nc"
    start = time.perf_counter()
    meta = write_synthetic(nc, days=steps * 6 / 24, nlat=nlat, nlon=nlon, compress=False)
    written = time.perf_counter() - start
    start = time.perf_counter()
    write_zarr_copy(nc, tmp / "big.zarr", time_chunk=8)
    os.sync()
    print(f"2. against the disk: {nc.name}, {meta['steps']} steps x 17 channels on a {nlat}x{nlon} grid, "
          f"{meta['bytes'] / 1e9:.2f} GB uncompressed NetCDF4 (written in {written:.0f} s), and a Zarr copy "
          f"(8 steps per chunk, no compression; {time.perf_counter() - start:.0f} s)")
    return [nc, tmp / "big.zarr"]


def loader_epoch(data: ClimateData, *, workers: int, batch_size: int, seed: int) -> tuple[float, float]:
    """Seconds for one epoch through the loader with ``workers`` worker processes, and the bytes of
    fields it decoded (the training steps, float32)."""
    stream = data.train.shard(rank=0, world_size=1, seed=seed, start=0, batch_size=batch_size)
    per_worker = stream.per_worker(max(1, workers))
    batches = (per_worker // batch_size) * max(1, workers)
    seconds, samples = epoch_batches(DataLoader(stream, batch_size=None, num_workers=workers), batches=batches)
    decoded = data.train_steps * data.layout.step_bytes * samples / data.train.split.num_samples
    return seconds, decoded


def against_the_disk(paths: list[Path], *, batch_size: int, rounds: int, workers: list[int], cache: Path) -> None:
    datas = {p: build_climate_data(NetCDFDataConfig(paths=[str(p)], stats_cache=str(cache / p.name), history=2))
             for p in paths}
    raw: dict[Path, list[float]] = {p: [] for p in paths}
    decoded: dict[tuple[Path, int], list[float]] = {(p, w): [] for p in paths for w in workers}
    for round_index in range(rounds):
        for path in paths:  # interleaved: the disk's state is shared by both formats and all settings
            drop_page_cache(path)
            seconds, nbytes = raw_read(path)
            raw[path].append(nbytes / seconds / 1e6)
            for w in workers:
                drop_page_cache(path)
                seconds, nbytes = loader_epoch(datas[path], workers=w, batch_size=batch_size, seed=round_index)
                decoded[(path, w)].append(nbytes / seconds / 1e6)
    print(f"  batch {batch_size}, one training epoch per measurement, page cache dropped before each; "
          f"{rounds} rounds, medians [min - max]")
    for path in paths:
        limit = statistics.median(raw[path])
        label = "Zarr" if path.is_dir() else "NetCDF4"
        print(f"  {label:<8} raw sequential read {spread(raw[path], 'MB/s', '.0f')} (the limit)")
        for w in workers:
            rate = statistics.median(decoded[(path, w)])
            print(f"  {label:<8} optbench num_workers={w}: {spread(decoded[(path, w)], 'MB/s decoded', '.0f')} = "
                  f"{rate / limit:.0%} of the raw read; 1.88 GB in {PLAN_BYTES / 1e6 / rate:.2f} s")


def data_wait(path: Path, *, steps: int, batch_size: int, cache: Path, out: Path) -> None:
    from hydra import compose, initialize_config_dir

    from optbench.config import conf_dir
    from optbench.run.train import train

    print(f"3. data wait: optbench train task=climate data=netcdf model=small, batch {batch_size}, {steps} steps")
    for workers in (0, 1):
        overrides = [
            "task=climate", "data=netcdf", f"data.paths=[{path}]", f"data.stats_cache={cache}", "model=small",
            f"train.steps={steps}", f"train.batch_size={batch_size}", "log.progress=log",
            f"dataloader.num_workers={workers}", "measure.track_memory=false",
        ]
        with initialize_config_dir(version_base="1.3", config_dir=str(conf_dir())):
            cfg = compose(config_name="train", overrides=overrides)
        result = train(cfg, run_dir=out / f"workers{workers}")
        tp = result.summary["throughput"]
        if result.status != "completed":
            print(f"  num_workers={workers}: {result.status}: {result.error}")
            continue
        frac = tp["data_wait_frac"]
        print(f"  num_workers={workers}: data wait {frac:.2%} of step time (aim <= 2%: "
              f"{'met' if frac <= 0.02 else 'NOT met'}); step {tp['step_time_s']['median']:.3f} s median "
              f"[p10 {tp['step_time_s']['p10']:.3f} - p90 {tp['step_time_s']['p90']:.3f}] over "
              f"{tp['timed_steps']} timed steps; {tp['tokens_per_s']:,.0f} tokens/s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--days", type=float, default=30, help="length of the synthetic file (6-hourly)")
    parser.add_argument("--nlat", type=int, default=64)
    parser.add_argument("--nlon", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--big-gb", type=float, default=2.0, help="size of the file of part 2")
    parser.add_argument("--big-grid", type=int, nargs=2, default=[181, 360], help="its grid (default 1 degree)")
    parser.add_argument("--big-rounds", type=int, default=2)
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 1], help="num_workers settings of part 2")
    parser.add_argument("--steps", type=int, default=12, help="training steps of the data-wait runs")
    parser.add_argument("--file", type=Path, help="use this NetCDF file for parts 1 and 3 instead of a synthetic one")
    parser.add_argument("--tmp", type=Path, help="where to write the files (default: the system's temp dir)")
    parser.add_argument("--parts", type=int, nargs="+", default=[1, 2, 3], help="which parts to run (default all)")
    args = parser.parse_args()
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory(prefix="optbench-bench-data-", dir=args.tmp) as tmp:
        tmp_path = Path(tmp)
        path = args.file
        if path is None:
            path = tmp_path / "bench.nc"
            meta = write_synthetic(path, days=args.days, nlat=args.nlat, nlon=args.nlon)
            print(f"synthetic file: {meta['steps']} steps, {meta['raw_bytes'] / 1e6:.0f} MB of float32 "
                  f"({meta['bytes'] / 1e6:.0f} MB on disk, gzip, 8 steps per chunk)")
        print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {os.cpu_count()} CPUs")
        if 1 in args.parts:
            loader_vs_naive(path, batch_size=args.batch_size, rounds=args.rounds, cache=tmp_path / "stats")
        if 2 in args.parts and args.big_gb > 0:
            big = big_files(tmp_path, gigabytes=args.big_gb, nlat=args.big_grid[0], nlon=args.big_grid[1])
            against_the_disk(big, batch_size=args.batch_size, rounds=args.big_rounds, workers=args.workers,
                             cache=tmp_path / "stats")
            for p in big:
                for f in files_of(p):
                    f.unlink()
        if 3 in args.parts and args.steps > 0:
            data_wait(path, steps=args.steps, batch_size=args.batch_size, cache=tmp_path / "stats",
                      out=tmp_path / "runs")


if __name__ == "__main__":
    main()
