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
    step = max(1, CHUNK_VALUES // (2 * file_width))  # read once, in chunks, as a token file's ids are
    for start in range(0, count, step):
        finite = np.isfinite(array[start:start + step]).all(axis=(1, 2))
        if not finite.all():  # training on it would end in "loss is nan", naming no file
            first = start + int(np.flatnonzero(~finite)[0])
            raise ConfigError(f"{path} holds NaN or infinite values (pair {first + 1}, and perhaps more): the file is "
                              "damaged or not what `optbench data embed` wrote; embed the pairs again")
    return Pairs(array=array, texts=meta.get("texts") or [], source=str(path))


CHUNK_VALUES = 1 << 24  # float32 values per read of the finiteness check: 64 MiB at a time


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
    return torch.from_numpy(np.array(pairs.array, dtype=np.float32)).to(device)  # read whole, then moved


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


# ---------------------------------------------------------------------------- optbench data embed
def read_pairs(path: Path) -> list[list[str]]:
    """``[input, target]`` of each line of a JSON-lines pairs file (``{"input": ..., "target": ...}``);
    ConfigError naming the line and the fix for a line without either text or with an empty one."""
    from optbench.files import parse_jsonl

    if not path.is_file():
        raise ConfigError(f"{path} does not exist; give a JSON-lines file of {{\"input\": ..., \"target\": ...}} pairs")
    records, torn = parse_jsonl(path, objects_only=True)
    if torn:
        raise ConfigError(f"{torn.removesuffix('; skipped')}: complete or remove that line")
    if not records:
        raise ConfigError(f"{path} holds no pairs; write one {{\"input\": ..., \"target\": ...}} object per line")
    pairs = []
    for number, record in enumerate(records, start=1):
        for key in ("input", "target"):
            if key not in record or not isinstance(record[key], str):
                raise ConfigError(f"{path} pair {number} has no \"{key}\" text field; each line must be "
                                  "{\"input\": \"...\", \"target\": \"...\"}")
            if not record[key].strip():
                raise ConfigError(f"{path} pair {number} has an empty \"{key}\" text; remove that pair or give it a text")
        pairs.append([record["input"], record["target"]])
    return pairs


def load_encoder(directory: Path) -> tuple[Any, Any]:
    """(tokenizer, model) of a local Hugging Face encoder directory (nothing is downloaded);
    ConfigError naming the directory when it holds no encoder."""
    from safetensors import SafetensorError
    from transformers import AutoConfig, AutoModel, AutoTokenizer

    from optbench.logs import transformers_quiet

    if not (directory / "config.json").is_file():
        raise ConfigError(f"--encoder {directory} holds no config.json: it is not a Hugging Face encoder directory; "
                          "give one that save_pretrained wrote (config.json, weights and the tokenizer)")
    try:
        config = AutoConfig.from_pretrained(directory, local_files_only=True)
        if getattr(config, "is_decoder", False) or getattr(config, "is_encoder_decoder", False) \
                or any(name.endswith(("ForCausalLM", "LMHeadModel")) for name in (config.architectures or [])):
            raise ValueError(f"a {config.model_type} decoder, not an encoder")
        tokenizer = AutoTokenizer.from_pretrained(directory, local_files_only=True)
        if tokenizer.pad_token is None:
            raise ValueError("its tokenizer has no padding token to batch texts with")
        with transformers_quiet():
            model = AutoModel.from_pretrained(directory, local_files_only=True)
    except (OSError, ValueError, KeyError, SafetensorError) as exc:  # SafetensorError: a weights file cut short
        raise ConfigError(f"--encoder {directory} is not a usable Hugging Face encoder ({str(exc).splitlines()[0]}); "
                          "give a directory holding an encoder's config.json, weights and tokenizer") from None
    return tokenizer, model.eval()


@torch.no_grad()
def embed_texts(texts: list[str], *, tokenizer: Any, model: Any, batch_size: int = 32) -> np.ndarray:
    """The encoder's last hidden states mean-pooled over each text's attention mask: (len(texts), width)."""
    out = []
    for start in range(0, len(texts), batch_size):
        enc = tokenizer(texts[start:start + batch_size], padding=True, truncation=True, return_tensors="pt")
        hidden = model(**enc).last_hidden_state
        mask = enc["attention_mask"].unsqueeze(-1).to(hidden.dtype)
        out.append(((hidden * mask).sum(1) / mask.sum(1).clamp(min=1)).float().numpy())
    return np.concatenate(out)


def write_embeddings(pairs_path: str | Path, out: str | Path, *, encoder: str | Path) -> dict[str, Any]:
    """Embed every pair of ``pairs_path`` once with ``encoder`` and write ``out`` (float32 pairs,
    memory-mappable) and ``out.json``, each atomically: a bad input leaves nothing written over."""
    from optbench.files import atomic_path, write_atomic

    pairs_path, out, encoder = Path(pairs_path), Path(out), Path(encoder)
    texts = read_pairs(pairs_path)
    tokenizer, model = load_encoder(encoder)
    flat = [text for pair in texts for text in pair]
    vectors = embed_texts(flat, tokenizer=tokenizer, model=model).reshape(len(texts), 2, -1)
    bad = np.flatnonzero(~np.isfinite(vectors).all(axis=(1, 2)))
    if len(bad):  # training on them would end in "loss is nan" naming neither the pair nor the encoder
        raise ConfigError(f"--encoder {encoder} gives NaN or infinite embeddings for {len(bad)} pair(s) of {pairs_path} "
                          f"(the first: pair {bad[0] + 1}), so nothing is written; check the encoder's weights (a "
                          "float16 overflow?)")
    meta = {"format": FORMAT, "count": len(texts), "width": int(vectors.shape[2]), "dtype": "float32",
            "encoder": str(encoder.resolve()), "pooling": "mean over the attention mask", "source": str(pairs_path),
            "texts": texts}
    with atomic_path(out) as tmp:
        np.ascontiguousarray(vectors, dtype=np.float32).tofile(tmp)
    write_atomic(sidecar_path(out), json.dumps(meta))
    return meta
