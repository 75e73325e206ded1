"""``optbench data embed``: teacher embeddings of text pairs from a local encoder (a tiny BERT
and a tokenizer trained here, written with save_pretrained), mean-pooled over the attention mask,
written once into a memory-mapped file that task=energy_flow streams; bad input is one line, exit
2, nothing written over."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from optbench.data.embeddings import open_pairs
from optbench.data.tokenizer import train_bpe
from optbench.run.train import train
from tests.helpers import cli_one_line, compose_cfg, run_cli_here
from tests.model.test_energy_flow import ENERGY as SYNTHETIC

ENERGY = [o for o in SYNTHETIC if not o.startswith("data")]  # data=embeddings below

WIDTH = 32


@pytest.fixture(scope="module")
def encoder(tmp_path_factory):
    from transformers import BertConfig, BertModel, PreTrainedTokenizerFast

    root = tmp_path_factory.mktemp("encoder")
    lines = [f"the river carries {w} energy to the sea number {i}" for i, w in enumerate(["warm", "cold", "dim"] * 8)]
    (root / "corpus.txt").write_text("\n".join(lines) + "\n")
    train_bpe(root / "corpus.txt", root / "tok.json", vocab_size=300, documents="lines")
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(root / "tok.json"), pad_token="<|endoftext|>")
    torch.manual_seed(0)
    config = BertConfig(vocab_size=300, hidden_size=WIDTH, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=64)
    BertModel(config).save_pretrained(root / "bert")
    tokenizer.save_pretrained(root / "bert")
    pairs = [{"input": f"{a} flows {i}", "target": f"it reaches {b} {i}"} for i, (a, b) in
             enumerate(zip(["warm", "cold", "dim"] * 6, ["sea", "lake", "river"] * 6, strict=True))]
    (root / "pairs.jsonl").write_text("".join(json.dumps(p) + "\n" for p in pairs))
    return root


def test_embed_writes_mean_pooled_embeddings_that_training_streams(encoder, tmp_path, capsys):
    from transformers import AutoModel, AutoTokenizer

    out = tmp_path / "pairs.emb"
    result = run_cli_here("data", "embed", str(encoder / "pairs.jsonl"), str(out), "--encoder", str(encoder / "bert"),
                          capsys=capsys)
    assert result.returncode == 0, result.stderr
    pairs = open_pairs(out, width=WIDTH)
    assert pairs.count == 18 and pairs.texts[4] == ["cold flows 4", "it reaches lake 4"]
    # the mean over the attention mask of the encoder's last hidden states, text by text
    tokenizer, model = AutoTokenizer.from_pretrained(encoder / "bert"), AutoModel.from_pretrained(encoder / "bert")
    with torch.no_grad():
        alone = model(**tokenizer(["it reaches lake 4"], return_tensors="pt")).last_hidden_state.mean(1)[0]
    np.testing.assert_allclose(pairs.array[4, 1], alone.numpy(), atol=1e-5)
    assert isinstance(pairs.array, np.memmap)

    for load in ("memmap", "device"):
        run = train(compose_cfg([*ENERGY, "data=embeddings", f"data.path={out}", f"model.embed_dim={WIDTH}",
                                 f"data.load={load}", "train.steps=2", "measure.warmup_steps=1"]),
                    run_dir=tmp_path / load)
        assert run.status == "completed", run.error
        assert run.summary["applied"]["task"]["forms"]["load"] == load


def _pairs(tmp_path, lines: list[str]):
    path = tmp_path / "bad.jsonl"
    path.write_text("".join(line + "\n" for line in lines))
    return path


@pytest.mark.parametrize(("lines", "says"), [
    (['{"input": "a", "target": "b"}', '{"input": "c"}'], 'pair 2 has no "target" text field'),
    (['{"input": "a", "target": "b"}', '{"input": "  ", "target": "d"}'], 'pair 2 has an empty "input" text'),
])
def test_a_bad_pairs_file_is_one_line_and_writes_nothing(encoder, tmp_path, capsys, lines, says):
    out = tmp_path / "out.emb"
    code, err = cli_one_line(capsys, "data", "embed", str(_pairs(tmp_path, lines)), str(out), "--encoder",
                             str(encoder / "bert"))
    assert code == 2 and says in err and "bad.jsonl" in err
    assert not out.exists() and not (tmp_path / "out.emb.json").exists()


def test_a_directory_that_is_not_an_encoder_is_one_line(encoder, tmp_path, capsys):
    from transformers import GPT2Config, GPT2LMHeadModel

    GPT2LMHeadModel(GPT2Config(n_embd=16, n_layer=1, n_head=2, vocab_size=300)).save_pretrained(tmp_path / "gpt2")
    capsys.readouterr()  # transformers' progress bar
    for directory, says in ((tmp_path, "holds no config.json"), (tmp_path / "gpt2", "is not a usable")):
        code, err = cli_one_line(capsys, "data", "embed", str(encoder / "pairs.jsonl"), str(tmp_path / "o.emb"),
                                 "--encoder", str(directory))
        assert code == 2 and says in err and str(directory) in err
    assert not (tmp_path / "o.emb").exists()


def test_an_existing_output_is_never_written_over(encoder, tmp_path, capsys):
    out = tmp_path / "kept.emb"
    out.write_bytes(b"precious")
    code, err = cli_one_line(capsys, "data", "embed", str(encoder / "pairs.jsonl"), str(out), "--encoder",
                             str(encoder / "bert"))
    assert code == 2 and "exists" in err and out.read_bytes() == b"precious"


def test_embeddings_of_another_width_are_refused_naming_the_file_and_the_key(encoder, tmp_path, capsys):
    out = tmp_path / "pairs.emb"
    assert run_cli_here("data", "embed", str(encoder / "pairs.jsonl"), str(out), "--encoder", str(encoder / "bert"),
                        capsys=capsys).returncode == 0
    result = train(compose_cfg([*ENERGY, "data=embeddings", f"data.path={out}", "model.embed_dim=48"]),
                   run_dir=tmp_path / "run")
    assert result.status == "failed" and result.exit_code == 2
    assert f"{out} holds {WIDTH}-wide embeddings but model.embed_dim=48" in result.error
    assert f"set model.embed_dim={WIDTH}" in result.error


def test_damaged_encoders_and_pairs_files_are_one_line(encoder, tmp_path, capsys):
    """A weights file cut short, a line of JSON that is no pair object, and pairs whose vectors hold
    NaN (edited, damaged) are refused naming the file; the train command embed prints trains."""
    import shutil

    cut = tmp_path / "cut"
    shutil.copytree(encoder / "bert", cut)
    (cut / "model.safetensors").write_bytes((cut / "model.safetensors").read_bytes()[:5000])
    code, err = cli_one_line(capsys, "data", "embed", str(encoder / "pairs.jsonl"), str(tmp_path / "c.emb"),
                             "--encoder", str(cut))
    assert code == 2 and f"--encoder {cut} is not a usable Hugging Face encoder" in err
    lines = (encoder / "pairs.jsonl").read_text().splitlines()
    code, err = cli_one_line(capsys, "data", "embed", str(_pairs(tmp_path, [*lines[:3], "[1, 2]", *lines[3:]])),
                             str(tmp_path / "l.emb"), "--encoder", str(encoder / "bert"))
    assert code == 2 and "bad.jsonl line 4 is [1, 2], not a JSON object" in err
    assert not (tmp_path / "c.emb").exists() and not (tmp_path / "l.emb").exists()
    from transformers import BertModel

    broken = BertModel.from_pretrained(encoder / "bert")
    with torch.no_grad():
        broken.pooler.dense.weight.fill_(0.0)  # unused by the mean pooling
        broken.encoder.layer[0].output.dense.bias.fill_(float("nan"))
    broken.save_pretrained(tmp_path / "nan")
    shutil.copy(encoder / "bert" / "tokenizer.json", tmp_path / "nan")
    shutil.copy(encoder / "bert" / "tokenizer_config.json", tmp_path / "nan")
    capsys.readouterr()
    code, err = cli_one_line(capsys, "data", "embed", str(encoder / "pairs.jsonl"), str(tmp_path / "n.emb"),
                             "--encoder", str(tmp_path / "nan"))
    assert code == 2 and "gives NaN or infinite embeddings for 18 pair(s)" in err and not (tmp_path / "n.emb").exists()

    out = tmp_path / "pairs.emb"
    done = run_cli_here("data", "embed", str(encoder / "pairs.jsonl"), str(out), "--encoder", str(encoder / "bert"),
                        capsys=capsys)
    printed = done.stdout.split("train on them: optbench ")[1].split()
    run = train(compose_cfg([*printed[1:], "train.steps=1", "measure.warmup_steps=0", "train.batch_size=2",
                             "estimate.in_run=false", "estimate.predict=false"]), run_dir=tmp_path / "printed")
    assert run.status == "completed", run.error
    values = np.fromfile(out, dtype=np.float32)
    values[5 * 2 * WIDTH + 3] = np.nan  # pair 6
    values.tofile(out)
    with pytest.raises(Exception, match=r"pairs.emb holds NaN or infinite values \(pair 6"):
        open_pairs(out, width=WIDTH)
