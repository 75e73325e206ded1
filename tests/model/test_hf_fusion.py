"""task=climate_text over a Hugging Face base (model=hf): the plan's fusion inserted into a
transformers decoder the tests write themselves (tiny LlamaConfig with GQA and GPT2Config,
save_pretrained with a tokenizer trained here), the base frozen, the texts in the base's tokens."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from optbench.config import compose, to_config
from optbench.data.captions import write_captions
from optbench.data.tokenizer import train_bpe
from optbench.errors import ConfigError
from optbench.model.counts import count_parameters
from optbench.model.decoder import blocks_of
from optbench.model.fusion import base_parameters
from optbench.model.weights import load_weights
from optbench.optim.optimizers import build_optimizer
from optbench.outputs import read_metrics
from optbench.run.train import train
from optbench.tasks import build_task
from optbench.training.build import build_model, materialize
from tests.helpers import assert_cached_decoding_matches, compose_cfg, once_per_session

transformers = pytest.importorskip("transformers")

VOCAB = 300


@pytest.fixture(scope="module")
def climate(tmp_path_factory):
    """A small NetCDF file, its captions (JSON lines and one per line); once per session (read only)."""
    def make(root):
        from optbench.data.netcdf.synth import synthetic_dataset

        ds = synthetic_dataset(days=20, step_hours=6, nlat=8, nlon=16, levels=(1000.0,))
        ds[["temperature", "u_wind", "v_wind", "pressure"]].to_netcdf(root / "data.nc", engine="h5netcdf")
        write_captions([str(root / "data.nc")], root / "captions.jsonl", variables=["temperature", "pressure"],
                       lines=str(root / "captions.txt"))

    return once_per_session(tmp_path_factory, "hf_fusion_climate", make)[0]


@pytest.fixture(scope="module")
def bases(climate, tmp_path_factory):
    """Per architecture, a directory as save_pretrained leaves it: config.json, safetensors (weights
    transformers initialized) and the tokenizer (a byte-level BPE trained here on the captions); once
    per session (read only)."""
    def make(root):
        from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig, PreTrainedTokenizerFast

        train_bpe(climate / "captions.txt", root / "tok.json", vocab_size=VOCAB, documents="lines")
        configs = {
            "llama": LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                                 num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=128,
                                 tie_word_embeddings=False),
            "gpt2": GPT2Config(n_embd=32, n_layer=4, n_head=4, vocab_size=VOCAB, n_positions=128, resid_pdrop=0.0,
                               embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0),
        }
        for name, config in configs.items():
            torch.manual_seed(1)
            AutoModelForCausalLM.from_config(config).save_pretrained(root / name)
            tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(root / "tok.json"), eos_token="<|endoftext|>",
                                                bos_token="<|endoftext|>")
            tokenizer.save_pretrained(root / name)

    root = once_per_session(tmp_path_factory, "hf_fusion_bases", make)[0]
    return {name: root / name for name in ("llama", "gpt2")}


def data(climate, *more: str, fusion: str = "gated") -> list[str]:
    return ["task=climate_text", f"fusion={fusion}", "data=netcdf", f"data.paths=[{climate / 'data.nc'}]",
            f"data.text={climate / 'captions.jsonl'}", "data.variables=[temperature,pressure,u_wind,v_wind]",
            "data.augment.enabled=false", "train.seq_len=24", "train.batch_size=4", "train.device=cpu",
            "estimate.predict=false", *more]  # the step's prediction only where a test reads it


def overrides(climate, base, *more: str, fusion: str = "gated") -> list[str]:
    return data(climate, "model=hf", f"model.hf.config={base}", f"model.hf.weights={base}", *more, fusion=fusion)


def built(climate, base, *more: str, fusion: str = "gated", seed: int = 0):
    """(task, model): the fused model, materialized from ``seed``, the base's weights loaded."""
    cfg = to_config(compose_cfg(overrides(climate, base, *more, fusion=fusion)))
    task = build_task(cfg)
    model = build_model(cfg, task)
    materialize(model, device=torch.device("cpu"), seed=seed)
    load_weights(model, base, config=str(base))
    return task, model


def first_batch(task):
    _, evaluation = task.build_datasets()
    return torch.utils.data.default_collate(evaluation.__getitems__(list(range(4))))


# ----------------------------------------------------------------------------------------- model
@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_gated_fusion_over_an_hf_base_is_the_base_at_init(climate, bases, arch):
    """Before training, the gated model's logits with a climate are the pretrained model's, bit
    for bit (transformers' from_pretrained, no optbench code); the fusion really runs inside the
    decoder (an open gate changes them); the base keeps transformers' parameter names."""
    from transformers import AutoModelForCausalLM

    task, model = built(climate, bases[arch])
    batch = first_batch(task)
    reference = AutoModelForCausalLM.from_pretrained(bases[arch], attn_implementation="sdpa").eval()
    with torch.no_grad():
        fused = task.forward(model, batch)
        expected = reference(task.inputs(batch)).logits
        assert torch.equal(fused, expected)
        assert torch.equal(model(task.inputs(batch)), expected)  # the base alone
        assert set(dict(base_parameters(model))) == set(dict(reference.named_parameters()))
        assert list(model.fusion.layers) == ["0", "2"]  # before every 2nd of the 4 decoder layers
        for block in model.fusion.layers.values():
            block.attn_gate.alpha.fill_(0.5)
        assert not torch.allclose(task.forward(model, batch), expected)
        assert torch.equal(model(task.inputs(batch)), expected)  # without a climate the hooks do nothing
        shuffled = torch.roll(task.context(batch), 1, dims=0)
        assert not torch.allclose(model(task.inputs(batch), context=shuffled), task.forward(model, batch))


def test_add_cross_attention_and_prefix_change_the_base(climate, bases):
    task, model = built(climate, bases["llama"], fusion="add")
    batch = first_batch(task)
    with torch.no_grad():
        base = model(task.inputs(batch))
        assert not torch.allclose(task.forward(model, batch), base)  # the climate added to the embeddings
    task, model = built(climate, bases["llama"], fusion="cross_attention")
    with torch.no_grad():
        assert not torch.allclose(task.forward(model, batch), model(task.inputs(batch)))
    task, model = built(climate, bases["gpt2"], fusion="prefix")  # learned positions: room for the climate tokens
    with torch.no_grad():
        fused, alone = task.forward(model, batch), model(task.inputs(batch))
        assert fused.shape == alone.shape and not torch.allclose(fused, alone)  # the climate positions dropped


def test_the_frozen_base_gets_no_gradients_no_optimizer_state_and_no_ddp_bucket(climate, bases, tmp_path):
    import torch.distributed as dist

    from optbench.training.data_parallel import apply_ddp

    cfg = to_config(compose_cfg(overrides(climate, bases["llama"], "fusion.freeze_base=true")))
    task = build_task(cfg)
    model = build_model(cfg, task)
    counts = count_parameters(model)
    fusion_numel = sum(p.numel() for p in model.fusion.parameters())
    assert counts["trainable"] == fusion_numel and counts["frozen"] == sum(p.numel() for _, p in base_parameters(model))
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        apply_ddp(model, world_size=1, device=torch.device("cpu"), compiled=False)
        materialize(model, device=torch.device("cpu"), seed=0)
        load_weights(model, bases["llama"], config="llama")
        before = {n: p.detach().clone() for n, p in base_parameters(model)}
        optimizer = build_optimizer(model, cfg=cfg.optimizer, lr=1e-2)
        reduced = []

        def count(state, bucket):  # what DDP hands to all-reduce, bucket by bucket
            reduced.append(bucket.buffer().numel())
            return dist.all_reduce(bucket.buffer(), async_op=True).get_future().then(lambda f: f.value()[0])

        model.register_comm_hook(None, count)
        batch = first_batch(task)
        task.losses(task.forward(model, batch), batch, with_aux=False).main.backward()
        optimizer.step()
        assert sum(reduced) == fusion_numel
        assert all(p.grad is None for _, p in base_parameters(model))
        stateful = {id(p) for p in optimizer.state}
        assert stateful == {id(p) for p in model.fusion.parameters()}
        assert all(torch.equal(p, before[n]) for n, p in base_parameters(model))
        assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in model.fusion.layers.parameters())
    finally:
        dist.destroy_process_group()


# ------------------------------------------------------------------------------------------ texts
def test_texts_are_tokenized_with_the_base_tokenizer(climate, bases):
    from tokenizers import Tokenizer

    task = build_task(to_config(compose_cfg(overrides(climate, bases["llama"], "train.seq_len=64"))))
    tokenizer = Tokenizer.from_file(str(bases["llama"] / "tokenizer.json"))
    eos = tokenizer.token_to_id("<|endoftext|>")
    texts = [json.loads(line)["text"] for line in (climate / "captions.jsonl").read_text().splitlines()]
    _, evaluation = task.build_datasets()
    item = evaluation[0]
    ids = tokenizer.encode(texts[int(item["sample"]) + task.history]).ids
    expected = ([eos, *ids, eos] + [eos] * 65)[:65]  # bos (= eos here), the text, eos, padding
    assert item["tokens"].tolist() == expected and int(item["length"]) == min(len(ids) + 2, 65)
    assert task.codec.vocab_size == VOCAB and task.codec.name.endswith("tokenizer.json")


def test_a_base_without_a_tokenizer_is_refused_naming_the_fix(climate, bases, tmp_path):
    """Refused when the texts are first needed (before any training); the estimate, which traces
    shapes only, needs no tokenizer."""
    preset = build_task(to_config(compose_cfg(data(climate, "model=hf_llama_tiny"))))
    batch = preset.example_batch(2)
    assert batch["tokens"].shape == (2, 25) and batch["frames"].shape[:2] == (2, 3)
    with pytest.raises(ConfigError, match="data.tokenizer=DIR_OR_FILE"):
        preset.build_datasets()
    # a tokenizer with more ids than the model's vocabulary
    big = tmp_path / "big.json"
    train_bpe(climate / "captions.txt", big, vocab_size=400, documents="lines")
    with pytest.raises(ConfigError, match=r"\(3[0-9][0-9] token ids\) but model.vocab_size=300"):
        build_task(to_config(compose_cfg([*overrides(climate, bases["llama"]), f"data.tokenizer={big}"]))).build_datasets()
    # bytes, said explicitly, for a base trained from scratch
    task = build_task(to_config(compose_cfg([*overrides(climate, bases["llama"]), "data.tokenizer=bytes"])))
    assert task.codec.name == "bytes"


# ------------------------------------------------------------------------------------ in training
def test_a_run_trains_only_the_fusion_and_its_estimate_is_the_measured_peak(climate, bases, tmp_path):
    """A gated run over the frozen pretrained base: trains, records the counts read back from the
    model, and its traced estimate equals MemTracker's peak (transformers' SDPA path, the default)."""
    run = ["fusion.freeze_base=true", "train.steps=3", "measure.warmup_steps=2",
           "train.eval_batches=1", "log.progress=log", "train.lr=3e-3", "estimate.predict=true", "estimate.in_run=true"]
    result = train(compose_cfg(overrides(climate, bases["llama"], *run)), run_dir=tmp_path / "run")
    assert result.status == "completed", result.error
    summary = result.summary
    memory = summary["memory"]
    assert "step 1" in memory["peak_source"] and memory["estimate_bytes"] == memory["peak_bytes"]
    assert summary["predicted"]["step_time_s"] > 0  # the fused HF step's ops, benchmarked here
    task, model = built(climate, bases["llama"])
    assert summary["model"]["trainable_params"] == sum(p.numel() for p in model.fusion.parameters())
    assert summary["model"]["params"] == count_parameters(model)["total"]
    assert summary["applied"]["weights"]["tensors"] == len(dict(base_parameters(model)))
    assert summary["applied"]["fusion"]["fusion_layers"] == 2 and summary["model"]["hf"]["blocks"] == 4
    losses = [r["loss"] for r in read_metrics(tmp_path / "run") if r["kind"] == "train"]
    assert len(losses) == 3 and np.isfinite(losses).all()
    metrics = summary["loss"]["eval_metrics"]  # the gates opened: the fused model is no longer the base
    assert metrics["fusion/loss_base"] > 0 and metrics["fusion/loss_true"] != metrics["fusion/loss_base"]


def test_an_encoder_trained_at_another_rope_base_is_refused_over_an_hf_base(climate, bases, tmp_path):
    """The encoder check compares the fields that change the encoder's numerics as the Hugging Face
    config sets them (a Llama's rope_theta and rms_norm_eps, derived into model.*): a forecaster
    trained at RoPE base 500000 is refused under a Llama at 10000, in one line naming both, exit 2."""
    small = ["model.dim=32", "model.heads=4", "model.ffn_dim=64", "model.layers=1", "model.norm_eps=1e-6"]
    forecaster = compose_cfg(["task=climate", "data=netcdf", f"data.paths=[{climate / 'data.nc'}]",
                              "data.variables=[temperature,pressure,u_wind,v_wind]", "data.augment.enabled=false",
                              "model.rope_theta=500000", *small, "train.device=cpu", "train.batch_size=4",
                              "train.steps=2", "measure.warmup_steps=1", "checkpoint.every=2", "train.eval_batches=1",
                              "log.progress=log", "measure.track_memory=false", "estimate.predict=false"])
    assert train(forecaster, run_dir=tmp_path / "climate").status == "completed"
    result = train(compose_cfg(overrides(climate, bases["llama"], f"fusion.encoder_checkpoint={tmp_path / 'climate'}",
                                         "train.steps=2", "measure.warmup_steps=1", "log.progress=log")),
                   run_dir=tmp_path / "fused")
    assert result.exit_code == 2 and "\n" not in result.error, result.error
    assert "has a trunk of rope_theta=500000.0 (here 10000.0)" in result.error  # norm_eps agrees: not named


def test_activation_checkpointing_recomputes_the_fusion_with_the_same_climate(climate, bases, tmp_path):
    """AC full on the HF decoder layers (whose hooks run the fusion blocks) and on the fusion
    blocks: the same losses as without, step for step."""
    run = ["fusion.freeze_base=true", "train.steps=3", "measure.warmup_steps=1", "train.eval_batches=1",
           "log.progress=log", "measure.track_memory=false", "train.lr=3e-3"]
    losses = {}
    for mode in ("none", "full"):
        result = train(compose_cfg(overrides(climate, bases["gpt2"], *run, f"checkpointing={mode}")),
                       run_dir=tmp_path / mode)
        assert result.status == "completed", result.error
        losses[mode] = [r["loss"] for r in read_metrics(tmp_path / mode) if r["kind"] == "train"]
    assert result.summary["applied"]["activation_checkpointing"]["fusion_blocks"] == 3  # encoder 1 + layers 2
    assert losses["full"] == losses["none"] and losses["none"][-1] != losses["none"][0]


def test_decoder_layers_are_found_structurally(climate, bases):
    """The fusion blocks precede the layers optbench.model.decoder found (GPT-2's transformer.h),
    each run once per forward, in order, with the climate encoded once."""
    task, model = built(climate, bases["gpt2"])
    order = []
    for name, layer in blocks_of(model):
        layer.register_forward_pre_hook(lambda m, a, name=name: order.append(f"layer {name}"))
    for name, block in model.fusion.layers.items():
        block.register_forward_pre_hook(lambda m, a, name=name: order.append(f"fusion {name}"))
    model.fusion.embed.register_forward_pre_hook(lambda m, a: order.append("encoder"))
    with torch.no_grad():
        task.forward(model, first_batch(task))
    assert model.decoder_parts.layers == "transformer.h"
    assert order == ["encoder", "fusion 0", "layer 0", "layer 1", "fusion 2", "layer 2", "layer 3"]


def test_the_fusion_is_initialized_from_the_seed_and_the_base_from_the_weights(climate, bases):
    _, a = built(climate, bases["llama"], seed=3)
    _, b = built(climate, bases["llama"], seed=3)
    _, c = built(climate, bases["llama"], seed=4)
    fa, fb, fc = (dict(m.fusion.named_parameters()) for m in (a, b, c))
    assert all(torch.equal(fa[n], fb[n]) for n in fa)
    assert any(not torch.equal(fa[n], fc[n]) for n in fa if "alpha" not in n)
    assert all(torch.isfinite(p).all() for p in fa.values())
    assert all(float(p.detach().abs().max()) == 0.0 for n, p in fa.items() if n.endswith("gate.alpha"))


def test_the_estimate_says_what_fits_on_one_two_and_four_gpus(climate, bases):
    """A fused model's estimate traces the step on 1 GPU and FSDP2 over 2 and 4 by default; the
    one-GPU row is the run's own trace, sharding lowers the peak per GPU."""
    from optbench.estimate.api import estimate
    from optbench.estimate.format import format_table

    cfg = to_config(compose([*overrides(climate, bases["llama"], "fusion.freeze_base=true"), "estimate.search=false"],
                            config_name="estimate"))
    result = estimate(cfg)
    rows = {row["gpus"]: row for row in result["fits_on"]}
    assert sorted(rows) == [1, 2, 4] and rows[1]["parallel"] == "single" and rows[4]["parallel"] == "fsdp2"
    assert rows[1]["peak_bytes"] == result["memory"]["traced"]["total"]
    assert rows[4]["peak_bytes"] < rows[2]["peak_bytes"] < rows[1]["peak_bytes"]
    assert all(row["verdict"] == "fits" for row in rows.values())
    model = result["model"]
    assert model["trainable_params"] + model["frozen_params"] == model["params"] and model["frozen_params"] > 0
    text = format_table(result)
    assert "on 2 GPUs    fsdp2:" in text and "frozen" in text
    lm = to_config(compose(["model=hf_llama_tiny", "train.seq_len=16", "estimate.search=false", "estimate.fits_on=[2]"],
                           config_name="estimate"))
    assert [row["gpus"] for row in estimate(lm)["fits_on"]] == [2]  # any model, when asked


def test_fsdp2_over_two_workers_trains_the_fusion_and_leaves_the_pretrained_base_as_loaded(climate, bases, tmp_path):
    """FSDP2 shards the HF decoder layers and the fusion blocks; the checkpoint's base equals the
    safetensors it was loaded from (read back through fusion.base_checkpoint's loader), its gate
    moved."""
    import torch.distributed.checkpoint as dcp

    from optbench.checkpoint.base import load_base

    run = ["fusion.freeze_base=true", "parallel=fsdp2", "parallel.nproc_per_node=2", "train.steps=3",
           "checkpoint.every=3", "measure.warmup_steps=1", "train.eval_batches=0", "log.progress=log",
           "measure.track_memory=false", "train.lr=3e-3"]  # what the checkpoint holds: no evaluation
    result = train(compose_cfg(overrides(climate, bases["llama"], *run)), run_dir=tmp_path / "run")
    assert result.status == "completed", result.error
    assert result.summary["applied"]["parallel"]["mode"] == "fsdp2" and result.summary["world_size"] == 2
    _, loaded = built(climate, bases["llama"])
    _, trained = built(climate, bases["llama"], seed=5)
    with torch.no_grad():  # whatever the base holds now, the checkpoint's replaces
        for _, p in base_parameters(trained):
            p.zero_()
    load_base(trained, tmp_path / "run/checkpoints")
    assert all(torch.equal(p, dict(base_parameters(loaded))[n]) for n, p in base_parameters(trained))
    gate = {"app": {"model": {"fusion.layers.0.attn_gate.alpha": torch.zeros(1)}}}
    dcp.load(gate, checkpoint_id=str(next((tmp_path / "run/checkpoints").glob("step-*"))), no_dist=True)
    assert gate["app"]["model"]["fusion.layers.0.attn_gate.alpha"].abs().item() > 0  # the fusion trained


@pytest.mark.parametrize(("arch", "kind"), [("llama", "cross_attention"), ("gpt2", "prefix"), ("llama", "add")])
def test_cached_decoding_over_an_hf_base_gives_the_uncached_logits(climate, bases, arch, kind):
    """optbench generate over model=hf: transformers' own cache, the fusion on the new positions."""
    task, model = built(climate, bases[arch], fusion=kind)
    model.eval()
    batch = first_batch(task)
    tokens, context = batch["tokens"][:, :10], task.context(batch)
    assert_cached_decoding_matches(model, task.cfg, tokens, context, prompt=4, rtol=1e-4)
