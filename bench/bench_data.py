"""``make bench-data``: the climate loader against a naive one, the disk, the decoder and a GPU step.

1. Loader vs a naive loader. One synthetic CF file (``optbench data synth``: gzip, chunked along
   time) is read three ways, alternately in one process (ABC..., the first round discarded: it warms
   the page cache), each as a ``DataLoader`` with the same batch size and no worker processes, each
   timed over **one whole epoch** from the creation of its iterator to its last batch:
   - naive: a map-style dataset whose ``__getitem__`` does ``ds[var].isel(time=slice(i, i+h+1)).values``
     for every variable, shuffled by a RandomSampler, collated by the default collate (no optbench code);
   - optbench: ``ClimateStream`` with the default settings (chunks read directly, a prefetch thread);
   - optbench with ``data.reader=xarray`` (the same stream, blocks read through xarray).
   All produce the same normalized float32 windows; samples/s with their spread, and the ratios.
2. Against the disk and the decoder. The formats of ``data_formats.write_formats``: ``--big-gb`` GB
   uncompressed as NetCDF4, Zarr v2 and Zarr v3, and ``--compressed-gb`` GB as NetCDF4 zlib, Zarr v2
   Blosc-lz4 and Zarr v3 Blosc-zstd (1-degree grid, 8 steps per chunk). Per round, for each format:
   the page cache is dropped (``posix_fadvise DONTNEED``), the file is read sequentially in 16 MiB
   reads (raw MB/s: the disk's limit); for a compressed one every chunk is also decoded once from
   memory (decode-only MB/s: the codec's limit); then for each ``--workers`` setting one DataLoader
   runs 1 + ``--steady-epochs`` epochs in a process of its own (as a training run meets its loader,
   not after the other formats' blocks and workers), the page cache dropped before each: the first timed from
   creating the iterator (worker start-up, first touch of every buffer), the others together in
   steady state (one epoch of a short file is a few blocks: workers decode them ahead of the batches
   handed over, so a one-epoch window holds more or less than an epoch of work; 0.5 GB zlib, two
   workers: single epochs of 267 to 884 MB/s in a row). Reported: decoded
   MB/s (float32 fields per second), the steady rate's share of the limit (aims: >= 50% of the raw
   read uncompressed; compressed, >= 80% of the slower of the decoder (decode-only; for NetCDF4 zlib
   the faster of zlib's one-call decode and the loader's own ``inflate``) and the disk
   (the raw read times decoded / stored bytes): a fast codec on this disk is disk-bound, not
   decode-bound), with the best worker count, the time to process the plan's 1.88 GB (9.7 s in the
   plan, aim < 1 s), and the CPU share other processes used meanwhile (/proc/stat less this
   process and its workers): above bench_overhead's 5% the goal lines say NO VERDICT.
3. Data wait. ``optbench train task=climate data=netcdf model=small`` on the file of part 1 with the
   default loader settings and with one worker: the fraction of the timed step time spent waiting
   for the next batch (``data_wait_frac`` in summary.json; aim: <= 2%).
4. Can feed. Part 2's best steady rate per format as samples/s and the step time it allows at the
   batch size, beside the step ``optbench estimate`` predicts on an H100 (closed form at
   ``estimate.mfu``) for ``task=climate`` on the same grid, ``model=small``/``1b``, fp32 and bf16:
   a loader share of the step below 100% means it keeps up.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import bench_overhead  # noqa: E402
from data_formats import decode_only, drop_page_cache, raw_read, write_formats  # noqa: E402

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
    if batches < 1:
        raise SystemExit("an epoch of this file is less than one batch: give a longer file (--days) or a smaller --batch-size")
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
    through_xarray = build_climate_data(NetCDFDataConfig(paths=[str(path)], stats_cache=str(cache), history=2,
                                                         reader="xarray"))
    naive = NaiveWindows(path, variables=cfg.variables, history=cfg.history, num_samples=data.train.split.num_samples,
                         mean=data.stats.mean, std=data.stats.std)
    epoch = data.train.split.num_samples // batch_size  # batches of one epoch, for all
    loaders = {
        "naive isel": lambda r: DataLoader(naive, batch_size=batch_size, shuffle=True, drop_last=True,
                                           generator=torch.Generator().manual_seed(r)),
        "optbench": lambda r: DataLoader(data.train.shard(rank=0, world_size=1, seed=r, start=0,
                                                          batch_size=batch_size), batch_size=None),
        "optbench, data.reader=xarray": lambda r: DataLoader(through_xarray.train.shard(
            rank=0, world_size=1, seed=r, start=0, batch_size=batch_size), batch_size=None),
    }
    rates: dict[str, list[float]] = {name: [] for name in loaders}
    loads = []
    for round_index in range(rounds + 1):
        for name, make in loaders.items():
            loads.append(os.getloadavg()[0])
            seconds, samples = epoch_batches(make(round_index), batches=epoch)
            if round_index:  # the first round warms the page cache and the allocators
                rates[name].append(samples / seconds)
    sample_mb = data.layout.step_bytes * (cfg.history + 1) / 1e6
    print(f"1. loader vs a naive loader: {path.name}, {data.layout.num_channels} channels on a {data.layout.grid[0]}x"
          f"{data.layout.grid[1]} grid, {sample_mb:.2f} MB per sample, batch {batch_size}, blocks of "
          f"{data.block_size} samples; whole epochs of {epoch} batches, {rounds} rounds (+1 discarded), "
          f"alternating, no worker processes; load average {min(loads):.1f}-{max(loads):.1f}")
    for name, values in rates.items():
        print(f"  {name:<28} {spread(values, 'samples/s')}   {statistics.median(values) * sample_mb:8.1f} MB/s of windows")
    naive_rate = statistics.median(rates["naive isel"])
    print(f"  ratio: optbench {statistics.median(rates['optbench']) / naive_rate:.1f}x the naive loader, through "
          f"xarray {statistics.median(rates['optbench, data.reader=xarray']) / naive_rate:.1f}x (medians; aim >= 5x)")


# --------------------------------------------------------------------------------- the disk limit
def _epoch(it, batches: int) -> tuple[float, int]:
    start = time.perf_counter()
    samples = sum(next(it)["frames"].shape[0] for _ in range(batches))
    return time.perf_counter() - start, samples


def loader_epochs(data: ClimateData, path: Path, *, workers: int, batch_size: int, seed: int,
                  steady_epochs: int) -> tuple[float, float]:
    """Decoded MB/s of 1 + ``steady_epochs`` consecutive epochs of one DataLoader with ``workers``
    processes, the page cache dropped before each: the first from creating the iterator (worker
    start-up and the first touch of every buffer included), the others together in steady state
    (what a training run sees from then on; the prefetch started at most ``prefetch`` batches of
    each before its drop)."""
    stream = data.train.shard(rank=0, world_size=1, seed=seed, start=0, batch_size=batch_size)
    batches = (stream.per_worker(max(1, workers)) // batch_size) * max(1, workers)
    per_sample = data.train_steps * data.layout.step_bytes / data.train.split.num_samples / 1e6
    drop_page_cache(path)
    started = time.perf_counter()
    it = iter(DataLoader(stream, batch_size=None, num_workers=workers, persistent_workers=workers > 0))
    _, first_samples = _epoch(it, batches)
    first = time.perf_counter() - started
    seconds, samples = 0.0, 0
    for _ in range(steady_epochs):
        drop_page_cache(path)
        epoch_seconds, epoch_samples = _epoch(it, batches)
        seconds, samples = seconds + epoch_seconds, samples + epoch_samples
    del it
    return first_samples * per_sample / first, samples * per_sample / seconds


def loader_epochs_apart(path: Path, stats_cache: Path, *, workers: int, batch_size: int, seed: int,
                        steady_epochs: int) -> tuple[float, float]:
    """``loader_epochs`` in a fresh process (this script with ``--loader-epochs``), as a training
    run meets its loader: no blocks, buffers or worker forks of the formats measured before. In
    one process for all formats, NetCDF4 zlib with two workers lost a fifth of its rate after the
    2 GB uncompressed rounds (67% of decode-only against 81-84% measured alone)."""
    command = [sys.executable, __file__, "--loader-epochs", str(path), "--stats-cache", str(stats_cache),
               "--workers", str(workers), "--batch-size", str(batch_size), "--seed", str(seed),
               "--steady-epochs", str(steady_epochs)]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise SystemExit(f"the loader run on {path} with {workers} worker(s) failed: {last}")
    first, second = json.loads(done.stdout.strip().splitlines()[-1])
    return first, second


def against_the_disk(paths: dict[str, Path], *, batch_size: int, rounds: int, workers: list[int], cache: Path,
                     steady_epochs: int) -> dict:
    datas = {label: build_climate_data(NetCDFDataConfig(paths=[str(p)], stats_cache=str(cache / p.name), history=2))
             for label, p in paths.items()}
    raw = {label: [] for label in paths}
    decode = {label: [] for label in paths if "zlib" in label or "Blosc" in label}
    cold = {(label, w): [] for label in paths for w in workers}
    steady = {(label, w): [] for label in paths for w in workers}
    loads: list[float] = []
    others: list[float] = []  # the CPU share other processes used during each format's round
    stored: dict[str, int] = {}
    for round_index in range(rounds):
        for label, path in paths.items():  # interleaved: formats and settings share the disk's state
            loads.append(os.getloadavg()[0])
            machine_0, own_0, start = *busy_seconds(), time.monotonic()
            drop_page_cache(path)
            seconds, nbytes = raw_read(path)
            raw[label].append(nbytes / seconds / 1e6)
            stored[label] = nbytes
            if label in decode:
                decode[label].append(decode_only(path))  # {decoder: MB/s}
            for w in workers:
                first, second = loader_epochs_apart(path, cache / path.name, workers=w, batch_size=batch_size,
                                                    seed=round_index, steady_epochs=steady_epochs)
                cold[(label, w)].append(first)
                steady[(label, w)].append(second)
            machine_1, own_1 = busy_seconds()
            others.append(((machine_1 - machine_0) - (own_1 - own_0))
                          / (max(time.monotonic() - start, 1e-9) * (os.cpu_count() or 1)))
    load = (f"load average {min(loads):.1f}-{max(loads):.1f} on {os.cpu_count()} CPUs (this bench's own workers "
            f"included); other processes used up to {max(others):.1%} of the CPUs")
    print(f"  batch {batch_size}, page cache dropped before every epoch, steady = {steady_epochs} epochs timed together; "
          f"{rounds} rounds interleaved, medians [min - max]; {load}")
    best = {}
    for label in paths:
        limit_name, limit = "raw read", statistics.median(raw[label])
        extra = ""
        if label in decode:
            # a compressed file is limited by the slower of reading its stored bytes (the raw read,
            # as decoded MB/s: times decoded / stored bytes) and decoding them (decode-only)
            decoded = datas[label].layout.step_bytes * datas[label].layout.num_steps
            from_disk = limit * decoded / stored[label]
            by = {name: [r[name] for r in decode[label]] for name in decode[label][0]}
            decoder = max(statistics.median(rates) for rates in by.values())  # the fastest decoder
            limit_name, limit = ("decode-only", decoder) if decoder <= from_disk else ("disk", from_disk)
            decoders = ", ".join(f"{spread(rates, 'MB/s', '.0f')} ({name})" for name, rates in by.items())
            extra = (f"; decode-only {decoders}; the disk delivers {from_disk:.0f} MB/s "
                     f"decoded ({decoded / stored[label]:.2f}x its stored bytes): the limit is the "
                     f"{'decoder' if limit_name == 'decode-only' else 'disk'}")
        print(f"  {label:<18} raw sequential read {spread(raw[label], 'MB/s', '.0f')}{extra}")
        for w in workers:
            rate = statistics.median(steady[(label, w)])
            print(f"    num_workers={w}: steady {spread(steady[(label, w)], 'MB/s', '.0f')} = {rate / limit:.0%} of the "
                  f"{limit_name}; first epoch {statistics.median(cold[(label, w)]):.0f} MB/s; 1.88 GB in "
                  f"{PLAN_BYTES / 1e6 / rate:.2f} s")
        w_best = max(workers, key=lambda w: statistics.median(steady[(label, w)]))
        best[label] = (w_best, statistics.median(steady[(label, w_best)]), limit, limit_name)
    goals(best, others=others)
    return {label: (datas[label], rate) for label, (_, rate, _, _) in best.items()}


def busy_seconds() -> tuple[float, float]:
    """(CPU seconds the whole machine has been busy, /proc/stat; CPU seconds of this process and
    its finished children: the DataLoader workers, joined at the end of each epoch)."""
    machine, _ = bench_overhead.cpu_seconds()
    me, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return machine, me.ru_utime + me.ru_stime + children.ru_utime + children.ru_stime


def goals(best: dict, *, others: list[float]) -> None:
    """The issue's goals; no verdict when other processes used more than bench_overhead's share of
    the CPUs meanwhile (the load average would count this bench's own workers as load)."""
    busy = not others or math.isnan(max(others)) or max(others) > bench_overhead.OTHERS_SHARE
    for label, (w, rate, limit, limit_name) in best.items():
        aim = 0.5 if limit_name == "raw read" else 0.8
        verdict = "met" if rate >= aim * limit else "NOT met"
        if busy:
            verdict = (f"{verdict} here, NO VERDICT (other processes used up to {max(others):.1%} of the CPUs, "
                       f"above {bench_overhead.OTHERS_SHARE:.0%})")
        print(f"  goal {label:<18} best num_workers={w}: {rate / limit:.0%} of the {limit_name} (aim >= {aim:.0%}): "
              f"{verdict}")


def can_feed(fed: dict, *, batch_size: int, models: list[str]) -> None:
    """Samples/s the loader delivers vs the step time optbench estimate predicts on an H100."""
    from optbench.config import compose, to_config
    from optbench.estimate.api import count_model, throughput

    print(f"4. can feed: the best steady rate above as samples/s, against optbench estimate's H100 step at batch "
          f"{batch_size} (closed form at estimate.mfu, the same grid)")
    for label, (data, rate) in fed.items():
        per_sample = data.train_steps * data.layout.step_bytes / data.train.split.num_samples / 1e6
        samples = rate / per_sample
        line = (f"  {label:<18} {samples:,.1f} samples/s = a step of {1e3 * batch_size / samples:,.1f} ms at batch "
                f"{batch_size};")
        for model in models:
            for precision in ("fp32", "bf16"):
                cfg = to_config(compose(["task=climate", "data=netcdf", f"data.paths=[{data.layout.files[0].path}]",
                                         f"data.stats_cache={data.train.source.layout.files[0].path.parent / 'stats'}",
                                         f"model={model}", f"precision={precision}", f"train.batch_size={batch_size}",
                                         "estimate.gpu=h100"]))
                step = throughput(cfg, counts=count_model(cfg), world_size=1)["step_time_s"]
                line += f" model={model} {precision}: {1e3 * step:,.2f} ms ({batch_size / samples / step:.0%})"
        print(line)


def data_wait(path: Path, *, steps: int, batch_size: int, cache: Path, out: Path) -> None:
    from hydra import compose, initialize_config_dir

    from optbench.config import conf_dir
    from optbench.run.train import train

    print(f"3. data wait: optbench train task=climate data=netcdf model=small, batch {batch_size}, {steps} steps; "
          "the default loader (dataloader=baseline: no worker processes, data.prefetch=2) and one worker")
    for workers in (0, 1):
        load = os.getloadavg()[0]
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
              f"{tp['timed_steps']} timed steps; {tp['tokens_per_s']:,.0f} tokens/s; load average {load:.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--days", type=float, default=30, help="length of the synthetic file (6-hourly)")
    parser.add_argument("--nlat", type=int, default=64)
    parser.add_argument("--nlon", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--big-gb", type=float, default=2.0, help="size of the uncompressed files of part 2")
    parser.add_argument("--compressed-gb", type=float, default=0.5, help="size (uncompressed) of the compressed ones")
    parser.add_argument("--big-grid", type=int, nargs=2, default=[181, 360], help="their grid (default 1 degree)")
    parser.add_argument("--big-rounds", type=int, default=2)
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 1, 2], help="num_workers settings of part 2")
    parser.add_argument("--steady-epochs", type=int, default=3, help="epochs timed together as part 2's steady rate")
    parser.add_argument("--loader-epochs", type=Path, help=argparse.SUPPRESS)  # one loader run of part 2, in its own process
    parser.add_argument("--stats-cache", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--formats", nargs="+", help="only these formats of part 2 (labels as printed)")
    parser.add_argument("--models", nargs="+", default=["small", "1b"], help="models of part 4")
    parser.add_argument("--steps", type=int, default=12, help="training steps of the data-wait runs")
    parser.add_argument("--file", type=Path, help="use this NetCDF file for parts 1 and 3 instead of a synthetic one")
    parser.add_argument("--tmp", type=Path, help="where to write the files (default: the system's temp dir)")
    parser.add_argument("--parts", type=int, nargs="+", default=[1, 2, 3, 4], help="which parts to run (default all)")
    args = parser.parse_args()
    torch.manual_seed(0)
    if args.loader_epochs is not None:
        data = build_climate_data(NetCDFDataConfig(paths=[str(args.loader_epochs)], stats_cache=str(args.stats_cache),
                                                   history=2))
        print(json.dumps(loader_epochs(data, args.loader_epochs, workers=args.workers[0], batch_size=args.batch_size,
                                       seed=args.seed, steady_epochs=args.steady_epochs)))
        return
    with tempfile.TemporaryDirectory(prefix="optbench-bench-data-", dir=args.tmp) as tmp:
        tmp_path = Path(tmp)
        path = args.file
        if path is None:
            path = tmp_path / "bench.nc"
            meta = write_synthetic(path, days=args.days, nlat=args.nlat, nlon=args.nlon)
            print(f"synthetic file: {meta['steps']} steps, {meta['raw_bytes'] / 1e6:.0f} MB of float32 "
                  f"({meta['bytes'] / 1e6:.0f} MB on disk, gzip, 8 steps per chunk)")
        print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {os.cpu_count()} CPUs, load average "
              f"{os.getloadavg()[0]:.1f}")
        if 1 in args.parts:
            loader_vs_naive(path, batch_size=args.batch_size, rounds=args.rounds, cache=tmp_path / "stats")
        fed = {}
        if {2, 4} & set(args.parts) and args.big_gb + args.compressed_gb > 0:
            print("2. against the disk and the decoder:")
            formats = write_formats(tmp_path, gigabytes=args.big_gb, compressed_gb=args.compressed_gb,
                                    nlat=args.big_grid[0], nlon=args.big_grid[1])
            chosen = {k: v for k, v in formats.items() if not args.formats or k in args.formats}
            fed = against_the_disk(chosen, batch_size=args.batch_size, rounds=args.big_rounds, workers=args.workers,
                                   cache=tmp_path / "stats", steady_epochs=args.steady_epochs)
        if 3 in args.parts and args.steps > 0:
            data_wait(path, steps=args.steps, batch_size=args.batch_size, cache=tmp_path / "stats",
                      out=tmp_path / "runs")
        if 4 in args.parts and fed:
            can_feed(fed, batch_size=args.batch_size, models=args.models)


if __name__ == "__main__":
    main()
