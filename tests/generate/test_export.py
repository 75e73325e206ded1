"""``optbench export``: a trained run through transformers' own ``from_pretrained`` gives the logits
optbench's model of the run's last checkpoint gives."""

from __future__ import annotations

import torch

from optbench.generate.export import export_run
from optbench.generate.load import load_model
from optbench.model.export import rope_order
from optbench.run.train import train
from tests.helpers import FAST, cli_one_line, compose_cfg


def _same_logits(run, out, vocab: int) -> None:
    from transformers import AutoModelForCausalLM

    exported = AutoModelForCausalLM.from_pretrained(out).eval()
    ours = load_model(run).model
    ids = torch.randint(0, vocab, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        theirs = exported(input_ids=ids).logits
        mine = ours(ids)
    assert theirs.shape == mine.shape
    torch.testing.assert_close(theirs, mine, rtol=1e-5, atol=1e-5)
    assert mine.abs().max() > 0.1  # trained weights, not zeros


def test_optbench_s_decoder_exports_as_arcee_with_the_same_logits(finished, tmp_path, capsys):
    out = tmp_path / "export"
    code = None
    try:
        from optbench.cli import main

        main(["export", str(finished), str(out)])
    except SystemExit as exc:
        code = exc.code
    assert code in (None, 0)
    assert "as ArceeForCausalLM" in capsys.readouterr().out
    _same_logits(finished, out, vocab=1024)
    capsys.readouterr()
    code, err = cli_one_line(capsys, "export", str(finished), str(out))  # OUT is not empty now
    assert code == 2 and "not an empty directory" in err


def test_the_rope_order_pairs_channels_as_transformers_rotates_them():
    assert rope_order(8).tolist() == [0, 2, 4, 6, 1, 3, 5, 7]


def test_an_hf_run_exports_with_its_tokenizer(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoTokenizer, LlamaConfig

    model_dir = tmp_path / "llama"
    LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=96, max_position_embeddings=64, tie_word_embeddings=False,
                bos_token_id=0, eos_token_id=1).save_pretrained(model_dir)
    tokenizer = Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1, "b": 2}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(model_dir / "tokenizer.json"))
    run = tmp_path / "run"
    overrides = [*FAST, "train.steps=2", "measure.warmup_steps=0", "model=hf", f"model.hf.config={model_dir}",
                 "train.seq_len=16", "checkpoint.every=2"]
    assert train(compose_cfg(overrides), run_dir=run).status == "completed"
    written = export_run(run, tmp_path / "out")
    assert written["architecture"] == "LlamaForCausalLM" and written["step"] == 2
    _same_logits(run, tmp_path / "out", vocab=96)
    assert AutoTokenizer.from_pretrained(tmp_path / "out")("a b")["input_ids"] == [1, 2]


def test_a_missing_run_is_refused_and_nothing_is_written(tmp_path, capsys):
    code, err = cli_one_line(capsys, "export", str(tmp_path / "nothing"), str(tmp_path / "out"))
    assert code == 2 and "does not exist" in err and not (tmp_path / "out").exists()


def test_a_checkpoint_whose_record_is_corrupt_is_refused_in_one_line(finished, tmp_path, capsys):
    from tests.helpers import copy_of

    run = copy_of(finished, tmp_path)
    record = run / "checkpoints" / "step-00000004" / "optbench.json"
    for damaged in ("{bad", "[]"):
        record.write_text(damaged)
        code, err = cli_one_line(capsys, "export", str(run), str(tmp_path / "out"))
        assert code == 2 and "Traceback" not in err, err
        assert err.startswith(f"optbench: error: {record.parent} cannot be read: optbench.json ") and "step-*" in err, err
        assert not (tmp_path / "out").exists()


def test_an_export_that_cannot_be_written_leaves_nothing_and_can_be_tried_again(finished, tmp_path, capsys):
    """The weights do not fit (a full disk; here a 64 KiB file size limit): one line, no OUT that
    looks like a model, nothing half-written beside it; the same command then works, into OUT made
    empty beforehand too."""
    from tests.run.test_reliability import file_size_limit

    out = tmp_path / "export"
    with file_size_limit(64 * 1024):
        code, err = cli_one_line(capsys, "export", str(finished), str(out))
    assert code == 2 and err.startswith(f"optbench: error: cannot write the export into {out}: "), err
    assert not out.exists() and [p.name for p in tmp_path.iterdir()] == []
    out.mkdir()  # an empty directory made for it is written into as a new one would be
    export_run(finished, out)
    assert (out / "config.json").is_file() and any(out.glob("*.safetensors"))
    assert [p.name for p in tmp_path.iterdir()] == ["export"]
