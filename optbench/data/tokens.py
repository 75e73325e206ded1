"""Pre-tokenized token files: a flat uint16/uint32 array on disk, read through np.memmap.

``optbench data tokenize TEXT OUT.bin`` writes one with a byte-level tokenizer (ids 0..255) and a
sidecar ``OUT.bin.json`` holding dtype, vocab_size and the token count. The file is cut into
non-overlapping windows of ``seq_len + 1`` tokens (stride ``seq_len``); the last ``eval_fraction``
of the file is the eval split.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from optbench.errors import ConfigError


def sidecar_path(path: str | Path) -> Path:
    return Path(f"{path}.json")


def tokenize_bytes(text_path: str | Path, out_path: str | Path) -> dict:
    """Byte-level tokenization of a text file: each byte is one token id (vocab 256)."""
    text_path, out_path = Path(text_path), Path(out_path)
    if not text_path.is_file():
        raise ConfigError(f"{text_path} does not exist or is not a file; give a text file to tokenize")
    data = np.frombuffer(text_path.read_bytes(), dtype=np.uint8)
    if data.size < 2:
        raise ConfigError(f"{text_path} holds {data.size} bytes; tokenizing needs at least 2")
    out_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_path.with_name(out_path.name + ".tmp")
    data.astype(np.uint16).tofile(tmp)
    meta = {"dtype": "uint16", "vocab_size": 256, "num_tokens": int(data.size), "tokenizer": "bytes",
            "source": str(text_path)}
    tmp.replace(out_path)
    sidecar_path(out_path).write_text(json.dumps(meta, indent=2) + "\n")
    return meta


class TokenFile(Dataset):
    def __init__(
        self, path: str, *, seq_len: int, split: str, dtype: str, eval_fraction: float
    ) -> None:
        file = Path(path)
        if not file.is_file():
            raise ConfigError(
                f"data.path={path} does not exist; create it with `optbench data tokenize TEXT {path}`"
            )
        meta_file = sidecar_path(file)
        meta = json.loads(meta_file.read_text()) if meta_file.is_file() else None
        if dtype == "auto":
            if meta is None:
                raise ConfigError(
                    f"{path} has no sidecar {meta_file.name}; pass data.dtype=uint16 or data.dtype=uint32"
                )
            dtype = meta["dtype"]
        itemsize = np.dtype(dtype).itemsize
        if file.stat().st_size % itemsize:
            raise ConfigError(
                f"{path} is {file.stat().st_size} bytes, not a whole number of {dtype} tokens; "
                "check data.dtype"
            )
        tokens = np.memmap(file, dtype=dtype, mode="r")
        self.vocab_size = int(meta["vocab_size"]) if meta else int(tokens.max()) + 1
        n_eval = max(seq_len + 1, int(len(tokens) * eval_fraction))
        n_train = len(tokens) - n_eval
        self.tokens = tokens[:n_train] if split == "train" else tokens[n_train:]
        self.seq_len = seq_len
        self.num_windows = (len(self.tokens) - 1) // seq_len
        if self.num_windows < 1:
            raise ConfigError(
                f"{path} has {len(self.tokens)} tokens in its {split} split; train.seq_len={seq_len} "
                f"needs at least {seq_len + 1}: lower train.seq_len or use a larger file"
            )

    def __len__(self) -> int:
        return self.num_windows

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if not 0 <= index < self.num_windows:
            raise IndexError(index)
        start = index * self.seq_len
        window = np.asarray(self.tokens[start : start + self.seq_len + 1], dtype=np.int64)
        return {"tokens": torch.from_numpy(window)}
