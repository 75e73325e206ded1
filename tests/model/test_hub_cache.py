"""A hub id (``model.hf.config=org/name``) resolves to its snapshot in the local Hugging Face cache,
through huggingface_hub's own lookup, with no network; one line when it is not cached."""

from __future__ import annotations

import pytest

from optbench.config import to_config
from optbench.errors import ConfigError
from tests.helpers import FAST, compose_cfg

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def _cache_as_the_hub_lays_it_out(cache, repo_id: str):
    """``models--org--name/{refs/main, snapshots/<commit>/...}``: what ``hf download`` leaves."""
    from huggingface_hub.file_download import repo_folder_name
    from transformers import LlamaConfig

    repo = cache / repo_folder_name(repo_id=repo_id, repo_type="model")
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(COMMIT)
    snapshot = repo / "snapshots" / COMMIT
    LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=96, max_position_embeddings=64, bos_token_id=0,
                eos_token_id=1).save_pretrained(snapshot)
    return snapshot


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    return tmp_path / "hub"


def test_a_cached_hub_id_trains_from_its_snapshot_offline(hub_cache, tmp_path):
    from optbench.run.train import train

    _cache_as_the_hub_lays_it_out(hub_cache, "acme/tiny-llama")
    overrides = [*FAST, "train.steps=1", "measure.warmup_steps=0", "model=hf", "model.hf.config=acme/tiny-llama",
                 "train.seq_len=16"]
    cfg = to_config(compose_cfg(overrides))
    assert cfg.model.dim == 32 and cfg.model.vocab_size == 96  # read from the snapshot's config.json
    result = train(compose_cfg(overrides), run_dir=tmp_path / "run")
    assert result.status == "completed", result.error
    assert result.summary["model"]["hf"]["model_type"] == "llama"


def test_a_hub_id_not_in_the_cache_is_one_line_naming_the_download(hub_cache):
    with pytest.raises(ConfigError, match=r"model.hf.config=acme/absent looks like a Hugging Face hub id that is "
                                          r"not in the local cache .*hf download acme/absent"):
        to_config(compose_cfg(["model=hf", "model.hf.config=acme/absent", "train.seq_len=16"]))
