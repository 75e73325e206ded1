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
        """(train, eval) map-style datasets whose items collate into a ``Batch``."""

    @abstractmethod
    def inputs(self, batch: Batch) -> torch.Tensor:
        """The tensor the model's forward takes."""

    @abstractmethod
    def losses(self, outputs: torch.Tensor, batch: Batch, *, with_aux: bool) -> Losses: ...

    def describe_aux(self) -> dict[str, Any]:
        """How this task's auxiliary loss uses ``loss_freq.num_queries`` (for summary.json
        ``applied.loss_freq``); empty when the task has no auxiliary loss."""
        return {}

    def eval_metrics(self, outputs: torch.Tensor, batch: Batch) -> dict[str, Any]:
        """Extra per-batch eval metrics (summed over batches by the caller with their counts);
        the lm task has none beyond the loss."""
        return {}
