"""Teacher-embedding pairs for ``task=energy_flow`` (plan 003): the file ``optbench data embed``
writes, the seeded synthetic pairs, and the map-style dataset over either.

The file ``OUT`` is raw float32 of shape (count, 2, width): each pair's input and target embedding,
memory-mapped when read; ``OUT.json`` is its sidecar: ``{"format": "optbench-embeddings", "width",
"count", "dtype", "encoder", "pooling", "texts": [[input, target], ...]}``.

Two ways to hold it while training (``data.load``): ``device`` reads the whole file onto the
training device before the first step (the plan's ``torch.load(..., map_location='cuda')``) and
indexes it per sample, as the plan's ``ExperimentDatasetWrapper``; ``memmap`` reads each sample
from the mapped file when the loader asks for it (in the loader's workers, with ``dataloader=tuned``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from optbench.errors import ConfigError

FORMAT = "optbench-embeddings"


@dataclass
class Pairs:
    """A whole set of pairs: ``array`` (count, 2, width) float32 (a memmap or in memory), the texts
    (``[input, target]`` per pair) and where they came from."""

    array: np.ndarray
    texts: list[list[str]]
    source: str

    @property
    def count(self) -> int:
        return int(self.array.shape[0])

    @property
    def width(self) -> int:
        return int(self.array.shape[2])


def sidecar_path(path: str | Path) -> Path:
    path = Path(path)
    return path.with_name(path.name + ".json")


def open_pairs(path: str | Path, *, width: int, width_key: str = "model.embed_dim") -> Pairs:
    """The pairs file at ``path``, memory-mapped, checked against its sidecar and ``width``."""
    path, meta_path = Path(path), sidecar_path(path)
    if not path.is_file():
        raise ConfigError(f"data.path={path} does not exist; write it with `optbench data embed PAIRS.jsonl {path} "
                          "--encoder DIR`")
    try:
        meta = json.loads(meta_path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{meta_path} (the sidecar of data.path={path}) is missing or not JSON ({type(exc).__name__}); "
                          "write the pair with `optbench data embed`") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise ConfigError(f"{meta_path} is not an optbench embeddings sidecar; write the file with `optbench data embed`")
    count, file_width = int(meta["count"]), int(meta["width"])
    if file_width != width:
        raise ConfigError(f"{path} holds {file_width}-wide embeddings but {width_key}={width}; set "
                          f"{width_key}={file_width}, or embed the pairs with an encoder of width {width}")
    expected = count * 2 * file_width * 4
    if path.stat().st_size != expected:
        raise ConfigError(f"{path} holds {path.stat().st_size} bytes but its sidecar says {count} pairs of width "
                          f"{file_width} ({expected} bytes): the file is truncated or not its sidecar's; embed again")
    array = np.memmap(path, dtype=np.float32, mode="r", shape=(count, 2, file_width))
    return Pairs(array=array, texts=meta.get("texts") or [], source=str(path))


def synthetic_pairs(*, num_samples: int, width: int, seed: int) -> Pairs:
    """Seeded pairs: inputs from a normal distribution, targets ``tanh(inputs @ A)`` for a fixed
    random ``A`` (a map the model can learn), texts ``input i`` / ``target i``."""
    generator = np.random.default_rng(seed)
    inputs = generator.standard_normal((num_samples, width), dtype=np.float32)
    mixing = generator.standard_normal((width, width), dtype=np.float32) / np.sqrt(width)
    targets = np.tanh(inputs @ mixing).astype(np.float32)
    texts = [[f"input {i}", f"target {i}"] for i in range(num_samples)]
    return Pairs(array=np.stack([inputs, targets], axis=1), texts=texts, source=f"synthetic (seed {seed})")


def split_indices(count: int, *, eval_fraction: float, source: str) -> tuple[range, range]:
    """(train, eval): the last ``eval_fraction`` of the pairs is the eval split."""
    held = max(1, round(count * eval_fraction))
    if count - held < 1:
        raise ConfigError(f"{source} holds {count} pair(s): too few for a training and an eval split; "
                          "embed more pairs or lower data.eval_fraction")
    return range(0, count - held), range(count - held, count)


def load_whole(pairs: Pairs, device: torch.device) -> torch.Tensor:
    """Every pair read onto ``device`` at once (the plan's blocking ``torch.load`` to the GPU)."""
    return torch.from_numpy(np.ascontiguousarray(pairs.array)).to(device)


class PairDataset(Dataset):
    """Samples ``{"input", "target", "index"}`` of ``indices`` (indices into the whole file, so that
    the text bridge's bank can be the whole file's targets). With ``tensor``, the whole array
    already read onto a device (``data.load=device``, ``load_whole``), a sample is indexed from it;
    else it is read from the (mapped) array when asked."""

    def __init__(self, pairs: Pairs, indices: range, *, tensor: torch.Tensor | None = None) -> None:
        self.pairs, self.indices, self.tensor = pairs, indices, tensor

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, item: int) -> dict[str, Any]:
        index = self.indices[item]
        pair = self.tensor[index] if self.tensor is not None else torch.from_numpy(np.array(self.pairs.array[index]))
        return {"input": pair[0], "target": pair[1], "index": torch.tensor(index)}
