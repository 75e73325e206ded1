"""Climate windows paired with text (``task=climate_text``): ``data=netcdf data.text=PAIRS.jsonl``.

The text file is JSON lines ``{"time": ..., "text": ...}`` (``optbench data captions`` writes one,
``optbench.data.captions`` documents the format); each time must be one of the NetCDF data's time
coordinates. A sample is the climate sample of ``data=netcdf`` — ``history`` input steps and the
target step — plus the text of its target time, tokenized with the project's byte-level tokenizer
(one token per UTF-8 byte, as ``optbench data tokenize``) between two newlines (``BOS``, so that
the text's first byte is predicted too, and ``END``) — the texts as lines of a text file, which is
what a ``task=lm`` base trained on ``optbench data captions --lines`` output saw — padded with
``PAD`` to ``seq_len + 1`` tokens (``length`` says how many are real; longer texts are cut).

The datasets wrap the NetCDF ones, so sharding over ranks and DataLoader workers, exact resume and
every-sample-once per epoch are theirs: the text is looked up by each batch's ``sample`` index.
Every target time of the train and eval splits needs a text (the first one missing is named).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path

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
        if index[when] in pairs:
            raise ConfigError(f"{path}:{number}: time {record['time']} has a text already; keep one per time step")
        pairs[index[when]] = text
    if not pairs:
        raise ConfigError(f"data.text={path} holds no text; write one with `optbench data captions DATA.nc {path}`")
    return pairs


def encode(text: str, *, seq_len: int) -> tuple[np.ndarray, int]:
    """BOS, the byte tokens of ``text``, END, padded with PAD to ``seq_len + 1``; and the real length."""
    data = np.frombuffer(bytes([BOS]) + text.encode("utf-8") + bytes([END]), dtype=np.uint8)[: seq_len + 1]
    tokens = np.full(seq_len + 1, PAD, dtype=np.int64)
    tokens[: len(data)] = data
    return tokens, len(data)


class TextTable:
    """Tokens ``(num_steps, seq_len + 1)`` and lengths of the text of every time step."""

    def __init__(self, pairs: dict[int, str], *, num_steps: int, seq_len: int) -> None:
        self.tokens = np.full((num_steps, seq_len + 1), PAD, dtype=np.int64)
        self.length = np.zeros(num_steps, dtype=np.int64)
        self.has_text = np.zeros(num_steps, dtype=bool)
        cut = 0
        for step, text in pairs.items():
            self.tokens[step], self.length[step] = encode(text, seq_len=seq_len)
            self.has_text[step] = True
            cut += len(text.encode("utf-8")) + 2 > seq_len + 1
        if cut:
            log.warning("%d of %d texts are longer than train.seq_len + 1 = %d tokens and were cut",
                        cut, len(pairs), seq_len + 1)

    def lookup(self, targets: torch.Tensor) -> dict[str, torch.Tensor]:
        idx = targets.numpy()
        return {"tokens": torch.from_numpy(self.tokens[idx]), "length": torch.from_numpy(self.length[idx])}


class PairedStream(IterableDataset):
    """The training split (a ``ClimateStream``) with each batch's texts."""

    def __init__(self, climate, table: TextTable, *, history: int) -> None:
        self.climate, self.table, self.history = climate, table, history

    def shard(self, **kwargs) -> PairedStream:
        return PairedStream(self.climate.shard(**kwargs), self.table, history=self.history)

    def per_worker(self, num_workers: int, *, world_size: int | None = None) -> int:
        return self.climate.per_worker(num_workers, world_size=world_size)

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        for batch in self.climate:
            yield {**batch, **self.table.lookup(batch["sample"] + self.history)}


class PairedWindows(Dataset):
    """The eval split (a ``ClimateWindows``) with each sample's text and, as ``frames_shuffled``,
    the climate of the sample ``shuffle_offset`` places further (cyclically; 0: half the split
    away): another time's climate for the same text, whatever the batch size."""

    def __init__(self, climate, table: TextTable, *, history: int, shuffle_offset: int = 0) -> None:
        self.climate, self.table, self.history = climate, table, history
        n = len(climate)
        self.offset = (shuffle_offset or n // 2) % n if n > 1 else 0

    def __len__(self) -> int:
        return len(self.climate)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return self.__getitems__([index])[0]

    def __getitems__(self, indices: list[int]) -> list[dict[str, torch.Tensor]]:
        items = self.climate.__getitems__(indices)
        others = self.climate.__getitems__([(i + self.offset) % len(self) for i in indices])
        texts = self.table.lookup(torch.stack([item["sample"] for item in items]) + self.history)
        return [{**item, "tokens": texts["tokens"][i], "length": texts["length"][i],
                 "frames_shuffled": others[i]["frames"]} for i, item in enumerate(items)]


def check_coverage(table: TextTable, *, splits, history: int, times: np.ndarray, path: str) -> None:
    """Every target step of ``splits`` has a text, or the first one without is named."""
    for split in splits:
        targets = np.arange(split.first + history, split.first + history + split.num_samples)
        missing = targets[~table.has_text[targets]]
        if missing.size:
            raise ConfigError(
                f"data.text={path} has no text for time {time_label(times[missing[0]])} (and {missing.size - 1} more "
                f"target steps of the data); give every time step from {time_label(times[history])} a text, e.g. "
                f"with `optbench data captions`"
            )
