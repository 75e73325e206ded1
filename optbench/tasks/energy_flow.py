"""Task ``energy_flow`` (plan 003): a teacher embedding of the input text in, the model's prediction
of the target text's teacher embedding out, trained with the MSE; eval: the loss, the cosine
similarity to the target and the text bridge's accuracy.

A sample is the model's unit of work, so ``tokens_per_sample`` is 1: tokens/s is samples/s and
FLOPs/token are FLOPs/sample (summary.json says so in ``model.energy_flow.throughput_unit`` and ``applied.task.throughput_unit``).

The text bridge decodes a prediction to text: the text of the nearest target embedding of the
whole data file (the bank) by cosine similarity in the teacher space. ``task.bridge=per_sample``
re-runs the model's forward once per sample to get the prediction it decodes, as the plan's code
does; ``batched`` decodes the predictions the training forward already computed (the same
predictions: a test). Both run without gradients (their outputs are texts).
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

from optbench.config import EmbeddingsDataConfig, EnergyFlowTaskConfig, EnergySyntheticDataConfig
from optbench.data.embeddings import (
    PairDataset,
    Pairs,
    load_whole,
    open_pairs,
    split_indices,
    synthetic_pairs,
)
from optbench.errors import ConfigError
from optbench.summary import StepsUsed, TaskRecord
from optbench.tasks.base import Batch, Forward, Losses, Task


def _data_device(device: str) -> torch.device:
    """Where ``data.load=device`` puts the dataset: the device the run trains on."""
    if device == "cpu" or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))


class EnergyFlowTask(Task):
    name = "energy_flow"
    causal = False

    def __init__(self, cfg) -> None:
        super().__init__(cfg)
        task_cfg = cfg.task
        assert isinstance(task_cfg, EnergyFlowTaskConfig)
        self.form = task_cfg
        self.pairs: Pairs | None = None
        self._bank: dict[torch.device, torch.Tensor] = {}
        self._step: dict[str, Any] = {}  # the training step being run: its flow steps, bridge forwards
        self.steps_used: list[float] = []  # per training step, the mean over its micro-steps
        self.bridge_hits: torch.Tensor | None = None  # of the last forward's samples

    # ------------------------------------------------------------------------------- the data
    def load_form(self) -> str:
        """``data.load``, or as the dataloader group says: the baseline loader is the plan's
        whole-dataset-on-the-device load, every other one streams from the mapped file."""
        data = self.cfg.data
        return data.load or ("device" if self.cfg.dataloader.name == "baseline" else "memmap")

    def open_pairs(self) -> Pairs:
        if self.pairs is None:
            data, width = self.cfg.data, self.cfg.model.embed_dim
            if isinstance(data, EmbeddingsDataConfig):
                self.pairs = open_pairs(data.path, width=width)
            elif isinstance(data, EnergySyntheticDataConfig):
                self.pairs = synthetic_pairs(num_samples=data.num_samples, width=width, seed=self.cfg.train.seed)
            else:
                raise ConfigError(f"task=energy_flow reads teacher embeddings; use data=energy_synthetic or "
                                  f"data=embeddings, not data={data.name}")
        return self.pairs

    def build_datasets(self) -> tuple[Dataset, Dataset]:
        pairs = self.open_pairs()
        train, evaluation = split_indices(pairs.count, eval_fraction=self.cfg.data.eval_fraction, source=pairs.source)
        tensor = load_whole(pairs, _data_device(self.cfg.train.device)) if self.load_form() == "device" else None
        return PairDataset(pairs, train, tensor=tensor), PairDataset(pairs, evaluation, tensor=tensor)

    def bank(self, device: torch.device) -> torch.Tensor:
        """Every target embedding of the data, unit length, on ``device`` (the bridge's texts)."""
        if device not in self._bank:
            targets = torch.from_numpy(self.open_pairs().array[:, 1].copy())
            self._bank[device] = F.normalize(targets, dim=-1).to(device)
        return self._bank[device]

    def decode(self, predictions: torch.Tensor) -> torch.Tensor:
        """The bank index of each prediction's nearest target text (cosine similarity)."""
        scores = F.normalize(predictions.float(), dim=-1) @ self.bank(predictions.device).T
        return scores.argmax(dim=-1)

    def texts(self, indices: torch.Tensor) -> list[str]:
        """The target texts of bank ``indices`` (what the bridge decoded)."""
        texts = self.open_pairs().texts
        return [texts[i][1] if i < len(texts) else "" for i in indices.tolist()]

    # ------------------------------------------------------------------------------ the model
    def tokens_per_sample(self) -> int:
        return 1

    def build_embed(self) -> nn.Module:
        return nn.Identity()  # the model maps the embedding itself (optbench.model.energy_flow)

    def build_head(self) -> nn.Module:
        return nn.Identity()

    def inputs(self, batch: Batch) -> torch.Tensor:
        return batch["input"]

    def augment(self, batch: Batch, *, step: int, micro: int) -> Batch:
        if micro == 0:  # a training step begins (eval batches never come through here)
            self._step = {"flow_steps": [], "bridge_forwards": 0}
        return batch

    def forward(self, model: nn.Module, batch: Batch) -> Any:
        x = self.inputs(batch)
        predictions = model(x)
        inner = getattr(model, "module", model)
        if model.training and self._step:
            self._step["flow_steps"].append(int(inner.last_steps))
        if self.form.bridge != "none":
            with torch.no_grad():
                decoded = self._bridge(model, x, predictions)
            self.bridge_hits = decoded == batch["index"].to(decoded.device)
        return predictions

    def _bridge(self, model: nn.Module, x: torch.Tensor, predictions: torch.Tensor) -> torch.Tensor:
        if self.form.bridge == "batched":
            return self.decode(predictions.detach())
        if model.training and self._step:
            self._step["bridge_forwards"] += x.shape[0]
        # the plan's text bridge: the flow forward again, once per sample
        return self.decode(getattr(model, "module", model).bridge(model, x))

    def example_batch(self, micro_batch: int) -> Batch:
        """Random embeddings of the model's width: the trace needs shapes (the dataset a run keeps on the
        device is ``resident_bytes``)."""
        width = self.cfg.model.embed_dim
        return {"input": torch.randn(micro_batch, width), "target": torch.randn(micro_batch, width),
                "index": torch.arange(micro_batch)}

    def resident_bytes(self) -> int:
        """What a run keeps on the device beside the model and the batch: the whole dataset read onto it
        under ``data.load=device`` (every pair's two float32 embeddings, train and eval splits). The
        bridge's bank is built on the first forward, so the traced step builds (and counts) it itself."""
        pairs = self.open_pairs()
        return pairs.count * 2 * pairs.width * 4 if self.load_form() == "device" else 0

    def losses(self, outputs: torch.Tensor, batch: Batch, *, with_aux: bool) -> Losses:
        main = F.mse_loss(outputs.float(), batch["target"].float())
        return Losses(total=main, main=main)

    def describe_aux(self) -> dict:
        return {"aux_loss": None}

    # ---------------------------------------------------------------------------- the records
    def step_record(self) -> dict[str, Any]:
        """The training step just run: the flow steps each micro-step used, the bridge's extra
        forwards (metrics.jsonl ``task``)."""
        record = dict(self._step)
        if record.get("flow_steps"):
            self.steps_used.append(sum(record["flow_steps"]) / len(record["flow_steps"]))
        return record

    def run_record(self) -> TaskRecord:
        """Over the run's training steps (summary.json ``applied.task``)."""
        used, form = self.steps_used, self.form
        steps = (f"flow steps {sum(used) / len(used):.1f} mean [{min(used):g}-{max(used):g}] of max "
                 f"{self.cfg.model.max_steps}") if used else "no training step"
        forms = {"flows": form.flows, "stop": form.stop, "threshold": form.threshold, "patience": form.patience,
                 "bridge": form.bridge, "load": self.load_form(), "max_steps": self.cfg.model.max_steps}
        return TaskRecord(
            mode=f"flows={form.flows} stop={form.stop} bridge={form.bridge} load={self.load_form()}; {steps}",
            forms=forms,
            flow_steps=StepsUsed(mean=sum(used) / len(used), min=min(used), max=max(used), steps=len(used))
            if used else None,
            throughput_unit="samples/s: one sample is one token of tokens/s (and of FLOPs/token)")

    def eval_metrics(self, outputs: torch.Tensor, batch: Batch, *, model: Forward) -> dict[str, Any]:
        cosine = F.cosine_similarity(outputs.float(), batch["target"].float().to(outputs.device), dim=-1)
        metrics = {"cosine": cosine.sum(), "samples": cosine.numel()}
        if self.bridge_hits is not None:
            metrics["bridge_hits"] = self.bridge_hits.sum()
        return metrics

    def finalize_eval_metrics(self, sums: dict[str, Any]) -> dict[str, float]:
        count = max(1, int(sums.get("samples", 0)))
        out = {"cosine": float(sums["cosine"]) / count}
        if "bridge_hits" in sums:
            out["bridge_accuracy"] = float(sums["bridge_hits"]) / count
        return out
