"""Task ``lm``: next-token prediction over a token vocabulary."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

from optbench.config import LMTaskConfig, SyntheticDataConfig, TokensDataConfig
from optbench.errors import ConfigError
from optbench.tasks.base import Batch, Losses, Task


class _CrossEntropyAndLogsumexp(torch.autograd.Function):
    """Forward: log_softmax once, the mean NLL, and each row's logsumexp read back from one column
    (log_softmax(x) = x - logsumexp(x)). Backward: one pass, softmax(x) * (g_ce / n + g_lse) minus
    g_ce / n at each target, the gradient of both outputs together (what cross-entropy's own
    backward costs)."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        log_probs = F.log_softmax(logits, dim=-1)
        ce = F.nll_loss(log_probs, targets)
        ctx.save_for_backward(log_probs, targets)
        return ce, logits[:, 0] - log_probs[:, 0]

    @staticmethod
    def backward(ctx, grad_ce: torch.Tensor, grad_lse: torch.Tensor) -> tuple[torch.Tensor, None]:
        log_probs, targets = ctx.saved_tensors
        rows = log_probs.shape[0]
        per_row = (grad_ce / rows).expand(rows) + grad_lse
        grad = log_probs.exp().mul_(per_row[:, None])
        grad[torch.arange(rows, device=grad.device), targets] -= grad_ce / rows
        return grad, None


def cross_entropy_and_logsumexp(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean cross-entropy, per-row logsumexp) of (rows, vocab) logits, at cross-entropy's cost."""
    return _CrossEntropyAndLogsumexp.apply(logits, targets)


class LMTask(Task):
    """The auxiliary loss is a z-loss, mean(logsumexp(logits)^2), over ``loss_freq.num_queries``
    token positions of each micro-batch drawn without replacement (all positions when there are
    fewer), from a generator seeded with ``train.seed``: the plan's query sampling, applied to the
    positions the z-loss sees.

    The z-loss costs no extra pass over the vocabulary (``cross_entropy_and_logsumexp``): a separate
    ``torch.logsumexp`` over the logits nearly tripled the loss's cost. ``task.z_loss_weight=0``
    turns the term off."""

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

    def _sampled(self, flat: torch.Tensor) -> torch.Tensor:
        """``num_queries`` rows of ``flat`` (one row per token position)."""
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
            from optbench.data.markov import SyntheticTokens

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
            from optbench.data.tokens import TokenFile, check_vocab

            train = TokenFile(data.path, seq_len=seq_len, split="train", dtype=data.dtype,
                              eval_fraction=data.eval_fraction)
            check_vocab(train, path=data.path, model_vocab=self.cfg.model.vocab_size, vocab_key=self.cfg.model.vocab_key())
            evaluation = TokenFile(data.path, seq_len=seq_len, split="eval", dtype=data.dtype,
                                   eval_fraction=data.eval_fraction)
            return train, evaluation
        raise ConfigError(f"task=lm reads token data; use data=synthetic or data=tokens, not data={data.name}")

    def inputs(self, batch: Batch) -> torch.Tensor:
        return batch["tokens"][:, :-1]

    def example_batch(self, micro_batch: int) -> Batch:
        """Random token ids: the trace needs shapes, and building a dataset would read its file."""
        return {"tokens": torch.randint(0, self.cfg.model.vocab_size, (micro_batch, self.cfg.train.seq_len + 1))}

    def fake_batch(self, micro_batch: int, fake_mode: Any) -> Batch:
        """``example_batch`` made under ``fake_mode``: FakeTensors of its shapes, nothing allocated."""
        with fake_mode:
            return self.example_batch(micro_batch)

    def head_saved_bytes(self, tokens: int, *, low_precision: bool) -> int:
        """The loss keeps the logits: the head's output (autocast's dtype), its fp32 copy and the
        fp32 log-softmax; without autocast the output and the log-softmax."""
        vocab = self.cfg.model.vocab_size
        return tokens * vocab * ((2 + 4 + 4) if low_precision else 8)

    def losses(self, outputs: torch.Tensor, batch: Batch, *, with_aux: bool) -> Losses:
        targets = batch["tokens"][:, 1:]
        logits = outputs.float().flatten(0, 1)
        aux: dict[str, torch.Tensor] = {}
        task_cfg = self.cfg.task
        assert isinstance(task_cfg, LMTaskConfig)
        if with_aux and task_cfg.z_loss_weight > 0:
            main, logsumexp = cross_entropy_and_logsumexp(logits, targets.flatten())
            aux["z_loss"] = task_cfg.z_loss_weight * self._sampled(logsumexp).square().mean()
        else:
            main = F.cross_entropy(logits, targets.flatten())
        total = main + sum(aux.values()) if aux else main
        return Losses(total=total, main=main, aux=aux)
