"""``make bench-data``: the NetCDF loader against a naive one, and the data wait of a real run.

1. Loader throughput. One synthetic CF file (``optbench data synth``: gzip, chunked along time)
   is read two ways, alternately in one process (ABAB..., the first round discarded), as a
   ``DataLoader`` with the same batch size and no worker processes:
   - naive: a map-style dataset whose ``__getitem__`` does ``ds[var].isel(time=slice(i, i+h+1)).values``
     for every variable, shuffled by a RandomSampler, collated by the default collate;
   - optbench: ``ClimateStream`` (chunk-aligned block reads, windows gathered from memory, whole
     batches yielded).
   Both produce the same normalized float32 windows; samples/s and MB/s of windows produced are
   reported with their spread, and the ratio (aim: >= 5x).
2. Data wait. ``optbench train task=climate data=netcdf model=small`` on the same file: the
   fraction of the timed step time spent waiting for the next batch (``data_wait_frac`` in
   summary.json; aim: <= 2%), with ``dataloader.num_workers`` 0 and 1.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from optbench.config import NetCDFDataConfig  # noqa: E402
from optbench.data.netcdf import build_climate_data, open_dataset  # noqa: E402
from optbench.data.synth import write_synthetic  # noqa: E402


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


def time_batches(loader: DataLoader, *, batches: int) -> tuple[float, int, int]:
    """Seconds, samples and bytes for ``batches`` batches after one warm-up batch."""
    it = iter(loader)
    next(it)
    samples = nbytes = 0
    start = time.perf_counter()
    for _ in range(batches):
        frames = next(it)["frames"]
        samples += frames.shape[0]
        nbytes += frames.numel() * frames.element_size()
    return time.perf_counter() - start, samples, nbytes


def loader_throughput(path: Path, *, batch_size: int, batches: int, rounds: int, cache: Path) -> None:
    cfg = NetCDFDataConfig(paths=[str(path)], stats_cache=str(cache), history=2)
    data = build_climate_data(cfg)
    stream = data.train.shard(rank=0, world_size=1, seed=0, start=0, batch_size=batch_size)
    naive = NaiveWindows(path, variables=cfg.variables, history=cfg.history, num_samples=data.train.split.num_samples,
                         mean=data.stats.mean, std=data.stats.std)
    loaders = {
        "naive isel": lambda: DataLoader(naive, batch_size=batch_size, shuffle=True, drop_last=True,
                                         generator=torch.Generator().manual_seed(0)),
        "optbench": lambda: DataLoader(stream, batch_size=None),
    }
    rates: dict[str, list[tuple[float, float]]] = {name: [] for name in loaders}
    for round_index in range(rounds + 1):
        for name, make in loaders.items():
            seconds, samples, nbytes = time_batches(make(), batches=batches)
            if round_index:  # the first round warms the page cache and the allocators
                rates[name].append((samples / seconds, nbytes / seconds / 1e6))
    sample_mb = data.layout.step_bytes * (cfg.history + 1) / 1e6
    print(f"loader throughput: {path.name}, {data.layout.num_channels} channels on a {data.layout.grid[0]}x"
          f"{data.layout.grid[1]} grid, {sample_mb:.2f} MB per sample, batch {batch_size}, blocks of "
          f"{data.block_size} samples, {batches} batches x {rounds} rounds, no worker processes")
    medians = {}
    for name, values in rates.items():
        sps = [v[0] for v in values]
        mbs = [v[1] for v in values]
        medians[name] = statistics.median(sps)
        print(f"  {name:<11} {statistics.median(sps):9.1f} samples/s [{min(sps):.1f} - {max(sps):.1f}]   "
              f"{statistics.median(mbs):8.1f} MB/s")
    ratio = medians["optbench"] / medians["naive isel"]
    print(f"  ratio       {ratio:.1f}x the naive loader (aim >= 5x): {'met' if ratio >= 5 else 'NOT met'}")


def data_wait(path: Path, *, steps: int, batch_size: int, cache: Path, out: Path) -> None:
    from hydra import compose, initialize_config_dir

    from optbench.config import conf_dir
    from optbench.train import train

    print(f"data wait: optbench train task=climate data=netcdf model=small, batch {batch_size}, {steps} steps")
    for workers in (0, 1):
        overrides = [
            "task=climate", "data=netcdf", f"data.paths=[{path}]", f"data.stats_cache={cache}", "model=small",
            f"train.steps={steps}", f"train.batch_size={batch_size}", "train.progress=log",
            f"dataloader.num_workers={workers}", "train.track_memory=false",
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
    parser.add_argument("--batches", type=int, default=8, help="timed batches per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=12, help="training steps of the data-wait runs")
    parser.add_argument("--file", type=Path, help="use this NetCDF file instead of a synthetic one")
    args = parser.parse_args()
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory(prefix="optbench-bench-data-") as tmp:
        tmp_path = Path(tmp)
        path = args.file
        if path is None:
            path = tmp_path / "bench.nc"
            meta = write_synthetic(path, days=args.days, nlat=args.nlat, nlon=args.nlon)
            print(f"synthetic file: {meta['steps']} steps, {meta['raw_bytes'] / 1e6:.0f} MB of float32 "
                  f"({meta['bytes'] / 1e6:.0f} MB on disk, gzip, 8 steps per chunk)")
        print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
        loader_throughput(path, batch_size=args.batch_size, batches=args.batches, rounds=args.rounds,
                          cache=tmp_path / "stats")
        data_wait(path, steps=args.steps, batch_size=args.batch_size, cache=tmp_path / "stats", out=tmp_path / "runs")


if __name__ == "__main__":
    main()
