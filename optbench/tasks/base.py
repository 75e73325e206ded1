"""What a task contributes to a run: the input embedding, the output head, its datasets, and its
losses. The trunk (``optbench.model.transformer.Transformer``) and the loop are shared by every task."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset, IterableDataset, default_collate

from optbench.config import Config
from optbench.summary import TaskRecord

Batch = dict[str, torch.Tensor]
# the model's forward as the run calls it (under its precision policy): what an eval metric that needs
# more forwards is handed (``Task.eval_metrics``); a module, outside a run
Forward = Callable[..., Any]


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

    def forward(self, model: nn.Module, batch: Batch) -> Any:
        """The model's outputs for ``batch``: what training, evaluation and the memory trace call.
        Default: ``model(self.inputs(batch))``; a task whose model takes more (a climate context
        beside the text) overrides it."""
        return model(self.inputs(batch))

    @abstractmethod
    def losses(self, outputs: torch.Tensor, batch: Batch, *, with_aux: bool) -> Losses: ...

    def example_batch(self, micro_batch: int) -> Batch:
        """One training micro-batch of ``micro_batch`` samples, for the memory trace (which turns it
        into FakeTensors): the first batch of a streaming training set, or its first samples
        collated."""
        train_set, _ = self.build_datasets()
        if isinstance(train_set, IterableDataset):
            stream = train_set.shard(rank=0, world_size=1, seed=self.cfg.train.seed, start=0, batch_size=micro_batch)
            return next(iter(stream))
        return default_collate([train_set[i % len(train_set)] for i in range(micro_batch)])

    def fake_batch(self, micro_batch: int, fake_mode: Any) -> Batch:
        """``example_batch`` as FakeTensors of ``fake_mode`` (the memory trace's input), built from
        shapes: nothing of the batch's size is allocated. Default: one real sample (or the stream's
        first batch of one) gives each tensor's shape and dtype, the batch is ``micro_batch`` of them."""
        one = self.example_batch(1)
        with fake_mode:
            return {key: torch.empty((micro_batch, *value.shape[1:]), dtype=value.dtype) for key, value in one.items()}

    def head_saved_bytes(self, tokens: int, *, low_precision: bool) -> int:
        """Bytes the output head and the loss keep for backward over ``tokens`` tokens, for the
        closed-form estimate (the trace measures them). Default 0: not modeled."""
        return 0

    def augment(self, batch: Batch, *, step: int, micro: int) -> Batch:
        """The training batch as the model should see it, on its device (data augmentation
        seeded by ``step`` and ``micro``); eval batches are never augmented. Default: unchanged."""
        return batch

    def describe_aux(self) -> dict[str, Any]:
        """How this task's auxiliary loss uses ``loss_freq.num_queries`` (for summary.json
        ``applied.loss_freq``); empty when the task has no auxiliary loss."""
        return {}

    def eval_count(self, dataset: Dataset) -> int:
        """How many samples of the eval ``dataset`` every evaluation scores (the first ones, in
        ``train.eval_batches`` batches). A task whose eval set is its own selection (climate_text's
        samples spread over the split) scores all of it."""
        return min(self.cfg.train.eval_batches * self.cfg.train.batch_size, len(dataset))  # type: ignore[arg-type]

    def eval_metrics(self, outputs: torch.Tensor, batch: Batch, *, model: Forward) -> dict[str, Any]:
        """Sums over one eval batch (tensors or numbers); the caller adds them up over the eval
        batches and hands the totals to ``finalize_eval_metrics``. ``model`` is there for metrics
        that need more forwards (e.g. the same text with its climate input shuffled): the run hands
        its forward under the precision policy (``optbench.training.step.evaluate``), so a task
        never applies the policy itself. The lm task has none."""
        return {}

    def finalize_eval_metrics(self, sums: dict[str, Any]) -> dict[str, float]:
        """The reported eval metrics from the summed ``eval_metrics`` (e.g. an NRMSE needs the
        squared errors and the normalizer summed over all batches). Default: the sums."""
        return {key: float(value) for key, value in sums.items()}

    def resident_bytes(self) -> int:
        """Bytes the task keeps on the training device through every step, outside the model and the
        batch (task=energy_flow: the whole dataset under ``data.load=device``).
        A run holds them, so its measured peak does; the estimate adds them to its ``other`` (inputs,
        buffers). Default: none."""
        return 0

    def step_record(self) -> dict[str, Any]:
        """What the task recorded of the training step just run (metrics.jsonl ``task``; called once
        per step by the loop). Default: nothing."""
        return {}

    def run_record(self) -> TaskRecord | None:
        """What the task ran and recorded over the run's training steps (summary.json ``applied.task``).
        Default: nothing."""
        return None
