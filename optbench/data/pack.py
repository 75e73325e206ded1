"""Writing token files (``optbench data tokenize``), without torch: the command starts in a
moment. ``TEXT OUT.bin --tokenizer FILE_OR_DIR`` tokenizes with a real tokenizer (a tokenizer.json,
see ``optbench.data.tokenizer``) and packs the text's documents one after the other, each followed
by the tokenizer's end-of-text token: the plan's pretokenize-and-pack step (training windows then
cross document boundaries, as in GPT-style pretraining). Ids are stored as uint16 when every id of
the vocabulary fits, else uint32. Without ``--tokenizer`` each byte is one token (ids 0..255, no
documents). Either way a sidecar ``OUT.bin.json`` holds dtype, vocab_size and the token count, and
for a real tokenizer its path, sha256, end-of-text token and id and the number of documents.

A document longer than ``PIECE_CHARS`` (a corpus on one line) is encoded in pieces, cut at single
spaces between two words where the tokenizer gives the same ids across the cut as on either side
(checked at every cut on the text around it; a tokenizer that does not, e.g. one whose normalizer
prepends to every text, encodes the document whole): the ids are those of one encode of the
document, the pieces are encoded on every core, and the file is written every ``BATCH_CHARS`` of
text, so a full disk or a file-size limit stops it at once, naming the file and the fix.

Nothing is written over an input (the corpus, the tokenizer, its configs), whatever its name; a
failure (SIGTERM included) leaves no partial file.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
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
from optbench.files import atomic_path, os_error_message, sigterm_raises, write_atomic

BATCH_DOCUMENTS = 1024  # documents per encode_batch call (the library encodes a batch on every core)
BATCH_CHARS = 8 << 20  # text per encode_batch call and per write, at most (beyond one document or piece)
PIECE_CHARS = 8192  # a longer document is encoded in pieces of about this size (long texts encode slower per byte)
BYTES_CHUNK = 8 << 20  # bytes read and written at a time by the byte-level tokenization
CUT_CONTEXT = 64  # characters each side of a cut that its check encodes


def sidecar_path(path: str | Path) -> Path:
    return Path(f"{path}.json")


def tokenize_bytes(text_path: str | Path, out_path: str | Path) -> dict:
    """Byte-level tokenization of a text file: each byte is one token id (vocab 256)."""
    text_path, out_path = Path(text_path), Path(out_path)
    if not text_path.is_file():
        raise ConfigError(f"{text_path} does not exist or is not a file; give a text file to tokenize")
    refuse_overwriting_inputs([out_path, sidecar_path(out_path)], inputs=[text_path], sidecar_of=out_path)
    size = text_path.stat().st_size
    if size < 2:
        raise ConfigError(f"{text_path} holds {size} bytes; tokenizing needs at least 2")
    meta = {"dtype": "uint16", "vocab_size": 256, "num_tokens": int(size), "tokenizer": "bytes",
            "source": str(text_path)}
    try:
        out_path.parent.mkdir(parents=True, exist_ok=True)
        with sigterm_raises(), atomic_path(out_path) as tmp, open(tmp, "wb") as handle:
            for chunk in _chunks(text_path):
                _write(handle, np.frombuffer(chunk, dtype=np.uint8).astype(np.uint16), tmp=tmp)
        write_atomic(sidecar_path(out_path), json.dumps(meta, indent=2) + "\n")
    except OSError as exc:
        raise ConfigError(write_error(exc, out=out_path, what="write the token file")) from None
    return meta


def _chunks(path: Path) -> Iterator[bytes]:
    try:
        with open(path, "rb") as source:
            while chunk := source.read(BYTES_CHUNK):
                yield chunk
    except OSError as exc:
        raise ConfigError(os_error_message(exc, "read the text to tokenize")) from None


def _write(handle, ids: np.ndarray, *, tmp: Path) -> None:
    """Write and flush ``ids`` now (an error names ``tmp``, which ``write_error`` names as the output)."""
    try:
        handle.write(ids.tobytes())
        handle.flush()
    except OSError as exc:
        exc.filename = str(tmp)
        raise


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
        with sigterm_raises(), atomic_path(out_path) as tmp:
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
    """Stream the documents (long ones in pieces) through ``encode_batch`` into ``tmp``, written
    batch by batch; the token and document counts."""
    tokens = docs = size = 0
    batch: list[tuple[str, bool]] = []  # (text, whether it ends its document)
    with open(tmp, "wb") as handle:
        for document in iter_documents(text_path, mode=documents):
            parts = pieces(document, loaded.tokenizer)
            for n, part in enumerate(parts):
                batch.append((part, n == len(parts) - 1))
                size += len(part)
                if len(batch) == BATCH_DOCUMENTS or size >= BATCH_CHARS:
                    tokens += _write_batch(handle, batch, loaded=loaded, dtype=dtype, tmp=tmp)
                    batch, size = [], 0
            docs += 1
        tokens += _write_batch(handle, batch, loaded=loaded, dtype=dtype, tmp=tmp)
    return {"tokens": tokens, "documents": docs}


def _write_batch(handle, batch: list[tuple[str, bool]], *, loaded, dtype: str, tmp: Path) -> int:
    if not batch:
        return 0
    encodings = _encode(loaded.tokenizer, [text for text, _ in batch])
    ids = np.fromiter((i for (_, end), e in zip(batch, encodings, strict=True)
                       for i in (*e.ids, *((loaded.eos_id,) if end else ()))), dtype=np.int64)
    _write(handle, ids.astype(dtype), tmp=tmp)
    return int(ids.size)


def pieces(document: str, tokenizer) -> list[str]:
    """``document`` cut into pieces of about ``PIECE_CHARS`` whose ids, encoded one by one and
    joined, are the document's: each cut is at a single space between two non-space characters
    (where a GPT-style pre-tokenizer starts a word) and checked on the text around it; where the
    check fails (the tokenizer joins across it) the document stays whole."""
    cuts: list[int] = []
    start = 0
    while len(document) - start > PIECE_CHARS:
        cut = _next_cut(document, start + PIECE_CHARS)
        if cut is None:
            break
        if not _same_ids_across(tokenizer, document, cut):
            return [document]
        cuts.append(cut)
        start = cut
    bounds = [0, *cuts, len(document)]
    return [document[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]


def _next_cut(text: str, start: int) -> int | None:
    """The first position from ``start`` holding a single space between two non-space characters."""
    at = text.find(" ", start)
    while 0 < at < len(text) - 1:
        if not text[at - 1].isspace() and not text[at + 1].isspace():
            return at
        at = text.find(" ", at + 1)
    return None


def _same_ids_across(tokenizer, text: str, cut: int) -> bool:
    left, right = text[max(0, cut - CUT_CONTEXT): cut], text[cut: cut + CUT_CONTEXT]
    whole, a, b = _encode(tokenizer, [left + right, left, right])
    return whole.ids == a.ids + b.ids


def _encode(tokenizer, texts: list[str]) -> list:
    """``encode_batch`` of ``texts``, without the character offsets where the library can (the
    same ids, in about half the time)."""
    return getattr(tokenizer, "encode_batch_fast", tokenizer.encode_batch)(texts, add_special_tokens=False)


def _sha256(path: Path) -> str:
    import hashlib

    return hashlib.sha256(path.read_bytes()).hexdigest()
