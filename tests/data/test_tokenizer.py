"""Real tokenizers: `optbench data tokenizer` trains a byte-level BPE, `optbench data tokenize
--tokenizer` packs documents with the end-of-text token into the token files data=tokens reads.
Every corpus and tokenizer here is written by the test; nothing is fetched. The `data` commands run
through the CLI's own ``main`` in this process (a new interpreter per case cost seconds each)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest

from optbench.cli import main
from optbench.data.tokens import TokenFile
from optbench.errors import ConfigError
from optbench.run.train import train
from tests.helpers import FAST, cli_one_line, compose_cfg

WORDS = ("the wind over the north sea turned cold and the pressure fell by twelve hectopascals while "
         "temperatures near Zürich stayed at 3.5 °C café résumé naïve storm front rain snow drought").split()


def write_corpus(path, *, documents: int = 120, seed: int = 0, separator: str = "\n\n") -> list[str]:
    """Documents of 1-4 lines of words (some non-ASCII), separated by ``separator``."""
    rng = random.Random(seed)
    docs = []
    for _ in range(documents):
        lines = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 14))) for _ in range(rng.randint(1, 4))]
        docs.append("\n".join(lines) if separator == "\n\n" else " ".join(lines))
    path.write_text(separator.join(docs) + "\n", encoding="utf-8")
    return docs


def decode_documents(out, meta) -> list[str]:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(meta["tokenizer"])
    ids = np.fromfile(out, dtype=meta["dtype"]).tolist()
    assert ids[-1] == meta["eos_id"]  # every document, the last included, ends with the end of text
    docs, current = [], []
    for i in ids:
        if i == meta["eos_id"]:
            docs.append(tokenizer.decode(current))
            current = []
        else:
            current.append(i)
    return docs


class Result:
    def __init__(self, returncode: int, stdout: str, stderr: str) -> None:
        self.returncode, self.stdout, self.stderr = returncode, stdout, stderr


@pytest.fixture
def data_cli(capsys):
    """``optbench data ARGS`` in this process: (exit status, stdout, stderr)."""
    def call(*args: str) -> Result:
        capsys.readouterr()
        try:
            main(["data", *args])
            code = 0
        except SystemExit as exc:
            code = exc.code
        out, err = capsys.readouterr()
        return Result(code, out, err)
    return call


@pytest.fixture
def corpus(tmp_path):
    path = tmp_path / "corpus.txt"
    return path, write_corpus(path)


@pytest.fixture
def bpe(tmp_path, corpus, data_cli):
    path = tmp_path / "tok.json"
    result = data_cli("tokenizer", str(corpus[0]), str(path), "--vocab-size", "340")
    assert result.returncode == 0, result.stderr
    return path


def test_trained_bpe_is_deterministic_and_round_trips(tmp_path, corpus, bpe, data_cli):
    from tokenizers import Tokenizer

    again = tmp_path / "again.json"
    result = data_cli("tokenizer", str(corpus[0]), str(again), "--vocab-size", "340")
    assert result.returncode == 0 and "340 tokens" in result.stdout, result.stderr
    assert again.read_bytes() == bpe.read_bytes()  # same corpus, same tokenizer
    # more than the corpus can give: trained all the same, and said so
    result = data_cli("tokenizer", str(corpus[0]), str(again), "--vocab-size", "5000")
    assert result.returncode == 0 and "(asked 5,000: the corpus has no more pairs" in result.stdout, result.stderr
    tokenizer = Tokenizer.from_file(str(bpe))
    assert tokenizer.get_vocab_size() == 340 and tokenizer.token_to_id("<|endoftext|>") == 0
    encoded = tokenizer.encode_batch(corpus[1])
    assert [tokenizer.decode(e.ids) for e in encoded] == corpus[1]
    # merges learned: far fewer tokens than bytes
    assert sum(len(e.ids) for e in encoded) < sum(len(d.encode()) for d in corpus[1]) / 2
    # a byte the corpus never had is still one token (the byte alphabet is complete)
    assert tokenizer.decode(tokenizer.encode("漢字 ∑ 🌧").ids) == "漢字 ∑ 🌧"


@pytest.mark.parametrize("mode", ["paragraphs", "lines"])
def test_tokenize_packs_documents_with_eos(tmp_path, bpe, mode, data_cli):
    text = tmp_path / f"{mode}.txt"
    docs = write_corpus(text, documents=40, seed=1, separator="\n\n" if mode == "paragraphs" else "\n")
    out = tmp_path / "corpus.bin"
    result = data_cli("tokenize", str(text), str(out), "--tokenizer", str(bpe), "--documents", mode)
    assert result.returncode == 0, result.stderr
    meta = json.loads((tmp_path / "corpus.bin.json").read_text())
    assert meta["dtype"] == "uint16" and meta["vocab_size"] == 340 and meta["eos_token"] == "<|endoftext|>"
    assert meta["documents"] == 40 and meta["num_tokens"] == out.stat().st_size // 2
    assert decode_documents(out, meta) == docs
    # the token file data=tokens reads holds exactly those ids, in windows of seq_len + 1
    windows = TokenFile(str(out), seq_len=16, split="train", dtype="auto", eval_fraction=0.1)
    assert windows.vocab_size == 340 and windows.tokenizer == str(bpe.resolve())
    assert windows[1]["tokens"].tolist() == np.fromfile(out, dtype=np.uint16)[16:33].tolist()


def test_a_model_directory_and_a_wide_vocabulary(tmp_path, data_cli):
    """A tokenizer not trained here (a word-level one of 70,000 ids, saved in a model directory
    with the tokenizer_config.json transformers writes): ids past 65,535 need uint32, and the
    end-of-text token is the one the config names, not a guess."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(70_000)} | {"[UNK]": 70_000, "</s>": 70_001, "<|endoftext|>": 70_002}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    tokenizer.save(str(model_dir / "tokenizer.json"))
    (model_dir / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "</s>"}}))
    text = tmp_path / "t.txt"
    text.write_text("w1 w69999 w65536\n\nw0 nope\n")
    result = data_cli("tokenize", str(text), str(tmp_path / "t.bin"), "--tokenizer", str(model_dir))
    assert result.returncode == 0, result.stderr
    meta = json.loads((tmp_path / "t.bin.json").read_text())
    assert meta["dtype"] == "uint32" and meta["vocab_size"] == 70_003 and meta["eos_id"] == 70_001
    assert np.fromfile(tmp_path / "t.bin", dtype=np.uint32).tolist() == [1, 69999, 65536, 70_001, 0, 70_000, 70_001]
    # a Hugging Face model whose vocabulary (from its config) is smaller: refused before a step
    small = train(compose_cfg([*FAST, "model=hf_llama_tiny", "data=tokens", f"data.path={tmp_path / 't.bin'}",
                               "train.seq_len=2", "train.batch_size=1"]), run_dir=tmp_path / "hf")
    assert small.exit_code == 2 and "vocabulary of 70,003" in small.error and "has 1,024" in small.error
    assert "model.hf.config_overrides.vocab_size=70003" in small.error
    assert not small.summary["steps"]


def test_an_end_of_text_token_the_configs_name_wrongly_is_refused_not_guessed(tmp_path, bpe, capsys):
    """tokenizer_config.json's eos_token of another shape, config.json's eos_token_id of no token:
    one line naming the file and the fix (the usual names were taken instead, splitting the
    documents at another token than the model's)."""
    from tests.helpers import cli_one_line

    text = tmp_path / "t.txt"
    text.write_text("the river\n\nthe sea\n")
    for name, config, says in (
            ("shape", ("tokenizer_config.json", {"eos_token": {"content": 5}}), 'tokenizer_config.json gives eos_token 5, not a token'),
            ("word", ("config.json", {"eos_token_id": "zero"}), 'config.json gives eos_token_id "zero", which is no id'),
            ("past", ("config.json", {"eos_token_id": 99999}), "config.json gives eos_token_id 99999, which is no id")):
        directory = tmp_path / name
        directory.mkdir()
        (directory / "tokenizer.json").write_bytes(Path(bpe).read_bytes())
        (directory / config[0]).write_text(json.dumps(config[1]))
        code, err = cli_one_line(capsys, "data", "tokenize", str(text), str(tmp_path / f"{name}.bin"), "--tokenizer",
                                 str(directory))
        assert code == 2 and str(directory / config[0]) in err and says in err and "--eos TOKEN" in err, err
        assert not (tmp_path / f"{name}.bin").exists()


def test_a_bpe_token_file_trains_and_a_small_model_vocab_is_refused(tmp_path, corpus, bpe, data_cli):
    out = tmp_path / "corpus.bin"
    assert data_cli("tokenize", str(corpus[0]), str(out), "--tokenizer", str(bpe)).returncode == 0
    result = train(compose_cfg([*FAST, "data=tokens", f"data.path={out}", "model.vocab_size=340"]),
                   run_dir=tmp_path / "run")
    assert result.status == "completed", result.error
    assert result.summary["loss"]["final"] < result.summary["loss"]["first"]
    small = train(compose_cfg([*FAST, "data=tokens", f"data.path={out}", "model.vocab_size=256"]),
                  run_dir=tmp_path / "small")
    assert small.exit_code == 2 and small.user_error and "\n" not in small.error  # one line, exit 2
    assert "340" in small.error and "256" in small.error and "model.vocab_size=340" in small.error
    summary = json.loads((tmp_path / "small" / "summary.json").read_text())
    assert summary["status"] == "failed" and not summary["steps"]  # refused before a step was trained


@pytest.fixture
def refused(data_cli):
    def call(*args: str) -> str:
        result = data_cli(*args)
        assert result.returncode == 2, (result.stdout, result.stderr)
        assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr
        return result.stderr
    return call


def test_bad_input_is_one_line_and_nothing_is_written(tmp_path, corpus, bpe, refused):
    text = str(corpus[0])
    bad = tmp_path / "bad.json"
    bad.write_text('{"version": "1.0", "model": ')
    assert "bad.json is not a tokenizer" in refused("tokenize", text, str(tmp_path / "a.bin"), "--tokenizer", str(bad))
    (tmp_path / "empty.txt").write_bytes(b"")
    (tmp_path / "blank.txt").write_text(" \n\n\t\n")
    for name in ("empty.txt", "blank.txt"):
        assert "no text to learn from" in refused("tokenize", str(tmp_path / name), str(tmp_path / "a.bin"),
                                                   "--tokenizer", str(bpe))
        assert "no text to learn from" in refused("tokenizer", str(tmp_path / name), str(tmp_path / "t.json"),
                                                   "--vocab-size", "300")
    latin = tmp_path / "latin.txt"
    latin.write_bytes(b"ok\n" + "temperature 3 °C\n".encode("latin-1"))
    for args in (("tokenize", str(latin), str(tmp_path / "a.bin"), "--tokenizer", str(bpe)),
                 ("tokenizer", str(latin), str(tmp_path / "t.json"), "--vocab-size", "300")):
        assert "not UTF-8" in (err := refused(*args)) and "0xb0 on line 2" in err
    assert "at least 257" in refused("tokenizer", text, str(tmp_path / "t.json"), "--vocab-size", "256")
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    for args in (("tokenize", text, str(blocker / "a.bin"), "--tokenizer", str(bpe)),
                 ("tokenizer", text, str(blocker / "t.json"), "--vocab-size", "300")):
        assert "a_file: " in refused(*args)
    long_name = str(tmp_path / ("d" * 5000))
    assert "File name too long" in refused("tokenize", text, long_name + ".bin", "--tokenizer", str(bpe))
    assert "File name too long" in refused("tokenizer", text, long_name + ".json", "--vocab-size", "300")
    assert not list(tmp_path.glob("a.bin*")) and not (tmp_path / "t.json").exists()
    assert not list(tmp_path.glob(".*.tmp"))  # no temporary file left behind either


def test_an_output_is_never_an_input(tmp_path, corpus, bpe, refused):
    text = corpus[0]
    before = {p: p.read_bytes() for p in (text, bpe)}
    link = tmp_path / "link.txt"
    link.symlink_to(text)
    cases = [
        ("tokenize", str(text), str(text), "--tokenizer", str(bpe)),  # the corpus
        ("tokenize", str(text), str(link), "--tokenizer", str(bpe)),  # the corpus by another name
        ("tokenize", str(text), str(bpe), "--tokenizer", str(bpe)),  # the tokenizer
        ("tokenize", str(text), str(tmp_path / "tok"), "--tokenizer", str(bpe)),  # its sidecar tok.json
        ("tokenize", str(text), str(text)),  # byte-level too
        ("tokenizer", str(text), str(link), "--vocab-size", "300"),
    ]
    for args in cases:
        assert "would be written over the input" in refused(*args)
    assert {p: p.read_bytes() for p in before} == before


def test_tokenizers_that_cannot_be_used(tmp_path, corpus, bpe, refused, data_cli):
    text, out = str(corpus[0]), str(tmp_path / "a.bin")
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "vocab.json").write_text("{}")
    assert "holds no tokenizer.json (it has vocab.json" in refused("tokenize", text, out, "--tokenizer",
                                                                     str(tmp_path / "model"))
    assert "a hub id?" in refused("tokenize", text, out, "--tokenizer", "meta-llama/Meta-Llama-3-8B")
    assert "has no token '<s>'" in refused("tokenize", text, out, "--tokenizer", str(bpe), "--eos", "<s>")
    # a tokenizer with no end-of-text token anywhere: the user must name one
    from tokenizers import Tokenizer, models

    plain = tmp_path / "plain.json"
    Tokenizer(models.WordLevel(vocab={"a": 0, "[UNK]": 1}, unk_token="[UNK]")).save(str(plain))
    assert "give --eos TOKEN" in refused("tokenize", text, out, "--tokenizer", str(plain))
    assert data_cli("tokenize", text, out, "--tokenizer", str(plain), "--eos", "[UNK]").returncode == 0


@pytest.mark.parametrize("where", ["train", "eval"])
def test_a_sidecar_that_understates_the_vocabulary_is_refused_before_training(tmp_path, where):
    """Ids past the sidecar's vocab_size (and the model's) in either split: one line naming the file."""
    ids = np.arange(4000, dtype=np.uint16) % 200
    ids[10 if where == "train" else -10] = 600  # model.vocab_size=512
    out = tmp_path / "t.bin"
    ids.tofile(out)
    (tmp_path / "t.bin.json").write_text(json.dumps({"dtype": "uint16", "vocab_size": 256, "num_tokens": 4000}))
    result = train(compose_cfg([*FAST, "data=tokens", f"data.path={out}", "model.vocab_size=512"]),
                   run_dir=tmp_path / "run")
    assert result.status == "failed" and result.exit_code == 2 and "\n" not in result.error and not result.summary["steps"]
    assert result.error.startswith(f"{out} holds token id 600 but its sidecar t.bin.json says vocab_size 256"), result.error
    with pytest.raises(ConfigError, match="holds token id 600 but"):  # chunked: the largest id in any chunk
        TokenFile(str(out), seq_len=8, split=where, dtype="auto", eval_fraction=0.1, chunk=7)
    (tmp_path / "t.bin.json").unlink()  # no sidecar: its largest id + 1 against the model's vocabulary
    result = train(compose_cfg([*FAST, "data=tokens", f"data.path={out}", "model.vocab_size=512",
                                "data.dtype=uint16"]), run_dir=tmp_path / "bare")
    assert result.exit_code == 2 and "needs a vocabulary of 601 (its largest id + 1) but the model's has 512" in result.error


# --------------------------------------------------------------------- huge documents, in pieces
def _hostile_text(rng: random.Random, words: int) -> str:
    """One long line of words joined by single spaces, double spaces, tabs and punctuation."""
    joins = (" ", " ", " ", "  ", "\t", ". ", ", ", " - ", " \t ")
    return "".join(rng.choice(WORDS) + rng.choice(joins) for _ in range(words)).rstrip()


class Spy:
    """A tokenizer that records what it is asked to encode (and may act on the n-th call)."""

    def __init__(self, tokenizer, on_call=None) -> None:
        self.tokenizer, self.on_call, self.calls = tokenizer, on_call, []

    def encode_batch(self, texts, **kw):
        self.calls.append([len(t) for t in texts])
        if self.on_call is not None:
            self.on_call(len(self.calls))
        return self.tokenizer.encode_batch(texts, **kw)

    encode_batch_fast = encode_batch  # the same ids; which one pack uses is its own business

    def __getattr__(self, name):
        return getattr(self.tokenizer, name)


@pytest.fixture
def spied(monkeypatch):
    """``optbench.data.pack`` with small pieces and its tokenizer spied on: the Spy of the last load."""
    import dataclasses

    from optbench.data import pack

    monkeypatch.setattr(pack, "PIECE_CHARS", 2000)
    monkeypatch.setattr(pack, "BATCH_CHARS", 6000)
    spies = []
    real = pack.load_tokenizer

    def load(*args, **kw):
        loaded = real(*args, **kw)
        spies.append(Spy(loaded.tokenizer, on_call=getattr(load, "on_call", None)))
        return dataclasses.replace(loaded, tokenizer=spies[-1])

    monkeypatch.setattr(pack, "load_tokenizer", load)
    return load, spies


def _one_shot(tokenizer_file, documents, eos_id) -> list[int]:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tokenizer_file))
    return [i for d in documents for i in (*tokenizer.encode(d, add_special_tokens=False).ids, eos_id)]


def _prepend_tokenizer(path):
    """A tokenizer whose normalizer prepends to every text it encodes (as older Llama files do): a
    piece encoded alone is not the same as inside its document."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers

    vocab = {w: i for i, w in enumerate(["<unk>", "</s>", *sorted({f"▁{w}" for w in WORDS} | set(WORDS) | {"▁"})])}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", " ▁")])
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(path))
    return path


def test_a_huge_line_is_encoded_in_pieces_to_the_same_ids(tmp_path, bpe, spied, data_cli):
    rng = random.Random(5)
    documents = [_hostile_text(rng, 3000), "a short one", _hostile_text(rng, 1500)]
    (tmp_path / "c.txt").write_text("\n\n".join(documents) + "\n")
    for tokenizer, eos in ((bpe, "<|endoftext|>"), (_prepend_tokenizer(tmp_path / "pre.json"), "</s>")):
        out = tmp_path / f"{tokenizer.stem}.bin"
        result = data_cli("tokenize", str(tmp_path / "c.txt"), str(out), "--tokenizer", str(tokenizer), "--eos", eos)
        assert result.returncode == 0, result.stderr
        meta = json.loads((tmp_path / f"{out.name}.json").read_text())
        assert np.fromfile(out, dtype=meta["dtype"]).tolist() == _one_shot(tokenizer, documents, meta["eos_id"])
    bpe_calls = spied[1][0].calls
    assert max(max(c) for c in bpe_calls) < 2100 and len(bpe_calls) > 3  # pieces, a few per encode call


def test_a_file_size_limit_stops_tokenize_early_with_the_path_and_the_fix(tmp_path, bpe, spied, capsys):
    from tests.run.test_reliability import file_size_limit

    rng = random.Random(6)
    (tmp_path / "c.txt").write_text(_hostile_text(rng, 20000) + "\n")  # ~190 KB on one line
    before = sorted(p.name for p in tmp_path.iterdir())
    out = tmp_path / "c.bin"
    with file_size_limit(8 * 1024):
        code, err = cli_one_line(capsys, "data", "tokenize", str(tmp_path / "c.txt"), str(out), "--tokenizer", str(bpe))
    assert code == 2 and err.startswith(f"optbench: error: cannot write the token file: {out}: File too large; "), err
    encoded = [c for c in spied[1][0].calls if max(c) > 1000]  # pieces (not the checks of the cuts around them)
    assert "ulimit -f" in err and 0 < len(encoded) < 10  # stopped at the first write past it, of ~30
    with file_size_limit(8 * 1024):
        code, err = cli_one_line(capsys, "data", "tokenize", str(tmp_path / "c.txt"), str(out))  # one token per byte
    assert code == 2 and f"cannot write the token file: {out}: File too large" in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_sigterm_during_tokenize_leaves_nothing(tmp_path, bpe, spied, capsys):
    import os
    import signal

    rng = random.Random(7)
    (tmp_path / "c.txt").write_text(_hostile_text(rng, 5000) + "\n")
    before = sorted(p.name for p in tmp_path.iterdir())
    load, _ = spied
    load.on_call = lambda n: n == 2 and os.kill(os.getpid(), signal.SIGTERM)
    def not_handled(*_):  # were tokenize not to handle it, SIGTERM would end pytest itself
        raise AssertionError("SIGTERM reached the handler tokenize should have replaced")

    previous = signal.signal(signal.SIGTERM, not_handled)
    try:
        code, err = cli_one_line(capsys, "data", "tokenize", str(tmp_path / "c.txt"), str(tmp_path / "c.bin"),
                                 "--tokenizer", str(bpe))
        assert signal.getsignal(signal.SIGTERM) is not_handled  # given back
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert code == 143 and "interrupted: stopped by SIGTERM" in err and f"{tmp_path / 'c.bin'} was not written" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == before
