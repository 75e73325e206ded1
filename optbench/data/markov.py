"""Deterministic synthetic tokens with learnable structure.

A fixed Markov chain over the vocabulary: every token has ``branching`` successors (drawn once
from a fixed seed, so train and eval share the chain); each next token is one of them, chosen
uniformly, except with probability ``noise`` a uniformly random token. A model that learns the chain
reaches a loss near ``(1 - noise) * ln(branching)`` plus the noise term, far below ``ln(vocab)``.

Sample ``i`` of a split depends only on ``(seed, split, i)``, so any sample can be produced in any
process in any order: sharding across workers and ranks and exact resume need no shared state.
"""

from __future__ import annotations

import numpy as np
import torch
from torch.utils.data import Dataset

_SPLITS = {"train": 0, "eval": 1}
_CHAIN_SEED = 0x5EED


class SyntheticTokens(Dataset):
    def __init__(
        self,
        *,
        vocab_size: int,
        seq_len: int,
        seed: int,
        split: str,
        branching: int,
        noise: float,
        num_samples: int,
    ) -> None:
        self.vocab_size = vocab_size
        self.seq_len = seq_len
        self.seed = seed
        self.split_id = _SPLITS[split]
        self.noise = noise
        self.num_samples = num_samples
        chain_rng = np.random.default_rng([_CHAIN_SEED, vocab_size, branching])
        self.successors = chain_rng.integers(0, vocab_size, size=(vocab_size, branching))

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if not 0 <= index < self.num_samples:
            raise IndexError(index)
        length = self.seq_len + 1
        rng = np.random.default_rng([self.seed, self.split_id, index])
        choices = rng.integers(0, self.successors.shape[1], size=length)
        random_tokens = rng.integers(0, self.vocab_size, size=length)
        is_noise = rng.random(length) < self.noise
        tokens = np.empty(length, dtype=np.int64)
        successors = self.successors
        current = int(random_tokens[0])
        tokens[0] = current
        for t in range(1, length):
            current = int(random_tokens[t]) if is_noise[t] else int(successors[current, choices[t]])
            tokens[t] = current
        return {"tokens": torch.from_numpy(tokens)}
