"""Task ``climate_text``: a language model that reads climate — the plans' "LLM integrated with
climate datacubes" (``data=netcdf data.text=PAIRS.jsonl``, ``fusion=add|cross_attention|gated|prefix``).

A sample is a climate history window and a text of one of its steps (``optbench.data.paired``):
the last input step for captions of ``--mode describe`` (the default: what the model is shown),
the target for ``--mode forecast`` (``task.text_mode``; by default the captions' sidecar's mode).
The decoder is the base language model: optbench's own over byte tokens (the ``lm`` task's
embedding and head), or with ``model=hf`` a pretrained transformers model over its own tokenizer's
tokens (``data.tokenizer``, by default the ``model.hf.config`` directory's; the fusion goes in
through ``optbench.model.hf_fusion``);
the climate window goes through the climate task's patch embedding into the climate encoder of
``optbench.model.fusion`` and reaches the decoder through the fusion layers (``Task.forward`` passes it
as ``model(tokens, context=climate)``). The loss is the next-token cross-entropy over the real
text tokens (padding excluded).

Evaluation scores ``task.eval_samples`` samples spread evenly over the eval split (all of them
when it holds fewer; every evaluation, whatever ``train.eval_batches``), three ways (``fusion/...``
in ``summary.json``'s ``loss.eval_metrics``): ``loss_true`` with each sample's own climate,
``loss_shuffled`` with the climate of another eval sample (a seeded random derangement: never its
own; ``task.shuffle_offset`` > 0: the sample that many places further, refused where that is
itself), and ``loss_base`` with the decoder alone (no climate: for ``gated`` at initialization, or
over a frozen base, the base model). All are per token. ``loss_gap`` = shuffled - true, per token,
with ``loss_gap_low``/``loss_gap_high`` its block-bootstrap 95% interval over time blocks of eval
samples and ``loss_gap_stderr`` the bootstrap's standard error (``optbench.tasks.text_scores``):
an interval above 0 means the model uses the climate it is given. ``task.text_only=true`` is the
control: the same model trained and evaluated with an all-zero climate; the information gain is
its loss minus the true-climate loss (``make fusion-matrix`` pairs them sample by sample).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

from optbench.config import ClimateTextTaskConfig, NetCDFDataConfig
from optbench.errors import ConfigError
from optbench.tasks.base import Batch, Forward, Losses, Task
from optbench.tasks.climate import build_patch_embed, check_patching, patch_tokens

IGNORE = -100


def text_codec(cfg) -> Any:
    """The ``TextCodec`` of ``data.tokenizer``: a tokenizer.json (or a directory holding one),
    ``bytes``, or null: the model's own tokenizer (``ModelConfig.own_tokenizer``: the
    ``model.hf.config`` directory's for ``model=hf``), bytes for a model that brings none."""
    from optbench.data.paired import BYTES, tokenizer_codec

    source = cfg.data.tokenizer
    if source is None:
        source = cfg.model.own_tokenizer()
    if source is None or source == "bytes":
        return BYTES
    return tokenizer_codec(source)


class ClimateTextTask(Task):
    name = "climate_text"
    causal = True

    def __init__(self, cfg) -> None:
        super().__init__(cfg)
        task_cfg = cfg.task
        assert isinstance(task_cfg, ClimateTextTaskConfig)
        self.task_cfg = task_cfg
        self.eval_size = 0  # eval samples (build_datasets)
        if task_cfg.climate_shape is not None:
            self._from_shape(task_cfg.climate_shape)
            return
        data = cfg.data
        if not isinstance(data, NetCDFDataConfig) or data.text is None:
            raise ConfigError(
                "task=climate_text reads NetCDF climate paired with text: use data=netcdf data.paths=[data.nc] "
                "data.text=captions.jsonl (`optbench data captions data.nc captions.jsonl` writes one)"
            )
        if data.augment.enabled:
            raise ConfigError(
                "task=climate_text with data.augment.enabled=true would change the climate the text describes "
                "(a longitude roll moves every location it names); set data.augment.enabled=false"
            )
        if cfg.fusion.name == "none":
            raise ConfigError("task=climate_text needs a way for the decoder to read the climate: "
                              "fusion=add, fusion=cross_attention, fusion=gated or fusion=prefix")
        self.history = data.history
        from optbench.data.netcdf import build_climate_data
        from optbench.data.paired import check_coverage, read_text_pairs

        self.spec, self.text_mode = text_spec(data, task_cfg)
        self.text_offset = self.history - 1 if self.text_mode == "describe" else self.history
        self.data = build_climate_data(data)
        layout = self.data.layout
        self.grid, self.channels = layout.grid, layout.channels
        self.pairs = read_text_pairs(data.text, times=layout.times)
        check_coverage(self.pairs, splits=(self.data.train.split, self.data.eval.split), offset=self.text_offset,
                       times=layout.times, path=data.text)
        check_patching(self.data, grid=self.grid, cfg=cfg)

    def _from_shape(self, shape: list[int]) -> None:
        """``task.climate_shape``: the climate input's shapes without a file (``optbench estimate``)."""
        if self.cfg.fusion.name == "none":
            raise ConfigError("task=climate_text needs a way for the decoder to read the climate: "
                              "fusion=add, fusion=cross_attention, fusion=gated or fusion=prefix")
        self.history, channels, lat, lon = shape
        self.grid, self.channels = (lat, lon), [f"channel {i}" for i in range(channels)]
        self.spec, self.text_mode, self.data, self.pairs = None, self.task_cfg.text_mode or "describe", None, {}
        self.text_offset = self.history - 1 if self.text_mode == "describe" else self.history
        if self.task_cfg.patch_size > min(self.grid):
            raise ConfigError(f"task.patch_size={self.task_cfg.patch_size} is larger than the {lat}x{lon} grid; lower it")

    # --- model pieces ----------------------------------------------------------------------------
    def tokens_per_sample(self) -> int:
        return self.cfg.train.seq_len

    def context_tokens(self) -> int:
        """Climate patch tokens per sample."""
        return patch_tokens(self.grid, self.task_cfg.patch_size)

    def build_embed(self) -> nn.Module:
        return nn.Embedding(self.cfg.model.vocab_size, self.cfg.model.dim)

    def build_head(self) -> nn.Module:
        return nn.Linear(self.cfg.model.dim, self.cfg.model.vocab_size, bias=False)

    def build_fusion(self, *, attention, rope: bool = False) -> nn.Module:
        """The climate encoder and fusion layers of ``cfg.fusion`` (``model.fusion``); ``rope``:
        with the encoder's own RoPE tables (over a decoder that has none to lend: ``model=hf``)."""
        from optbench.model.fusion import Fusion
        embed = build_patch_embed(self.cfg, history=self.history, channels=len(self.channels), grid=self.grid)
        return Fusion(self.cfg.model, self.cfg.fusion, embed=embed, num_tokens=self.context_tokens(),
                      attention=attention, rope=rope)

    @functools.cached_property
    def codec(self) -> Any:
        """How the texts become tokens (``text_codec``), checked against the model's vocabulary:
        resolved when the texts are first needed (the estimate's trace needs none)."""
        codec = text_codec(self.cfg)
        if self.cfg.model.vocab_size < codec.vocab_size:
            raise ConfigError(f"task=climate_text tokenizes its texts with {codec.name} ({codec.vocab_size:,} token "
                              f"ids) but model.vocab_size={self.cfg.model.vocab_size:,}; give data.tokenizer the "
                              f"model's own tokenizer, or set {self.cfg.model.vocab_key()}={codec.vocab_size} or more "
                              "(a model trained from scratch)")
        return codec

    @functools.cached_property
    def table(self) -> Any:
        """Every time step's text in tokens (``optbench.data.paired.TextTable``)."""
        from optbench.data.paired import TextTable

        return TextTable(self.pairs, num_steps=self.data.layout.num_steps, seq_len=self.cfg.train.seq_len,
                         codec=self.codec)

    def build_datasets(self) -> tuple[Dataset, Dataset]:
        from optbench.data.paired import PairedStream, PairedWindows
        if self.data is None:
            raise ConfigError("task.climate_shape describes the climate input for optbench estimate only; to train, "
                              "drop it and give data=netcdf data.paths=[data.nc] data.text=captions.jsonl")
        from optbench.tasks.text_scores import partners, strided

        positions = strided(len(self.data.eval), self.task_cfg.eval_samples)
        self.eval_size = len(positions)
        others = partners(len(positions), seed=self.cfg.train.seed, offset=self.task_cfg.shuffle_offset)
        return (PairedStream(self.data.train, self.table, offset=self.text_offset),
                PairedWindows(self.data.eval, self.table, offset=self.text_offset, positions=positions,
                              partners=others))

    def eval_count(self, dataset: Dataset) -> int:
        """Every eval sample (``task.eval_samples`` spread over the split), whatever ``train.eval_batches``."""
        return len(dataset)  # type: ignore[arg-type]

    def example_batch(self, micro_batch: int) -> Batch:
        """A batch of this task's shapes and dtypes (the memory trace needs no more): zero tokens of
        full length and zero climate (and the sample indices a loaded batch carries), so an estimate
        reads no text and needs no tokenizer."""
        return {**self.meta_batch(micro_batch, device="cpu"), "sample": torch.zeros(micro_batch, dtype=torch.long)}

    def fake_batch(self, micro_batch: int, fake_mode: Any) -> Batch:
        """``example_batch`` made under ``fake_mode``: FakeTensors of its shapes, nothing allocated."""
        with fake_mode:
            return self.example_batch(micro_batch)

    # --- batches -----------------------------------------------------------------------------------
    def inputs(self, batch: Batch) -> torch.Tensor:
        return batch["tokens"][:, :-1]

    def context(self, batch: Batch) -> torch.Tensor:
        """The climate the model reads: the sample's history window (all zeros for the
        ``text_only`` control)."""
        frames = batch["frames"][:, : self.history]
        return torch.zeros_like(frames) if self.task_cfg.text_only else frames.nan_to_num(0.0)

    def forward(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        return model(self.inputs(batch), context=self.context(batch))

    def meta_batch(self, batch_size: int, *, device: torch.device | str = "meta") -> Batch:
        """A batch of this task's shapes (for FLOP counting on the meta device)."""
        seq = self.cfg.train.seq_len
        return {
            "tokens": torch.zeros(batch_size, seq + 1, dtype=torch.long, device=device),
            "length": torch.full((batch_size,), seq + 1, dtype=torch.long, device=device),
            "frames": torch.zeros(batch_size, self.history + 1, len(self.channels), *self.grid, device=device),
        }

    def _targets(self, batch: Batch) -> torch.Tensor:
        targets = batch["tokens"][:, 1:]
        position = torch.arange(targets.shape[1], device=targets.device)[None, :]
        return targets.masked_fill(position + 1 >= batch["length"][:, None], IGNORE)

    def losses(self, outputs: torch.Tensor, batch: Batch, *, with_aux: bool) -> Losses:
        main = F.cross_entropy(outputs.float().flatten(0, 1), self._targets(batch).flatten(), ignore_index=IGNORE)
        return Losses(total=main, main=main)

    def head_saved_bytes(self, tokens: int, *, low_precision: bool) -> int:
        """As the lm task's head (the same head and loss over the same vocabulary)."""
        from optbench.tasks.lm import LMTask

        return LMTask.head_saved_bytes(self, tokens, low_precision=low_precision)

    def describe_aux(self) -> dict[str, Any]:
        return {"aux_loss": None}

    # --- evaluation --------------------------------------------------------------------------------
    def _sample_nll(self, outputs: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per sample: summed token NLL (float64) and the number of real targets."""
        nll = F.cross_entropy(outputs.float().transpose(1, 2), targets, ignore_index=IGNORE, reduction="none")
        return nll.double().sum(1), (targets != IGNORE).sum(1).double()

    def shuffled_context(self, batch: Batch) -> torch.Tensor:
        """Another time's climate for each sample (the eval set's ``frames_shuffled``)."""
        return batch["frames_shuffled"][:, : self.history].nan_to_num(0.0)

    def eval_metrics(self, outputs: torch.Tensor, batch: Batch, *, model: Forward | None = None) -> dict[str, Any]:
        """Per eval sample (vectors over the eval set, zero where another batch holds the sample, so
        that the loop's sums over batches fill them): the summed token NLL with the true climate,
        the shuffled climate (not for the ``text_only`` control) and no climate (extra forwards
        of ``model``), and the number of real targets."""
        if model is None:
            raise TypeError("ClimateTextTask.eval_metrics needs the model to run the shuffled and base forwards")
        targets = self._targets(batch)
        true_nll, count = self._sample_nll(outputs, targets)
        per = {"nll_true": true_nll, "targets": count}
        with torch.no_grad():
            per["nll_base"] = self._sample_nll(model(self.inputs(batch)), targets)[0]
            if not self.task_cfg.text_only:
                shuffled = model(self.inputs(batch), context=self.shuffled_context(batch))
                per["nll_shuffled"] = self._sample_nll(shuffled, targets)[0]
        index = batch["eval_index"].cpu()
        sums = {}
        for key, values in per.items():
            full = torch.zeros(self.eval_size, dtype=torch.float64)
            full[index] = values.detach().cpu().double()
            sums[key] = full
        return sums

    def finalize_eval_metrics(self, sums: dict[str, Any]) -> dict[str, float]:
        """Per-token losses over the eval samples, and the gap shuffled - true (per token) with its
        block-bootstrap 95% interval and standard error (``optbench.tasks.text_scores``)."""
        if not sums:
            return {}
        from optbench.tasks.text_scores import block_bootstrap

        s = {k: torch.as_tensor(v).double().numpy() for k, v in sums.items()}
        seen = s["targets"] > 0
        tokens = s["targets"][seen]
        total = max(float(tokens.sum()), 1.0)
        out = {"fusion/loss_true": float(s["nll_true"][seen].sum()) / total,
               "fusion/loss_base": float(s["nll_base"][seen].sum()) / total,
               "fusion/eval_samples": float(seen.sum()), "fusion/eval_tokens": float(tokens.sum())}
        if "nll_shuffled" in s:  # "fusion/...": one line of the printed summary
            gap = block_bootstrap(s["nll_shuffled"][seen] - s["nll_true"][seen], tokens, seed=self.cfg.train.seed)
            out.update({"fusion/loss_shuffled": float(s["nll_shuffled"][seen].sum()) / total,
                        "fusion/loss_gap": gap["value"], "fusion/loss_gap_low": gap["low"],
                        "fusion/loss_gap_high": gap["high"], "fusion/loss_gap_stderr": gap["stderr"]})
        return out


def text_spec(data: NetCDFDataConfig, task_cfg: ClimateTextTaskConfig) -> tuple[Any, str]:
    """The captions' spec (their sidecar; None for a user's own texts) and the text mode: which
    step of a sample its text is of. A sidecar written for another mode, history or eval split
    than this run's is refused (its trends or its climatology would not be this run's)."""
    from optbench.data.captions import read_spec

    spec = read_spec(data.text)
    mode = task_cfg.text_mode or (spec.mode if spec is not None else "describe")
    if spec is None:
        return None, mode
    if spec.mode != mode:
        raise ConfigError(f"data.text={data.text} was written with --mode {spec.mode} (its .json sidecar) but "
                          f"task.text_mode={mode}; set task.text_mode={spec.mode} (or null), or write the captions "
                          f"with --mode {mode}")
    if (spec.history, spec.eval_fraction) != (data.history, data.eval_fraction):
        raise ConfigError(f"data.text={data.text} was written for data.history={spec.history} data.eval_fraction="
                          f"{spec.eval_fraction} (its .json sidecar) but this run has data.history={data.history} "
                          f"data.eval_fraction={data.eval_fraction}; write the captions again with --history "
                          f"{data.history} --eval-fraction {data.eval_fraction}, or use the captions' values")
    return spec, mode
