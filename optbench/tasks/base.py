"""What a task contributes to a run: the input embedding, the output head, its datasets, and its
losses. The trunk (``optbench.model.Transformer``) and the loop are shared by every task."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset

from optbench.config import Config

Batch = dict[str, torch.Tensor]


@dataclass
class Losses:
    """``total`` is what backward() sees; ``main`` is the task's loss (what is reported as the
    run's loss); ``aux`` holds the auxiliary terms, already weighted, when they were computed."""

    total: torch.Tensor
    main: torch.Tensor
    aux: dict[str, torch.Tensor] = field(default_factory=dict)


class Task(ABC):
    name: str
    causal: bool

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg

    @abstractmethod
    def tokens_per_sample(self) -> int:
        """Sequence length the trunk sees per sample (the T of FLOPs and tokens/s)."""

    @abstractmethod
    def build_embed(self) -> nn.Module: ...

    @abstractmethod
    def build_head(self) -> nn.Module: ...

    @abstractmethod
    def build_datasets(self) -> tuple[Dataset, Dataset]:
        """(train, eval) datasets: map-style ones whose items collate into a ``Batch``, or for
        train a streaming ``IterableDataset`` with ``shard(rank=, world_size=, seed=, start=,
        batch_size=)`` that yields whole batches (see ``build_train_loader``)."""

    @abstractmethod
    def inputs(self, batch: Batch) -> torch.Tensor:
        """The tensor the model's forward takes."""

    @abstractmethod
    def losses(self, outputs: torch.Tensor, batch: Batch, *, with_aux: bool) -> Losses: ...

    def augment(self, batch: Batch, *, step: int, micro: int) -> Batch:
        """The training batch as the model should see it, on its device (data augmentation
        seeded by ``step`` and ``micro``); eval batches are never augmented. Default: unchanged."""
        return batch

    def describe_aux(self) -> dict[str, Any]:
        """How this task's auxiliary loss uses ``loss_freq.num_queries`` (for summary.json
        ``applied.loss_freq``); empty when the task has no auxiliary loss."""
        return {}

    def eval_metrics(self, outputs: torch.Tensor, batch: Batch) -> dict[str, Any]:
        """Sums over one eval batch (tensors or numbers); the caller adds them up over the eval
        batches and hands the totals to ``finalize_eval_metrics``. The lm task has none."""
        return {}

    def finalize_eval_metrics(self, sums: dict[str, Any]) -> dict[str, float]:
        """The reported eval metrics from the summed ``eval_metrics`` (e.g. an NRMSE needs the
        squared errors and the normalizer summed over all batches). Default: the sums."""
        return {key: float(value) for key, value in sums.items()}
