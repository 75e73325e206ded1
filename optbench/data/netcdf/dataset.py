"""The train split as a sharded, resumable stream of batches and the eval split as windows."""

from __future__ import annotations

import copy
import logging
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch
from torch.utils.data import Dataset, IterableDataset, get_worker_info

from optbench.config import NetCDFDataConfig
from optbench.data.netcdf.buffers import BufferPool, SharedBatches
from optbench.data.netcdf.decode import Affine
from optbench.data.netcdf.layout import Layout, build_layout
from optbench.data.netcdf.prefetch import prefetched
from optbench.data.netcdf.source import ClimateSource
from optbench.data.netcdf.stats import Stats, load_or_compute_stats
from optbench.errors import ConfigError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Split:
    """Samples ``0 .. num_samples-1`` of a split: sample ``i`` is the steps ``first + i + offsets``
    of its frame offsets (``history`` inputs, then the target(s); see ``frame_offsets``)."""

    first: int
    num_samples: int


def frame_offsets(history: int, *, lead_steps: int = 1, targets: int = 1) -> np.ndarray:
    """The steps of one sample relative to its first: ``history`` inputs ``lead_steps`` apart, then
    ``targets`` steps each ``lead_steps`` after the one before (the first is the forecast
    target, the others the autoregressive rollout's). ``lead_steps=1, targets=1``: ``0..history``."""
    return np.arange(history + targets, dtype=np.int64) * lead_steps


def split_steps(num_steps: int, *, history: int, eval_fraction: float, paths: str, lead_steps: int = 1,
                rollout_steps: int = 1) -> tuple[Split, Split]:
    """The train split (first) and the eval split (the last ``eval_fraction`` of the steps, at least
    one eval sample's span): train samples span ``history`` inputs and one target ``lead_steps``
    ahead, eval samples ``rollout_steps`` targets."""
    window = int(frame_offsets(history, lead_steps=lead_steps)[-1]) + 1
    eval_window = int(frame_offsets(history, lead_steps=lead_steps, targets=rollout_steps)[-1]) + 1
    if num_steps < window:
        need = "(history + the step to predict): lower data.history" if lead_steps == 1 else (
            f"(history inputs {lead_steps} steps apart + the step to predict {lead_steps} ahead): lower "
            "data.history or task.lead_steps")
        raise ConfigError(
            f"{paths} {'has' if ', ' not in paths else 'have'} {num_steps} time steps; data.history={history}"
            f"{'' if lead_steps == 1 else f' with task.lead_steps={lead_steps}'} needs at least {window} {need} "
            "or add files"
        )
    eval_steps = max(eval_window, int(round(num_steps * eval_fraction)))
    train_steps = num_steps - eval_steps
    if train_steps < window:
        raise ConfigError(
            f"{paths} has {num_steps} time steps: too few for a train split of at least {window} and an eval split "
            f"of at least {eval_window} steps (data.history={history}, task.lead_steps={lead_steps}, "
            f"task.rollout_steps={rollout_steps}, data.eval_fraction={eval_fraction}); lower them or add files"
        )
    return Split(0, train_steps - window + 1), Split(train_steps, eval_steps - eval_window + 1)


def auto_block_size(layout: Layout, *, history: int, block_mb: int) -> int:
    """Samples per read: a whole number of the file's time chunks, at least 32 steps, at most
    ``block_mb`` MiB per block (``history``: the steps a block reads beyond its samples' first)."""
    chunk = layout.time_chunk or 1
    size = chunk * -(-32 // chunk)
    cap = max(1, (block_mb << 20) // max(1, layout.step_bytes) - history)
    return max(1, min(size, cap))


# ------------------------------------------------------------------------------------------ datasets
def _gather(block: np.ndarray, starts: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """``(len(starts), len(offsets), C, H, W)``: the frames of the samples starting at ``starts``
    of a block, in one fancy-indexing copy."""
    return block[starts[:, None] + offsets[None, :]]


class ClimateStream(IterableDataset):
    """The training split as an endless stream of batches (see the module docstring)."""

    def __init__(self, source: ClimateSource, *, stats: Stats, split: Split, history: int, block_size: int,
                 offsets: np.ndarray | None = None, prefetch: int = 0, read_ahead: int = 0) -> None:
        self.source = source
        self.affine = Affine.normalization(stats.mean, stats.std)
        self.split = split
        self.history = history
        self.offsets = frame_offsets(history) if offsets is None else offsets
        self.extra = int(self.offsets[-1])  # steps a sample reads after its first
        self.block_size = min(block_size, split.num_samples)
        self.num_blocks = -(-split.num_samples // self.block_size)
        self.rank = 0
        self.world_size = 1
        self.seed = 0
        self.start = 0
        self.batch_size: int | None = None
        self.prefetch = prefetch  # batches a background thread prepares ahead (no worker processes)
        self.read_ahead = read_ahead  # blocks a background thread reads ahead (in every process)
        self.pin_memory = False
        self._blocks = BufferPool(limit=read_ahead + 3)
        self._batches = BufferPool(limit=prefetch + 4)
        self._shared: SharedBatches | None = None

    def shard(self, *, rank: int, world_size: int, seed: int, start: int, batch_size: int,
              pin_memory: bool = False) -> ClimateStream:
        """A copy that yields rank ``rank``'s batches of ``batch_size``, its data order seeded by
        ``seed``, skipping the ``start`` samples this rank already consumed (a whole number of batches).
        ``pin_memory``: batches are gathered straight into page-locked memory (CUDA, no workers)."""
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in [0, {world_size})")
        if start % batch_size:
            raise ValueError(f"start={start} is not a whole number of batches of {batch_size}")
        if self.split.num_samples < world_size:
            raise ConfigError(f"{self.split.num_samples} training samples cannot be split over {world_size} ranks; "
                              "add time steps or use fewer ranks")
        shard = copy.copy(self)
        shard.rank, shard.world_size, shard.seed, shard.start, shard.batch_size = rank, world_size, seed, start, batch_size
        shard.pin_memory = pin_memory
        shard._shared = SharedBatches()  # its worker processes' batch slots, created before they start
        return shard

    # --- the order ---------------------------------------------------------------------------
    def epoch_order(self, epoch: int) -> np.ndarray:
        """All sample indices of one epoch: blocks permuted, samples shuffled inside each block."""
        rng = np.random.default_rng([self.seed, epoch, 0xC11A7E])
        block_rank = np.empty(self.num_blocks, dtype=np.int64)
        block_rank[rng.permutation(self.num_blocks)] = np.arange(self.num_blocks)
        samples = np.arange(self.split.num_samples)
        return samples[np.lexsort((rng.random(samples.size), block_rank[samples // self.block_size]))]

    def per_worker(self, num_workers: int, *, world_size: int | None = None) -> int:
        """Samples per epoch for each of ``num_workers`` workers of a rank (of ``world_size``)."""
        world_size = world_size or self.world_size
        per_rank = self.split.num_samples // world_size
        count = per_rank // num_workers
        if count < 1:
            raise ConfigError(
                f"{self.split.num_samples} training samples cannot feed {world_size} rank(s) x {num_workers} "
                "DataLoader worker(s); lower dataloader.num_workers or add time steps"
            )
        return count

    def share_order(self, epoch: int, num_workers: int) -> np.ndarray:
        """``epoch_order``, with each block that a share boundary (of a rank or a DataLoader worker)
        cuts split in time: the share before the cut gets the block's earliest samples, the one after
        the latest, each in the order the shuffle gave those positions. Each side then reads only its
        part of the block, not all of it (a block cut in two was read twice); blocks no boundary
        cuts, and a single process's whole order, are ``epoch_order``'s."""
        order = self.epoch_order(epoch)
        per_rank = self.split.num_samples // self.world_size
        per_worker = self.per_worker(num_workers)
        cuts = {r * per_rank + k * per_worker for r in range(self.world_size) for k in range(num_workers + 1)}
        blocks = order // self.block_size
        starts = np.flatnonzero(np.r_[True, blocks[1:] != blocks[:-1]])  # where each block's run begins
        inside: dict[int, list[int]] = {}
        for cut in sorted(cuts):
            if 0 < cut < len(order):
                first = int(starts[np.searchsorted(starts, cut, side="right") - 1])
                if first != cut:
                    inside.setdefault(first, []).append(cut)
        out = order.copy()
        ends = dict(zip(starts.tolist(), [*starts[1:].tolist(), len(order)], strict=True))
        for first, block_cuts in inside.items():
            times = np.sort(order[first : ends[first]])
            bounds = [first, *block_cuts, ends[first]]
            for a, b in zip(bounds[:-1], bounds[1:], strict=True):
                out[a:b] = times[a - first : b - first][np.argsort(np.argsort(order[a:b]))]
        return out

    def worker_samples(self, worker: int, num_workers: int, *, skip: int = 0) -> Iterator[np.ndarray]:
        """Worker ``worker``'s share of each epoch from stream position ``skip``, in runs of one block."""
        per_worker = self.per_worker(num_workers)
        per_rank = self.split.num_samples // self.world_size
        epoch, offset = divmod(skip, per_worker)
        while True:
            lo = self.rank * per_rank + worker * per_worker
            part = self.share_order(epoch, num_workers)[lo + offset : lo + per_worker]
            blocks = part // self.block_size
            cuts = np.flatnonzero(np.diff(blocks)) + 1
            yield from np.split(part, cuts)
            epoch, offset = epoch + 1, 0

    def resume_position(self, worker: int, num_workers: int) -> tuple[int, int]:
        """(canonical worker, samples it already produced) for this loader's worker ``worker``:
        the DataLoader takes batches from its workers in turn starting at worker 0, so after ``n``
        batches the next one is canonical worker ``n % W``'s."""
        assert self.batch_size is not None
        batches = self.start // self.batch_size
        canonical = (batches + worker) % num_workers
        done = max(0, -(-(batches - canonical) // num_workers))
        return canonical, done * self.batch_size

    # --- reading -----------------------------------------------------------------------------
    def read_block(self, block: int, lo: int = 0, hi: int | None = None) -> np.ndarray:
        """The normalized steps of block ``block``'s samples ``[lo, hi)`` (all by default), in a
        reused buffer (``(steps, C, H, W)``)."""
        first = block * self.block_size
        last = min(self.split.num_samples, first + self.block_size if hi is None else first + hi)
        first += lo
        start = self.split.first + first
        steps = last - first + self.extra
        frame = (self.source.layout.num_channels, *self.source.layout.grid)
        full = (self.block_size + self.extra) * int(np.prod(frame)) * 4  # every block of this stream fits
        out = self._blocks.take((steps, *frame), reserve=full)
        return self.source.read_into(out, start, start + steps, affine=self.affine)

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        info = get_worker_info()
        if info is not None:
            return self.batches(info.id, info.num_workers, shared=True)
        if not self.prefetch:
            return self.batches(0, 1)
        return _seen_here(prefetched(self.batches(0, 1), depth=self.prefetch, name="optbench-prefetch"))

    def _new_frames(self, worker: int, shape: tuple[int, ...], *, shared: bool) -> tuple[torch.Tensor | np.ndarray,
                                                                                          int | None]:
        """An uninitialized batch buffer: a shared-memory slot in a worker, page-locked memory for
        a CUDA copy (tensors), else a reused buffer of this process (an array; see ``buffers``)."""
        if shared:
            if self._shared is None:
                return torch.empty(shape).share_memory_(), None
            return self._shared.take(worker, shape)
        if self.pin_memory:
            return torch.empty(shape, pin_memory=True), None
        return self._batches.take(shape), None

    def _blocks_of(self, runs: Iterator[np.ndarray]) -> Iterator[tuple[np.ndarray, int, np.ndarray]]:
        """(run, the sample its read starts at, the read): one read per run of a block, of the
        samples the run needs (all of the block but where a share boundary cuts it), kept while the
        next runs stay inside it."""
        held, cached = (-1, 0, 0), np.empty(0)
        for run in runs:
            block = int(run[0]) // self.block_size
            lo, hi = int(run.min()), int(run.max()) + 1
            if not (held[0] == block and held[1] <= lo and hi <= held[2]):
                cached = np.empty(0)  # lets the pool reuse the previous block's buffer
                first = block * self.block_size
                held, cached = (block, lo, hi), self.read_block(block, lo - first, hi - first)
            yield run, held[1], cached

    def batches(self, worker: int, num_workers: int, *, shared: bool = False) -> Iterator[dict[str, torch.Tensor]]:
        """The endless batches DataLoader worker ``worker`` of ``num_workers`` yields. The windows
        are gathered straight into the batch (one copy per frame, ``np.take``), which is reused
        memory: a shared-memory slot in a worker process (handing it to the training process
        copies nothing), page-locked with ``pin_memory``, else a buffer of this process. Blocks
        and the gather stay numpy: the batch's tensors are made where it is handed over."""
        if self.batch_size is None:
            raise RuntimeError("ClimateStream needs shard(...) before iteration")
        canonical, skip = self.resume_position(worker, num_workers)
        runs = self._blocks_of(self.worker_samples(canonical, num_workers, skip=skip))
        if self.read_ahead:
            runs = prefetched(runs, depth=self.read_ahead, name="optbench-read-ahead")
        ids: list[np.ndarray] = []
        frames: torch.Tensor | np.ndarray | None = None
        slot: int | None = None
        filled = 0
        window = len(self.offsets)
        for run, base, cached in runs:
            pos = 0
            while pos < len(run):
                if frames is None:
                    frames, slot = self._new_frames(worker, (self.batch_size, window, *cached.shape[1:]), shared=shared)
                    out = (frames.numpy() if isinstance(frames, torch.Tensor) else frames).reshape(-1, *cached.shape[1:])
                take = run[pos : pos + self.batch_size - filled]
                rows = (take[:, None] - base + self.offsets[None, :]).ravel()
                np.take(cached, rows, axis=0, out=out[filled * window : (filled + len(take)) * window], mode="clip")
                ids.append(take)
                filled += len(take)
                pos += len(take)
                if filled == self.batch_size:
                    yield self._batch(frames, slot, np.concatenate(ids) + self.split.first, shared=shared)
                    ids, frames, out, filled = [], None, None, 0  # the buffer is the consumer's now

    def _batch(self, frames: torch.Tensor | np.ndarray, slot: int | None, sample: np.ndarray, *,
               shared: bool) -> dict[str, torch.Tensor]:
        tensor = frames if isinstance(frames, torch.Tensor) else torch.from_numpy(frames)
        if shared and self._shared is not None:
            return self._shared.batch(tensor, slot, sample=torch.from_numpy(sample))
        return {"frames": tensor, "sample": torch.from_numpy(sample)}


def _seen_here(batches: Iterator[dict[str, torch.Tensor]]) -> Iterator[dict[str, torch.Tensor]]:
    """The prefetch thread's batches, each tensor detached in the consuming thread: a view of the
    same memory, created by an op of this thread, so a memory tracker of the training step (torch's
    MemTracker, a thread-local dispatch mode) accounts for the batch as when it is built here."""
    for batch in batches:
        yield {key: value.detach() for key, value in batch.items()}


class ClimateWindows(Dataset):
    """A split as a map-style dataset in time order (the eval split); ``__getitems__`` reads all
    the windows of a batch with one block read."""

    def __init__(self, source: ClimateSource, *, stats: Stats, split: Split, history: int,
                 offsets: np.ndarray | None = None) -> None:
        self.source = source
        self.affine = Affine.normalization(stats.mean, stats.std)
        self.split = split
        self.history = history
        self.offsets = frame_offsets(history) if offsets is None else offsets

    def __len__(self) -> int:
        return self.split.num_samples

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return self.__getitems__([index])[0]

    def __getitems__(self, indices: list[int]) -> list[dict[str, torch.Tensor]]:
        for i in indices:
            if not 0 <= i < self.split.num_samples:
                raise IndexError(i)
        idx = np.asarray(indices)
        lo, hi = int(idx.min()), int(idx.max())
        start = self.split.first + lo
        stop = start + hi - lo + int(self.offsets[-1]) + 1
        out = np.empty((stop - start, self.source.layout.num_channels, *self.source.layout.grid), dtype=np.float32)
        block = self.source.read_into(out, start, stop, affine=self.affine)
        frames = _gather(block, idx - lo, self.offsets)
        return [{"frames": torch.from_numpy(f), "sample": torch.tensor(self.split.first + i)}
                for f, i in zip(frames, indices, strict=True)]


# ------------------------------------------------------------------------------------------ building
@dataclass
class ClimateData:
    layout: Layout
    stats: Stats
    train: ClimateStream
    eval: ClimateWindows
    block_size: int
    train_steps: int  # the steps before the eval split: statistics and climatology come from them only


def build_climate_data(cfg: NetCDFDataConfig, *, lead_steps: int = 1, rollout_steps: int = 1) -> ClimateData:
    """Layout, splits, cached statistics and the two datasets of ``data=netcdf``: train samples
    are ``data.history`` inputs and the step ``lead_steps`` after the last; eval samples carry
    ``rollout_steps`` targets ``lead_steps`` apart (for the task's autoregressive rollout)."""
    layout = build_layout(cfg)
    paths = ", ".join(str(s.path) for s in layout.files)
    train_split, eval_split = split_steps(layout.num_steps, history=cfg.history, eval_fraction=cfg.eval_fraction,
                                          paths=paths, lead_steps=lead_steps, rollout_steps=rollout_steps)
    train_offsets = frame_offsets(cfg.history, lead_steps=lead_steps)
    eval_offsets = frame_offsets(cfg.history, lead_steps=lead_steps, targets=rollout_steps)
    extra = int(train_offsets[-1])
    block = cfg.block_size or auto_block_size(layout, history=extra, block_mb=cfg.block_mb)
    source = ClimateSource(layout, regrid=cfg.resolution is not None, reader=cfg.reader)
    stats = load_or_compute_stats(source, cfg=cfg, train_steps=eval_split.first, block=block + extra)
    log.info(
        "netcdf: %d file(s), %d steps, %d channels on a %dx%d grid; %d train / %d eval samples, blocks of %d",
        len(layout.files), layout.num_steps, layout.num_channels, *layout.grid, train_split.num_samples,
        eval_split.num_samples, block,
    )
    train = ClimateStream(source, stats=stats, split=train_split, history=cfg.history, block_size=block,
                          offsets=train_offsets, prefetch=cfg.prefetch, read_ahead=cfg.read_ahead)
    evaluation = ClimateWindows(source, stats=stats, split=eval_split, history=cfg.history, offsets=eval_offsets)
    return ClimateData(layout=layout, stats=stats, train=train, eval=evaluation, block_size=block,
                       train_steps=eval_split.first)
