"""Task ``lm``: next-token prediction over a token vocabulary."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

from optbench.config import LMTaskConfig, SyntheticDataConfig, TokensDataConfig
from optbench.errors import ConfigError
from optbench.tasks.base import Batch, Losses, Task


class LMTask(Task):
    """The auxiliary loss is a z-loss, mean(logsumexp(logits)^2), over ``loss_freq.num_queries``
    token positions of each micro-batch drawn without replacement (all positions when there are
    fewer), from a generator seeded with ``train.seed``: the plan's query sampling, applied to the
    positions the z-loss sees."""

    name = "lm"
    causal = True

    def __init__(self, cfg) -> None:
        super().__init__(cfg)
        self._query_rng = torch.Generator().manual_seed(cfg.train.seed)

    def aux_positions(self) -> int:
        """Token positions per micro-batch the z-loss is computed over."""
        return min(self.cfg.loss_freq.num_queries, self.cfg.train.batch_size * self.cfg.train.seq_len)

    def describe_aux(self) -> dict:
        task_cfg = self.cfg.task
        assert isinstance(task_cfg, LMTaskConfig)
        if task_cfg.z_loss_weight == 0:
            return {"aux_loss": None}
        return {"aux_loss": "z_loss", "positions_per_micro_batch": self.aux_positions(),
                "of_positions": self.cfg.train.batch_size * self.cfg.train.seq_len}

    def _sampled(self, logits: torch.Tensor) -> torch.Tensor:
        flat = logits.flatten(0, 1)
        count = min(self.cfg.loss_freq.num_queries, flat.shape[0])
        if count == flat.shape[0]:
            return flat
        index = torch.randperm(flat.shape[0], generator=self._query_rng)[:count]
        return flat[index.to(flat.device)]

    def tokens_per_sample(self) -> int:
        return self.cfg.train.seq_len

    def build_embed(self) -> nn.Module:
        return nn.Embedding(self.cfg.model.vocab_size, self.cfg.model.dim)

    def build_head(self) -> nn.Module:
        return nn.Linear(self.cfg.model.dim, self.cfg.model.vocab_size, bias=False)

    def build_datasets(self) -> tuple[Dataset, Dataset]:
        data = self.cfg.data
        seq_len = self.cfg.train.seq_len
        if isinstance(data, SyntheticDataConfig):
            from optbench.data.synthetic import SyntheticTokens

            def make(split: str) -> SyntheticTokens:
                return SyntheticTokens(
                    vocab_size=self.cfg.model.vocab_size,
                    seq_len=seq_len,
                    seed=self.cfg.train.seed,
                    split=split,
                    branching=data.branching,
                    noise=data.noise,
                    num_samples=data.num_samples,
                )

            return make("train"), make("eval")
        if isinstance(data, TokensDataConfig):
            from optbench.data.tokens import TokenFile

            train = TokenFile(data.path, seq_len=seq_len, split="train", dtype=data.dtype,
                              eval_fraction=data.eval_fraction)
            if train.vocab_size > self.cfg.model.vocab_size:
                raise ConfigError(
                    f"{data.path} holds token ids up to {train.vocab_size - 1} but model.vocab_size="
                    f"{self.cfg.model.vocab_size}; set model.vocab_size={train.vocab_size} or more"
                )
            evaluation = TokenFile(data.path, seq_len=seq_len, split="eval", dtype=data.dtype,
                                   eval_fraction=data.eval_fraction)
            return train, evaluation
        raise ConfigError(f"task=lm reads token data; use data=synthetic or data=tokens, not data={data.name}")

    def inputs(self, batch: Batch) -> torch.Tensor:
        return batch["tokens"][:, :-1]

    def example_batch(self, micro_batch: int) -> Batch:
        """Random token ids: the trace needs shapes, and building a dataset would read its file."""
        return {"tokens": torch.randint(0, self.cfg.model.vocab_size, (micro_batch, self.cfg.train.seq_len + 1))}

    def head_saved_bytes(self, tokens: int, *, low_precision: bool) -> int:
        """The loss keeps the logits: the head's output (autocast's dtype), its fp32 copy and the
        fp32 log-softmax; without autocast the output and the log-softmax."""
        vocab = self.cfg.model.vocab_size
        return tokens * vocab * ((2 + 4 + 4) if low_precision else 8)

    def losses(self, outputs: torch.Tensor, batch: Batch, *, with_aux: bool) -> Losses:
        targets = batch["tokens"][:, 1:]
        logits = outputs.float()
        main = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        aux: dict[str, torch.Tensor] = {}
        task_cfg = self.cfg.task
        assert isinstance(task_cfg, LMTaskConfig)
        if with_aux and task_cfg.z_loss_weight > 0:
            aux["z_loss"] = task_cfg.z_loss_weight * torch.logsumexp(self._sampled(logits), dim=-1).square().mean()
        total = main + sum(aux.values()) if aux else main
        return Losses(total=total, main=main, aux=aux)
