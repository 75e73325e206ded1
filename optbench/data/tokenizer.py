"""Real tokenizers through the ``tokenizers`` library: train a byte-level BPE on a local corpus
(``optbench data tokenizer``), load any ``tokenizer.json`` (one written here, or a model
directory's as ``transformers``' ``save_pretrained`` leaves it), and find its end-of-text token.

Corpora are UTF-8 text read one line at a time (any size), split into documents: ``paragraphs``
(blocks separated by blank lines; a file without blank lines is one document) or ``lines`` (each
non-empty line one document, e.g. ``optbench data captions --lines``). Nothing is fetched: a hub
id is refused with the fix named.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from optbench.errors import ConfigError
from optbench.files import os_error_message, write_atomic

EOS_TOKEN = "<|endoftext|>"  # the end-of-text token of a tokenizer trained here (GPT-2's name)
BYTE_ALPHABET = 256  # a byte-level BPE starts from one token per byte
MIN_VOCAB = BYTE_ALPHABET + 1  # the bytes and the end-of-text token
DOCUMENT_MODES = ("paragraphs", "lines")
# end-of-text tokens of the usual families, tried (in this order) when no config names one
KNOWN_EOS = (EOS_TOKEN, "<|end_of_text|>", "</s>", "<eos>", "<|im_end|>")


@dataclass(frozen=True)
class LoadedTokenizer:
    """A parsed tokenizer, the file it came from, its vocabulary size (largest id + 1) and its
    end-of-text token (``eos_id`` None for a tokenizer that has none and was given none)."""

    tokenizer: object  # tokenizers.Tokenizer
    path: Path
    vocab_size: int
    eos_token: str | None
    eos_id: int | None


# --------------------------------------------------------------------------------- the corpus
def check_corpus(path: str | Path) -> Path:
    """The corpus as a Path; ConfigError for a missing file, a directory or 0 bytes."""
    path = Path(path)
    if path.is_dir():
        raise ConfigError(f"{path} is a directory; give a UTF-8 text file (one corpus)")
    if not path.is_file():
        raise ConfigError(f"{path} does not exist or is not a file; give a UTF-8 text file")
    if path.stat().st_size == 0:
        raise ConfigError(f"{path} is empty (0 bytes): there is no text to learn from or tokenize; give a non-empty corpus")
    return path


def iter_documents(path: Path, *, mode: str) -> Iterator[str]:
    """The documents of a UTF-8 corpus, streamed; ConfigError at the first byte that is not UTF-8
    (its line named) or when the file holds only whitespace."""
    if mode not in DOCUMENT_MODES:
        raise ConfigError(f"documents={mode!r} is not one of {', '.join(DOCUMENT_MODES)}")
    count = 0
    for document in _documents(path, mode=mode):
        count += 1
        yield document
    if count == 0:
        raise ConfigError(f"{path} holds only whitespace: there is no text to learn from or tokenize; "
                          "give a non-empty corpus")


def _documents(path: Path, *, mode: str) -> Iterator[str]:
    block: list[str] = []
    for line in _lines(path):
        text = line.rstrip("\r\n")
        if mode == "lines":
            if text.strip():
                yield text
        elif text.strip():
            block.append(text)
        elif block:
            yield "\n".join(block)
            block = []
    if block:
        yield "\n".join(block)


def _lines(path: Path) -> Iterator[str]:
    number = 0
    try:
        with open(path, "rb") as handle:
            for raw in handle:
                number += 1
                yield raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        bad = exc.object[exc.start : exc.start + 1].hex()
        raise ConfigError(
            f"{path} is not UTF-8 text: byte 0x{bad} on line {number} (column {exc.start + 1}); convert it first, "
            f"e.g. `iconv -f latin1 -t utf-8 {path} > {path}.utf8`"
        ) from None
    except OSError as exc:
        raise ConfigError(os_error_message(exc, "read the corpus")) from None


# ------------------------------------------------------------------------------------ training
def check_vocab_size(vocab_size: int) -> None:
    if vocab_size < MIN_VOCAB:
        raise ConfigError(f"--vocab-size {vocab_size} is too small: a byte-level BPE needs {BYTE_ALPHABET} byte tokens "
                          f"and {EOS_TOKEN}, so at least {MIN_VOCAB}; give --vocab-size {MIN_VOCAB} or more (e.g. 8000)")
    if vocab_size > 2**31 - 1:
        raise ConfigError(f"--vocab-size {vocab_size} is larger than a token id can be; give at most {2**31 - 1}")


def train_bpe(corpus: str | Path, out: str | Path, *, vocab_size: int, min_frequency: int = 2,
              documents: str = "paragraphs") -> dict:
    """Train a byte-level BPE (``tokenizers``' BpeTrainer over the 256-byte alphabet, with
    ``<|endoftext|>`` as id 0) on ``corpus`` and write it to ``out`` as a tokenizer.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    check_vocab_size(vocab_size)
    if min_frequency < 1:
        raise ConfigError(f"--min-frequency {min_frequency}: a merge must be seen at least once; give 1 or more")
    corpus = check_corpus(corpus)
    out = Path(out)
    refuse_overwriting_inputs([out], inputs=[corpus])
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=[EOS_TOKEN],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    try:  # a directory that cannot be made is said before the training, not after
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(write_error(exc, out=out, what="write the tokenizer")) from None
    tokenizer.train_from_iterator(iter_documents(corpus, mode=documents), trainer)
    try:
        write_atomic(out, tokenizer.to_str(pretty=True) + "\n")
    except OSError as exc:
        raise ConfigError(write_error(exc, out=out, what="write the tokenizer")) from None
    return {"vocab_size": tokenizer.get_vocab_size(with_added_tokens=True), "asked": vocab_size,
            "eos_token": EOS_TOKEN, "eos_id": tokenizer.token_to_id(EOS_TOKEN), "path": str(out)}


# ------------------------------------------------------------------------------------- loading
def tokenizer_file(path: str | Path) -> Path:
    """The tokenizer.json that ``path`` names: the file itself, or ``DIR/tokenizer.json``."""
    path = Path(path)
    if path.is_dir():
        found = path / "tokenizer.json"
        if not found.is_file():
            others = sorted(p.name for p in path.iterdir() if p.name in ("vocab.json", "merges.txt", "tokenizer.model"))
            hint = (f" (it has {', '.join(others)}: save it as tokenizer.json with transformers' "
                    "AutoTokenizer.from_pretrained(DIR).save_pretrained(DIR))") if others else ""
            raise ConfigError(f"{path} holds no tokenizer.json{hint}; give a tokenizer.json or a directory holding one")
        return found
    if path.is_file():
        return path
    if not path.is_absolute() and len(path.parts) <= 2 and not str(path).endswith(".json"):
        raise ConfigError(f"{path} is not a local file or directory (a hub id?); optbench reads tokenizers from disk only: "
                          "download it (e.g. `huggingface-cli download ID --local-dir DIR`) and give the directory")
    raise ConfigError(f"{path} does not exist; give a tokenizer.json (e.g. from `optbench data tokenizer`) "
                      "or a model directory holding one")


def load_tokenizer(path: str | Path, *, eos: str | None = None) -> LoadedTokenizer:
    """Parse the tokenizer ``path`` names and find its end-of-text token (``eos`` when given)."""
    from tokenizers import Tokenizer

    file = tokenizer_file(path)
    try:
        tokenizer = Tokenizer.from_file(str(file))
    except Exception as exc:  # the library raises a bare Exception with serde's message
        raise ConfigError(f"{file} is not a tokenizer the tokenizers library can read ({exc}); give a tokenizer.json "
                          "written by `optbench data tokenizer` or by transformers' save_pretrained") from None
    ids = tokenizer.get_vocab(with_added_tokens=True).values()
    if not ids:
        raise ConfigError(f"{file} has an empty vocabulary; train it first (`optbench data tokenizer`)")
    eos_token = eos if eos is not None else find_eos(tokenizer, file=file)
    eos_id = tokenizer.token_to_id(eos_token) if eos_token is not None else None
    if eos_token is not None and eos_id is None:
        raise ConfigError(f"{file} has no token {eos_token!r}; give --eos with one of its special tokens "
                          f"({', '.join(_special_tokens(tokenizer)[:8]) or 'it has none'})")
    return LoadedTokenizer(tokenizer=tokenizer, path=file, vocab_size=max(ids) + 1, eos_token=eos_token, eos_id=eos_id)


def find_eos(tokenizer, *, file: Path) -> str | None:
    """The end-of-text token: tokenizer_config.json's ``eos_token`` beside the file, else the
    token of config.json's ``eos_token_id``, else the first of the usual names the vocabulary has."""
    named = config_token(file.parent, tokenizer, kind="eos")
    if named is not None:
        return named
    return next((token for token in KNOWN_EOS if tokenizer.token_to_id(token) is not None), None)


def config_token(directory: Path, tokenizer, *, kind: str) -> str | None:
    """The ``{kind}_token`` (``eos``, ``bos``) that the configs beside a tokenizer name:
    tokenizer_config.json's ``{kind}_token``, else the token of config.json's ``{kind}_token_id``
    (the first, when it lists several)."""
    key = f"{kind}_token"
    token = _read_json(directory / "tokenizer_config.json").get(key)
    if isinstance(token, dict):  # transformers' AddedToken serialization
        token = token.get("content")
    if isinstance(token, str):
        return token
    fix = "fix it or give --eos TOKEN" if kind == "eos" else "fix it"
    if token is not None:  # named, but not as a token: guessing another would split documents elsewhere
        raise ConfigError(f"{directory / 'tokenizer_config.json'} gives {key} {json.dumps(token)[:40]}, not a token; {fix}")
    token_id = _read_json(directory / "config.json").get(f"{kind}_token_id")
    if isinstance(token_id, list) and token_id:
        token_id = token_id[0]
    if token_id is None:
        return None
    found = tokenizer.id_to_token(token_id) if isinstance(token_id, int) and not isinstance(token_id, bool) else None
    if found is None:
        raise ConfigError(f"{directory / 'config.json'} gives {kind}_token_id {json.dumps(token_id)[:40]}, which is no "
                          f"id of the tokenizer beside it; {fix}")
    return found


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{path} is not valid JSON ({exc}); fix it or give --eos TOKEN") from None
    return data if isinstance(data, dict) else {}


def _special_tokens(tokenizer) -> list[str]:
    return [t.content for t in tokenizer.get_added_tokens_decoder().values() if t.special]


# ----------------------------------------------------------------------------------- outputs
def refuse_overwriting_inputs(outputs: list[Path], *, inputs: list[Path], sidecar_of: Path | None = None) -> None:
    """ConfigError when an output would be written over one of the inputs (the same file by any
    name: a link, a relative path) or over a directory. ``sidecar_of``: the file whose sidecar
    is among the outputs (named in the message)."""
    for out in outputs:
        if out.is_dir():
            raise ConfigError(f"{out} is a directory; give a file name, e.g. {out / 'out.bin'}")
        for source in inputs:
            if _same_file(out, source):
                what = f"the sidecar of {sidecar_of}, {out}," if sidecar_of and out != sidecar_of else str(out)
                raise ConfigError(f"{what} would be written over the input {source}; give another output name")


def write_error(exc: OSError, *, out: Path, what: str) -> str:
    """``os_error_message`` naming ``out`` where the system named the temporary file beside it."""
    if exc.filename is None or Path(exc.filename).name.startswith(f".{out.name}."):  # None: closing it failed
        exc.filename = str(out)
    return os_error_message(exc, what)


def _same_file(a: Path, b: Path) -> bool:
    if a.exists() and b.exists():
        return os.path.samefile(a, b)
    return a.resolve() == b.resolve()
