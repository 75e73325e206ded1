"""Writing token files (``optbench data tokenize``), without torch: the command starts in a
moment. ``TEXT OUT.bin --tokenizer FILE_OR_DIR`` tokenizes with a real tokenizer (a tokenizer.json,
see ``optbench.data.tokenizer``) and packs the text's documents one after the other, each followed
by the tokenizer's end-of-text token: the plan's pretokenize-and-pack step (training windows then
cross document boundaries, as in GPT-style pretraining). Ids are stored as uint16 when every id of
the vocabulary fits, else uint32. Without ``--tokenizer`` each byte is one token (ids 0..255, no
documents). Either way a sidecar ``OUT.bin.json`` holds dtype, vocab_size and the token count, and
for a real tokenizer its path, sha256, end-of-text token and id and the number of documents.

Nothing is written over an input (the corpus, the tokenizer, its configs), whatever its name; a
failure leaves no partial file.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from optbench.data.tokenizer import (
    check_corpus,
    iter_documents,
    load_tokenizer,
    refuse_overwriting_inputs,
    write_error,
)
from optbench.errors import ConfigError
from optbench.files import atomic_path, os_error_message, write_atomic

BATCH_DOCUMENTS = 1024  # documents per encode_batch call (the library encodes a batch on every core)


def sidecar_path(path: str | Path) -> Path:
    return Path(f"{path}.json")


def tokenize_bytes(text_path: str | Path, out_path: str | Path) -> dict:
    """Byte-level tokenization of a text file: each byte is one token id (vocab 256)."""
    text_path, out_path = Path(text_path), Path(out_path)
    if not text_path.is_file():
        raise ConfigError(f"{text_path} does not exist or is not a file; give a text file to tokenize")
    refuse_overwriting_inputs([out_path, sidecar_path(out_path)], inputs=[text_path], sidecar_of=out_path)
    try:
        data = np.frombuffer(text_path.read_bytes(), dtype=np.uint8)
    except OSError as exc:
        raise ConfigError(os_error_message(exc, "read the text to tokenize")) from None
    if data.size < 2:
        raise ConfigError(f"{text_path} holds {data.size} bytes; tokenizing needs at least 2")
    meta = {"dtype": "uint16", "vocab_size": 256, "num_tokens": int(data.size), "tokenizer": "bytes",
            "source": str(text_path)}
    try:
        out_path.parent.mkdir(parents=True, exist_ok=True)
        with atomic_path(out_path) as tmp:
            data.astype(np.uint16).tofile(tmp)
        write_atomic(sidecar_path(out_path), json.dumps(meta, indent=2) + "\n")
    except OSError as exc:
        raise ConfigError(write_error(exc, out=out_path, what="write the token file")) from None
    return meta


def token_dtype(vocab_size: int) -> str:
    """The narrowest dtype that holds every id of a ``vocab_size`` vocabulary."""
    return "uint16" if vocab_size <= 2**16 else "uint32"


def tokenize_file(text_path: str | Path, out_path: str | Path, *, tokenizer: str | Path,
                  documents: str = "paragraphs", eos: str | None = None) -> dict:
    """Tokenize the documents of ``text_path`` with ``tokenizer`` (a tokenizer.json or a model
    directory holding one) and pack them, each followed by the end-of-text token, into ``out_path``."""
    text_path, out_path = check_corpus(text_path), Path(out_path)
    loaded = load_tokenizer(tokenizer, eos=eos)
    if loaded.eos_id is None:
        raise ConfigError(f"{loaded.path} names no end-of-text token (no tokenizer_config.json eos_token beside it, none "
                          "of the usual names in its vocabulary); give --eos TOKEN, one of its special tokens")
    beside = [loaded.path.parent / name for name in ("tokenizer_config.json", "config.json")]
    refuse_overwriting_inputs([out_path, sidecar_path(out_path)],
                              inputs=[text_path, loaded.path, *[p for p in beside if p.exists()]], sidecar_of=out_path)
    dtype = token_dtype(loaded.vocab_size)
    try:
        out_path.parent.mkdir(parents=True, exist_ok=True)
        with atomic_path(out_path) as tmp:
            counts = _pack(text_path, tmp, loaded=loaded, documents=documents, dtype=dtype)
        meta = {"dtype": dtype, "vocab_size": loaded.vocab_size, "num_tokens": counts["tokens"],
                "tokenizer": str(loaded.path.resolve()), "tokenizer_sha256": _sha256(loaded.path),
                "eos_token": loaded.eos_token, "eos_id": loaded.eos_id, "documents": counts["documents"],
                "document_mode": documents, "text_bytes": text_path.stat().st_size, "source": str(text_path)}
        write_atomic(sidecar_path(out_path), json.dumps(meta, indent=2) + "\n")
    except OSError as exc:
        raise ConfigError(write_error(exc, out=out_path, what="write the token file")) from None
    return meta


def _pack(text_path: Path, tmp: Path, *, loaded, documents: str, dtype: str) -> dict[str, int]:
    """Stream the documents through ``encode_batch`` into ``tmp``; the token and document counts."""
    tokens = docs = 0
    batch: list[str] = []
    with open(tmp, "wb") as handle:
        for document in iter_documents(text_path, mode=documents):
            batch.append(document)
            if len(batch) == BATCH_DOCUMENTS:
                tokens += _write_batch(handle, batch, loaded=loaded, dtype=dtype)
                docs, batch = docs + len(batch), []
        tokens += _write_batch(handle, batch, loaded=loaded, dtype=dtype)
        docs += len(batch)
    return {"tokens": tokens, "documents": docs}


def _write_batch(handle, batch: list[str], *, loaded, dtype: str) -> int:
    if not batch:
        return 0
    encodings = loaded.tokenizer.encode_batch(batch, add_special_tokens=False)
    ids = np.fromiter((i for e in encodings for i in (*e.ids, loaded.eos_id)), dtype=np.int64)
    ids.astype(dtype).tofile(handle)
    return int(ids.size)


def _sha256(path: Path) -> str:
    import hashlib

    return hashlib.sha256(path.read_bytes()).hexdigest()
