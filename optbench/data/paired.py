"""Climate windows paired with text (``task=climate_text``): ``data=netcdf data.text=PAIRS.jsonl``.

The text file is JSON lines ``{"time": ..., "text": ...}`` (``optbench data captions`` writes one,
``optbench.data.captions`` documents the format); each time must be one of the NetCDF data's time
coordinates. A sample is the climate sample of ``data=netcdf`` — ``history`` input steps and the
target step — plus the text of one of its times (``offset`` steps after its first: its last input
step for captions of ``--mode describe``, its target for ``--mode forecast``; see
``optbench.data.captions.CaptionSpec``), encoded by a ``TextCodec`` between a ``bos`` id
(so that the text's first token is predicted too) and an ``end`` id, padded with ``pad`` to
``seq_len + 1`` tokens (``length`` says how many are real; longer texts are cut):

- bytes (``BYTES``, optbench's own model by default): one token per UTF-8 byte, as ``optbench data
  tokenize``, between two newlines — the texts as lines of a text file, which is what a ``task=lm``
  base trained on ``optbench data captions --lines`` output saw; ``PAD`` is NUL;
- a tokenizer (``tokenizer_codec``: a tokenizer.json, e.g. the pretrained base's): its ids, after
  its beginning-of-text token (the ``bos_token`` its configs name; else its end-of-text token, as
  GPT-2 and ``optbench data tokenize --tokenizer`` packing put one between documents) and
  followed by its end-of-text token, padded with the end-of-text id.

The datasets wrap the NetCDF ones, so sharding over ranks and DataLoader workers, exact resume and
every-sample-once per epoch are theirs: the text is looked up by each batch's ``sample`` index.
Every target time of the train and eval splits needs a text (the first one missing is named).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, IterableDataset

from optbench.data.captions import time_label
from optbench.errors import ConfigError

log = logging.getLogger(__name__)

PAD = 0  # ASCII NUL; never a target
BOS = END = ord("\n")  # texts are lines: a base LM trained on the texts one per line knows both
VOCAB = 256


def _normalize_time(value: object) -> str | int:
    """A time from the text file in the form ``time_label`` gives the NetCDF coordinates."""
    if isinstance(value, bool):
        raise ValueError(value)
    if isinstance(value, (int, float)) and float(value).is_integer():
        return int(value)
    if isinstance(value, str):
        return time_label(np.datetime64(value.strip().replace(" ", "T").rstrip("Z"), "s"))
    raise ValueError(value)


def read_text_pairs(path: str | Path, *, times: np.ndarray) -> dict[int, str]:
    """Time-step index -> text, from the JSON lines file ``path``; ``times`` are the data's."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"data.text={path} does not exist; write one with `optbench data captions DATA.nc {path}`")
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"data.text={path} cannot be read ({exc}); give a UTF-8 JSON lines file") from exc
    index = {time_label(t): i for i, t in enumerate(times)}
    pairs: dict[int, str] = {}
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            text, when = record["text"], _normalize_time(record["time"])
            if not isinstance(text, str):
                raise TypeError("text")
        except (ValueError, KeyError, TypeError) as exc:
            raise ConfigError(
                f"{path}:{number} is not a JSON object with a \"time\" (ISO 8601) and a \"text\" string "
                f"({type(exc).__name__}: {exc}); fix that line"
            ) from exc
        if when not in index:
            raise ConfigError(
                f"{path}:{number}: time {record['time']} is not a time step of the NetCDF data "
                f"({time_label(times[0])} .. {time_label(times[-1])}); pair the text with the right data.paths"
            )
        if not text.strip():
            raise ConfigError(f"{path}:{number}: the text of time {record['time']} is empty; give it a text, or "
                              "leave that time out of the file")
        if index[when] in pairs:
            raise ConfigError(f"{path}:{number}: time {record['time']} has a text already; keep one per time step")
        pairs[index[when]] = text
    if not pairs:
        raise ConfigError(f"data.text={path} holds no text; write one with `optbench data captions DATA.nc {path}`")
    return pairs


@dataclass(frozen=True)
class TextCodec:
    """How a text becomes token ids: ``name`` ("bytes", or the tokenizer.json's path), the
    vocabulary the model's must hold, the ids around each text and the padding (never a target)."""

    name: str
    vocab_size: int
    bos: int
    end: int
    pad: int
    tokenizer: Any = None  # a tokenizers.Tokenizer; None: UTF-8 bytes

    def ids(self, text: str) -> np.ndarray:
        if self.tokenizer is None:
            return np.frombuffer(text.encode("utf-8"), dtype=np.uint8)
        # one text at a time: encode_batch's thread pool would make forked DataLoader workers warn
        return np.asarray(self.tokenizer.encode(text, add_special_tokens=False).ids, dtype=np.int64)


BYTES = TextCodec(name="bytes", vocab_size=VOCAB, bos=BOS, end=END, pad=PAD)


def tokenizer_codec(path: str | Path) -> TextCodec:
    """The codec of the tokenizer ``path`` names (a tokenizer.json or a directory holding one)."""
    from optbench.data.tokenizer import config_token, load_tokenizer

    loaded = load_tokenizer(path)
    if loaded.eos_id is None:
        raise ConfigError(f"{loaded.path} names no end-of-text token to end each text with (no eos_token in a "
                          "tokenizer_config.json beside it, none of the usual names in its vocabulary); give the "
                          "directory the tokenizer came with")
    bos = config_token(loaded.path.parent, loaded.tokenizer, kind="bos")
    bos_id = loaded.tokenizer.token_to_id(bos) if bos is not None else None
    return TextCodec(name=str(loaded.path), vocab_size=loaded.vocab_size, bos=loaded.eos_id if bos_id is None else bos_id,
                     end=loaded.eos_id, pad=loaded.eos_id, tokenizer=loaded.tokenizer)


def encode(text: str, *, seq_len: int, codec: TextCodec = BYTES) -> tuple[np.ndarray, int]:
    """``codec.bos``, the tokens of ``text``, ``codec.end``, padded with ``codec.pad`` to
    ``seq_len + 1``; and the real length (before a cut to ``seq_len + 1``)."""
    data = np.concatenate([[codec.bos], codec.ids(text), [codec.end]]).astype(np.int64)
    tokens = np.full(seq_len + 1, codec.pad, dtype=np.int64)
    kept = data[: seq_len + 1]
    tokens[: len(kept)] = kept
    return tokens, len(data)


class TextTable:
    """Tokens ``(num_steps, seq_len + 1)`` and lengths of the text of every time step."""

    def __init__(self, pairs: dict[int, str], *, num_steps: int, seq_len: int, codec: TextCodec = BYTES) -> None:
        self.tokens = np.full((num_steps, seq_len + 1), codec.pad, dtype=np.int64)
        self.length = np.zeros(num_steps, dtype=np.int64)
        self.has_text = np.zeros(num_steps, dtype=bool)
        cut = 0
        for step, text in pairs.items():
            self.tokens[step], full = encode(text, seq_len=seq_len, codec=codec)
            self.length[step] = min(full, seq_len + 1)
            self.has_text[step] = True
            cut += full > seq_len + 1
        if cut:
            log.warning("%d of %d texts are longer than train.seq_len + 1 = %d tokens and were cut",
                        cut, len(pairs), seq_len + 1)

    def lookup(self, targets: torch.Tensor) -> dict[str, torch.Tensor]:
        idx = targets.numpy()
        return {"tokens": torch.from_numpy(self.tokens[idx]), "length": torch.from_numpy(self.length[idx])}


class PairedStream(IterableDataset):
    """The training split (a ``ClimateStream``) with each batch's texts: the text of the step
    ``offset`` after each sample's first."""

    def __init__(self, climate, table: TextTable, *, offset: int) -> None:
        self.climate, self.table, self.offset = climate, table, offset

    def shard(self, **kwargs) -> PairedStream:
        return PairedStream(self.climate.shard(**kwargs), self.table, offset=self.offset)

    def per_worker(self, num_workers: int, *, world_size: int | None = None) -> int:
        return self.climate.per_worker(num_workers, world_size=world_size)

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        for batch in self.climate:
            yield {**batch, **self.table.lookup(batch["sample"] + self.offset)}


class PairedWindows(Dataset):
    """Eval samples of the eval split (a ``ClimateWindows``): item ``i`` is the split's sample
    ``positions[i]`` (``optbench.tasks.text_scores.strided``: spread over the split, in time order)
    with its text, ``eval_index`` = ``i``, and as ``frames_shuffled`` the climate of item
    ``partners[i]`` (a derangement: another time's climate for the same text, whatever the batch)."""

    def __init__(self, climate, table: TextTable, *, offset: int, positions: np.ndarray, partners: np.ndarray) -> None:
        assert len(positions) == len(partners) and not np.any(partners == np.arange(len(partners)))
        self.climate, self.table, self.offset = climate, table, offset
        self.positions, self.partners = np.asarray(positions), np.asarray(partners)

    def __len__(self) -> int:
        return len(self.positions)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return self.__getitems__([index])[0]

    def __getitems__(self, indices: list[int]) -> list[dict[str, torch.Tensor]]:
        items = self.climate.__getitems__([int(self.positions[i]) for i in indices])
        others = self.climate.__getitems__([int(self.positions[self.partners[i]]) for i in indices])
        texts = self.table.lookup(torch.stack([item["sample"] for item in items]) + self.offset)
        return [{**item, "tokens": texts["tokens"][k], "length": texts["length"][k],
                 "frames_shuffled": others[k]["frames"], "eval_index": torch.tensor(i)}
                for k, (i, item) in enumerate(zip(indices, items, strict=True))]


def check_coverage(pairs: dict[int, str], *, splits, offset: int, times: np.ndarray, path: str) -> None:
    """Every sample of ``splits`` has the text of its step ``offset``, or the first one without is named."""
    has_text = np.zeros(len(times), dtype=bool)
    has_text[list(pairs)] = True
    for split in splits:
        steps = np.arange(split.first + offset, split.first + offset + split.num_samples)
        missing = steps[~has_text[steps]]
        if missing.size:
            raise ConfigError(
                f"data.text={path} has no text for time {time_label(times[missing[0]])} (and {missing.size - 1} more "
                f"steps the samples' texts are of); give every time step from {time_label(times[offset])} a text, "
                "e.g. with `optbench data captions`"
            )
