"""Pre-tokenized token files: a flat uint16/uint32 array on disk, read through np.memmap.

``optbench data tokenize`` writes them (``optbench.data.pack``), with a sidecar ``OUT.bin.json``
holding dtype, vocab_size and the token count. The file is cut into
non-overlapping windows of ``seq_len + 1`` tokens (stride ``seq_len``); the last ``eval_fraction``
of the file is the eval split.

A token file that cannot be what it claims is refused with one line naming it: an empty file, a
size that is not a whole number of tokens, a sidecar that is not valid JSON or lacks its fields, or
a file shorter or longer than the sidecar's ``num_tokens`` (a copy cut short trains on less data), an
id at or past the sidecar's ``vocab_size`` (found by a chunked scan of the memmap when it is opened).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from optbench.data.pack import sidecar_path
from optbench.errors import ConfigError
from optbench.files import TEXT, file_kind


def read_sidecar(path: Path) -> dict | None:
    """The sidecar of token file ``path`` (None when there is none); ConfigError when it is unusable."""
    meta_file = sidecar_path(path)
    if not meta_file.is_file():
        return None
    try:
        meta = json.loads(meta_file.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{meta_file} is not valid JSON ({exc}); write it again with `optbench data tokenize`, "
                          "or remove it and pass data.dtype") from None
    missing = [k for k in ("dtype", "vocab_size", "num_tokens") if not isinstance(meta, dict) or k not in meta]
    if missing:
        raise ConfigError(f"{meta_file} lacks {', '.join(missing)}; write it again with `optbench data tokenize`, "
                          "or remove it and pass data.dtype")
    if meta["dtype"] not in ("uint16", "uint32"):
        raise ConfigError(f"{meta_file} says dtype {meta['dtype']!r}; token files are uint16 or uint32")
    for key in ("vocab_size", "num_tokens"):
        if isinstance(meta[key], bool) or not isinstance(meta[key], int) or meta[key] < 0:
            raise ConfigError(f"{meta_file} says {key} {json.dumps(meta[key])[:40]}, not a count; write it again "
                              "with `optbench data tokenize`, or remove it and pass data.dtype")
    return meta


# NetCDF/HDF5 files are sometimes given to data=tokens by mistake: read as ids they would train on noise
def refuse_foreign(file: Path, *, path: str) -> None:
    """ConfigError when the file at data.path is a NetCDF/HDF5 file rather than token ids (by its
    signature: ``optbench.files.file_kind``, what every output is checked with)."""
    kind = file_kind(file)
    if kind != TEXT:
        raise ConfigError(f"data.path={path} is {kind}, not token ids: data=tokens reads what `optbench data "
                          "tokenize` writes; climate files train with task=climate data=netcdf data.paths=[...]")


def check_vocab(tokens: TokenFile, *, path: str, model_vocab: int, vocab_key: str = "model.vocab_size") -> None:
    """ConfigError, before anything is trained, when the model's vocabulary cannot hold every id
    of the token file (its tokenizer's vocabulary, or its largest id + 1 without a sidecar).
    ``vocab_key``: the override that sets the model's vocabulary (model=hf: its config's field)."""
    if tokens.vocab_size <= model_vocab:
        return
    source = {None: "its largest id + 1", "bytes": "one token per byte"}.get(tokens.tokenizer, f"tokenizer {tokens.tokenizer}")
    raise ConfigError(
        f"{path} needs a vocabulary of {tokens.vocab_size:,} ({source}) but the model's has {model_vocab:,}: "
        f"tokenize with the model's own tokenizer (`optbench data tokenize TEXT OUT --tokenizer DIR`) or a smaller "
        f"one, or set {vocab_key}={tokens.vocab_size} or more (a model trained from scratch)"
    )


CHUNK = 1 << 24  # tokens per read of the largest-id scan: 32-64 MiB at a time, whatever the file's size


def largest_id(tokens: np.ndarray, *, chunk: int = CHUNK) -> int:
    """The largest token id of ``tokens`` (a memmap), read ``chunk`` tokens at a time."""
    return max(int(tokens[start: start + chunk].max()) for start in range(0, len(tokens), chunk))


class TokenFile(Dataset):
    def __init__(
        self, path: str, *, seq_len: int, split: str, dtype: str, eval_fraction: float, chunk: int = CHUNK
    ) -> None:
        file = Path(path)
        if file.is_dir():
            raise ConfigError(f"data.path={path} is a directory; give the token file in it (`optbench data tokenize "
                              "TEXT OUT` writes one)")
        if not file.is_file():
            raise ConfigError(
                f"data.path={path} does not exist; create it with `optbench data tokenize TEXT {path}`"
            )
        refuse_foreign(file, path=path)
        meta = read_sidecar(file)
        if dtype == "auto":
            if meta is None:
                raise ConfigError(
                    f"{path} has no sidecar {sidecar_path(file).name}; pass data.dtype=uint16 or data.dtype=uint32"
                )
            dtype = meta["dtype"]
        itemsize = np.dtype(dtype).itemsize
        size = file.stat().st_size
        if size == 0:
            raise ConfigError(f"{path} is empty (0 bytes): it holds no tokens; write it again with "
                              "`optbench data tokenize TEXT " + f"{path}`")
        if size % itemsize:
            raise ConfigError(
                f"{path} is {size} bytes, not a whole number of {dtype} tokens; "
                "check data.dtype"
            )
        if meta is not None and size // itemsize != meta["num_tokens"]:
            raise ConfigError(
                f"{path} holds {size // itemsize:,} {dtype} tokens but its sidecar {sidecar_path(file).name} says "
                f"{meta['num_tokens']:,} (a copy cut short? another dtype?); copy or tokenize it again"
            )
        tokens = np.memmap(file, dtype=dtype, mode="r")
        self.tokenizer = meta.get("tokenizer") if meta else None
        n_eval = max(seq_len + 1, int(len(tokens) * eval_fraction))
        n_train = len(tokens) - n_eval
        self.tokens = tokens[:n_train] if split == "train" else tokens[n_train:]
        # every id of this split is read once (the other split checks its own): a sidecar that
        # understates the vocabulary would index past the model's embedding mid-run
        if meta is None:  # the whole file's largest id + 1 (the splits agree on the vocabulary)
            self.vocab_size = largest_id(tokens, chunk=chunk) + 1
            return self._windows(path, seq_len=seq_len, split=split)
        top = largest_id(self.tokens, chunk=chunk) if len(self.tokens) else 0
        self.vocab_size = int(meta["vocab_size"])
        if top >= self.vocab_size:
            raise ConfigError(
                f"{path} holds token id {top:,} but its sidecar {sidecar_path(file).name} says vocab_size "
                f"{self.vocab_size:,} (a sidecar of another file, or edited?); tokenize the text again, or fix "
                "vocab_size in the sidecar"
            )
        self._windows(path, seq_len=seq_len, split=split)

    def _windows(self, path: str, *, seq_len: int, split: str) -> None:
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
