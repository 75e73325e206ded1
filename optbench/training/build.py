"""The builders every consumer of a config shares: ``optbench train``, ``optbench estimate`` (the
memory trace), the benches and the tests. Each turns typed config into one object, the same way for
all of them, so that what the estimate traces is what training runs."""

from __future__ import annotations

import random

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, IterableDataset

from optbench.config import Config
from optbench.data.loader import TrainLoader, loader_kwargs
from optbench.data.sampler import ShardedSampler
from optbench.distributed import Machine
from optbench.errors import ConfigError
from optbench.tasks import Batch, Task
from optbench.training.data_parallel import build_sharded_grad_scaler, maybe_full_tensor_init
from optbench.training.kinds import model_spec
from optbench.training.precision import build_grad_scaler


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def build_model(cfg: Config, task: Task) -> nn.Module:
    """The full model on the meta device, nothing allocated: the kind's ``build``
    (``optbench.training.kinds``; a fused model's base frozen as ``fusion.freeze_base`` says)."""
    return model_spec(cfg).build(cfg, task)


def materialize(model: nn.Module, *, device: torch.device, seed: int) -> None:
    """Allocate on ``device`` and initialize deterministically from ``seed``."""
    model.to_empty(device=device)
    torch.manual_seed(seed)
    with maybe_full_tensor_init(model):  # FSDP2: the same weights as unsharded for the same seed
        model.init_weights()


def build_scaler(cfg: Config, *, device: torch.device) -> torch.amp.GradScaler | None:
    """fp16's dynamic loss scaler (None otherwise); under FSDP2 the sharded one, whose ranks agree
    on skipping an overflowed step."""
    scaler = build_grad_scaler(cfg.precision, device=device)
    if scaler is not None and cfg.parallel.name == "fsdp2":
        return build_sharded_grad_scaler(device=device)
    return scaler


def build_train_loader(dataset: Dataset, *, cfg: Config, machine: Machine, start: int = 0) -> DataLoader:
    """This rank's training batches, from sample ``start`` of its shard (a resumed run's)."""
    dl = cfg.dataloader
    _refuse_fewer_samples_than_a_batch(dataset, cfg=cfg, machine=machine)

    if isinstance(dataset, IterableDataset):
        # a streaming dataset (data=netcdf) shards itself over ranks and workers and yields whole
        # batches read in blocks; start = samples this rank already consumed (for resume)
        kwargs = loader_kwargs(dl, device=machine.device)
        # without workers the stream gathers straight into page-locked memory (no pinning copy)
        stream = dataset.shard(rank=machine.rank, world_size=machine.world_size, seed=cfg.train.seed,
                               start=start, batch_size=cfg.train.batch_size,
                               pin_memory=kwargs["pin_memory"] and not kwargs["num_workers"])
        return TrainLoader(stream, batch_size=None, **kwargs)
    sampler = ShardedSampler(len(dataset), seed=cfg.train.seed, shuffle=True, rank=machine.rank,
                             world_size=machine.world_size, start=start)
    return TrainLoader(
        dataset,
        batch_size=cfg.train.batch_size,
        sampler=sampler,
        drop_last=True,
        **loader_kwargs(dl, device=machine.device),
        # its own generator (worker seeds): the global RNG stream, which a checkpoint restores, is
        # then the same whether the loader was created at step 0 or on resume
        generator=torch.Generator().manual_seed(cfg.train.seed),
    )


def _refuse_fewer_samples_than_a_batch(dataset: Dataset, *, cfg: Config, machine: Machine) -> None:
    """ConfigError when a rank's share of the training split is smaller than a batch: the endless
    sampler (or a stream, data=netcdf) would fill every batch with repeats."""
    split = getattr(dataset, "split", None) if isinstance(dataset, IterableDataset) else None
    total = split.num_samples if split is not None else None if isinstance(dataset, IterableDataset) else len(dataset)
    if total is None:  # a stream that does not say its length
        return
    per_rank = total // machine.world_size
    if per_rank < cfg.train.batch_size:
        ranks = f" ({per_rank} per rank over {machine.world_size} ranks)" if machine.world_size > 1 else ""
        raise ConfigError(
            f"the training split holds {total} sample(s){ranks} but train.batch_size={cfg.train.batch_size}: "
            f"every batch would repeat samples; lower train.batch_size to at most {max(per_rank, 1)}"
            + (" (and use fewer ranks)" if per_rank == 0 else "") + ", or use more data"
        )


def fixed_eval_batches(dataset: Dataset, *, cfg: Config, count: int) -> list[Batch]:
    """The same held-out batches for every evaluation of the run (and of every run): the first
    ``count`` samples (``Task.eval_count``)."""
    loader = DataLoader(torch.utils.data.Subset(dataset, range(count)), batch_size=cfg.train.batch_size,
                        generator=torch.Generator().manual_seed(cfg.train.seed))  # leaves the global RNG alone
    return list(loader)


def to_device(batch: Batch, device: torch.device) -> Batch:
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}
