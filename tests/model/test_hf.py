"""model=hf: Hugging Face causal LMs built from config directories the tests write themselves
(``save_pretrained`` of tiny ``LlamaConfig``, ``GPT2Config``, ``GPTNeoXConfig`` and ``Qwen2Config``
models; optbench's code never names Qwen2 or GPT-NeoX), under the optimization groups, against a
hand-written transformers loop, DDP/FSDP2, the estimate, and every bad input."""

from __future__ import annotations

import json
import math

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from optbench.config import to_config
from optbench.distributed import detect_machine
from optbench.errors import ConfigError
from optbench.estimate.api import count_model
from optbench.estimate.tracer import trace_step
from optbench.model.counts import count_params
from optbench.model.decoder import decoder_parts
from optbench.model.weights import load_weights
from optbench.outputs import read_metrics
from optbench.run.train import train
from optbench.tasks import build_task
from optbench.training import preflight
from optbench.training.build import build_model, build_train_loader, materialize, seed_everything
from tests.helpers import TEST_DEFAULTS, compose_cfg, once_per_session, read_summary, run_cli_here

transformers = pytest.importorskip("transformers")

# the step's prediction (a per-op benchmark before the loop) only where a test reads it
RUN = ["train.device=cpu", "train.steps=4", "train.batch_size=4", "train.seq_len=16", "measure.warmup_steps=1",
       "train.eval_batches=1", "log.progress=log", "train.warmup_steps=2", "estimate.predict=false", *TEST_DEFAULTS]
SHAPE = dict(vocab_size=96, max_position_embeddings=64)


def _tiny_configs() -> dict:
    from transformers import GPT2Config, GPTNeoXConfig, LlamaConfig, Qwen2Config

    return {
        "llama": LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=2, **SHAPE),
        "gpt2": GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=96, n_positions=64, resid_pdrop=0.0,
                           embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0),
        "neox": GPTNeoXConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                              **SHAPE),
        "qwen2": Qwen2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=2, tie_word_embeddings=True, **SHAPE),
    }


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    """A config.json and safetensors (random weights transformers initialized) per architecture;
    Qwen2's sharded into several files with an index. Written once per session (read only)."""
    def make(root):
        from transformers import AutoModelForCausalLM

        for name, config in _tiny_configs().items():
            torch.manual_seed(1)
            model = AutoModelForCausalLM.from_config(config)
            model.save_pretrained(root / name, max_shard_size="8KB" if name == "qwen2" else "50GB")

    root, _ = once_per_session(tmp_path_factory, "hf_dirs", make)
    return {name: root / name for name in _tiny_configs()}


def hf(path, *more: str) -> list[str]:
    return ["model=hf", f"model.hf.config={path}", "train.seq_len=16", *more]


# ---------------------------------------------------------------------------------- presets
@pytest.mark.parametrize(("preset", "published"), [
    ("hf_llama3_8b", 8_030_261_248), ("hf_gpt2_large", 774_030_080), ("hf_gpt2_xl", 1_557_611_200),
    ("hf_gpt_neo_1.3b", 1_315_575_808), ("hf_llama3.2_1b", 1_235_814_400), ("hf_llama_tiny", 1_049_728)])
def test_presets_count_what_transformers_counts(preset, published):
    """Built from config only (meta device): the count equals transformers' own num_parameters()
    of the same architecture built by transformers alone, and the published figure."""
    from transformers import AutoConfig, AutoModelForCausalLM

    kernel = "math" if preset == "hf_gpt_neo_1.3b" else "sdpa"  # transformers has no sdpa path for GPT-Neo
    cfg = to_config(compose_cfg([f"model={preset}", f"attention={kernel}"]))
    model = build_model(cfg, build_task(cfg))
    assert all(p.device.type == "meta" for p in model.parameters())
    reference_config = AutoConfig.for_model(cfg.model.hf.model_type, **cfg.model.hf.config_overrides)
    with torch.device("meta"):
        reference = AutoModelForCausalLM.from_config(reference_config)
    assert count_params(model) == reference.num_parameters() == (published or reference.num_parameters())
    assert count_model(cfg).params == count_params(model)


def test_unnamed_architectures_are_found_structurally(dirs):
    """Qwen2 and GPT-NeoX are named nowhere in optbench: their blocks, embedding, final norm and head
    are found by structure; model.hf.layers_path overrides the search, and a wrong one is refused."""
    expected = {"qwen2": ("model.layers", "model.embed_tokens", "model.norm", "lm_head"),
                "neox": ("gpt_neox.layers", "gpt_neox.embed_in", "gpt_neox.final_layer_norm", "lm_head"),
                "gpt2": ("transformer.h", "transformer.wte", "transformer.ln_f", "lm_head")}
    for name, (layers, embed, norm, head) in expected.items():
        cfg = to_config(compose_cfg(hf(dirs[name])))
        parts = decoder_parts(build_model(cfg, build_task(cfg)))
        assert (parts.layers, parts.embed, parts.norm, parts.head) == (layers, embed, norm, head)
    cfg = to_config(compose_cfg(hf(dirs["qwen2"], "model.hf.layers_path=model.embed_tokens")))
    with pytest.raises(ConfigError, match="not a ModuleList/ModuleDict"):
        build_model(cfg, build_task(cfg))


# --------------------------------------------------------------------------------- training
def test_training_equals_a_hand_written_transformers_loop_bit_for_bit(dirs, tmp_path):
    """optbench train of a Llama directory with its weights against from_pretrained and a plain
    loop (forward -> logits -> cross-entropy, clip, AdamW, warmup-cosine) on the same batches:
    identical losses and gradient norms, == on floats."""
    from transformers import AutoModelForCausalLM

    overrides = hf(dirs["llama"], f"model.hf.weights={dirs['llama']}", *RUN, "task.z_loss_weight=0",
                   "train.grad_accum=2")
    result = train(compose_cfg(overrides), run_dir=tmp_path)
    assert result.status == "completed", result.error
    recorded = [(r["loss"], r["grad_norm"]) for r in read_metrics(tmp_path) if r["kind"] == "train"]

    cfg = to_config(compose_cfg(overrides))
    t = cfg.train
    seed_everything(t.seed)
    train_set, _ = build_task(cfg).build_datasets()
    batches = iter(build_train_loader(train_set, cfg=cfg, machine=detect_machine("cpu")))
    model = AutoModelForCausalLM.from_pretrained(dirs["llama"], dtype=torch.float32)
    model.train()
    optimizer = torch.optim.AdamW(
        [{"params": [p for p in model.parameters() if p.dim() >= 2], "weight_decay": cfg.optimizer.weight_decay},
         {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0}],
        lr=t.lr, betas=tuple(cfg.optimizer.betas), eps=cfg.optimizer.eps, foreach=True)

    def factor(step: int) -> float:
        if step < t.warmup_steps:
            return (step + 1) / t.warmup_steps
        progress = min(1.0, (step - t.warmup_steps) / (t.steps - t.warmup_steps))
        return t.min_lr_ratio + (1 - t.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
    expected = []
    for _ in range(t.steps):
        total = torch.zeros(())
        for _ in range(t.grad_accum):
            tokens = next(batches)["tokens"]
            logits = model(input_ids=tokens[:, :-1], use_cache=False).logits
            loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
            (loss / t.grad_accum).backward()
            total += loss.detach()
        norm = torch.nn.utils.clip_grad_norm_(list(model.parameters()), t.clip_grad)
        expected.append(tuple(torch.stack([total / t.grad_accum, norm]).tolist()))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
    assert recorded == expected
    summary = result.summary
    assert summary["model"]["hf"]["class"] == "LlamaForCausalLM" and summary["applied"]["weights"]["tensors"] == 21


def test_weights_equal_from_pretrained(dirs):
    """A sharded directory (Qwen2, tied head, 8 KB shards + index) and files keeping the hub's
    historical names (GPT-NeoX's embed_out, read through transformers' own renamings): the loaded
    model equals from_pretrained's, tensor for tensor, and a tied head stays tied."""
    from transformers import AutoModelForCausalLM

    assert len(list(dirs["qwen2"].glob("*.safetensors"))) > 1 and (dirs["qwen2"] / "model.safetensors.index.json").exists()
    for name in ("qwen2", "neox", "gpt2"):
        cfg = to_config(compose_cfg(hf(dirs[name])))
        model = build_model(cfg, build_task(cfg))
        materialize(model, device=torch.device("cpu"), seed=123)
        load_weights(model, dirs[name], config=name)
        reference = AutoModelForCausalLM.from_pretrained(dirs[name], dtype=torch.float32).state_dict()
        mine = model.state_dict()
        assert mine.keys() == reference.keys()
        assert all(torch.equal(mine[k], reference[k]) for k in mine), name
        if name in ("qwen2", "gpt2"):
            assert model.get_output_embeddings().weight is model.get_input_embeddings().weight


def test_activation_checkpointing_none_and_full_give_identical_losses(dirs, tmp_path):
    """GPT-2 (tied head, Conv1D projections): per-block checkpointing recomputes and changes nothing."""
    runs = {}
    for mode in ("none", "full"):
        result = train(compose_cfg(hf(dirs["gpt2"], *RUN, f"checkpointing={mode}")), run_dir=tmp_path / mode)
        assert result.status == "completed", result.error
        runs[mode] = [(r["loss"], r["grad_norm"]) for r in read_metrics(tmp_path / mode) if r["kind"] == "train"]
        assert result.summary["applied"]["activation_checkpointing"]["blocks"] == (2 if mode == "full" else 0)
    assert runs["none"] == runs["full"]


def test_attention_goes_through_the_models_own_switch(dirs, tmp_path):
    """attention=math runs transformers' eager attention (read back from the built model), sdpa its
    sdpa path: the same losses to rounding; flex, which GPT-2 cannot run, is refused by the check
    with the reason, never replaced."""
    losses = {}
    for kernel in ("sdpa", "math"):
        result = train(compose_cfg(hf(dirs["qwen2"], *RUN, "train.steps=2", f"attention={kernel}")),
                       run_dir=tmp_path / kernel)
        assert result.status == "completed", result.error
        assert result.summary["applied"]["attention"] == kernel
        assert result.summary["model"]["hf"]["attn_implementation"] == {"sdpa": "sdpa", "math": "eager"}[kernel]
        losses[kernel] = [r["loss"] for r in read_metrics(tmp_path / kernel) if r["kind"] == "train"]
    assert losses["sdpa"] == pytest.approx(losses["math"], rel=1e-5)
    reasons = preflight.gpu_cluster_reasons(to_config(compose_cfg(hf(dirs["gpt2"], "attention=flex"))), world_size=1)
    assert any("attn_implementation=flex_attention" in r and "GPT2" in r for r in reasons)


def test_optimizers_and_float8_see_the_decoder_blocks(dirs):
    """Muon takes the 2-D weights inside the blocks (GPT-2's Conv1D ones too), AdamW the rest;
    float8 (torchao converts nn.Linear) is refused for GPT-2's Conv1D blocks, with the reason."""
    from optbench.optim.optimizers import build_optimizer

    cfg = to_config(compose_cfg(hf(dirs["gpt2"], "optimizer=muon")))
    model = build_model(cfg, build_task(cfg))
    materialize(model, device=torch.device("cpu"), seed=0)
    optimizer = build_optimizer(model, cfg=cfg.optimizer, lr=1e-3)
    muon = {id(p) for g in optimizer.optimizers["muon"].param_groups for p in g["params"]}
    expected = {id(p) for n, p in model.named_parameters() if n.startswith("transformer.h.") and p.ndim == 2}
    assert muon == expected and len(expected) == 8
    reasons = preflight.gpu_cluster_reasons(to_config(compose_cfg(hf(dirs["gpt2"], "precision=float8"))), world_size=1)
    assert any("Conv1D" in r and "use precision=bf16" in r for r in reasons)
    assert not preflight.gpu_cluster_reasons(to_config(compose_cfg(hf(dirs["llama"], "precision=float8",
                                                                         "train.seq_len=16"))), world_size=1)


# the Qwen2 runs the two-rank tests compare: their training losses alone (no evaluation, no memory
# tracking), the 4 samples of a step in one process or over 2 ranks x 2
QWEN = [*RUN, "train.eval_batches=0", "measure.track_memory=false"]


@pytest.fixture(scope="module")
def single_qwen(dirs, tmp_path_factory):
    """The single process's loss curve, the weights read from the sharded directory; once per session."""
    def make(run_dir):
        result = train(compose_cfg(hf(dirs["qwen2"], f"model.hf.weights={dirs['qwen2']}", *QWEN)), run_dir=run_dir)
        assert result.status == "completed", result.error
        return [r["loss"] for r in read_metrics(run_dir) if r["kind"] == "train"]

    return once_per_session(tmp_path_factory, "hf_single_qwen", make)[1]


def test_ddp_equals_single_process(dirs, tmp_path, single_qwen):
    """2 gloo ranks x 2 samples, the weights read by each rank: the single process's curve within 1e-6."""
    args = hf(dirs["qwen2"], f"model.hf.weights={dirs['qwen2']}", *QWEN, "train.batch_size=2", "parallel=ddp",
              "parallel.nproc_per_node=2")
    result = train(compose_cfg(args), run_dir=tmp_path)
    assert result.status == "completed", result.error
    assert result.summary["world_size"] == 2 and result.summary["applied"]["parallel"]["mode"] == "ddp"
    losses = [r["loss"] for r in read_metrics(tmp_path) if r["kind"] == "train"]
    assert losses == pytest.approx(single_qwen, rel=1e-6, abs=1e-6) and len(losses) == 4


def test_fsdp2_trains_from_sharded_weights_and_resumes_exactly(dirs, tmp_path, single_qwen):
    """FSDP2 per decoder block then the root, each rank reading only its shards of the weights:
    the single process's curve; resumed from its step-2 checkpoint, steps 2.. again bit for bit."""
    args = hf(dirs["qwen2"], f"model.hf.weights={dirs['qwen2']}", *QWEN, "train.batch_size=2", "parallel=fsdp2",
              "parallel.nproc_per_node=2", "checkpoint.every=2", "checkpoint.keep_last=0")
    result = train(compose_cfg(args), run_dir=tmp_path)
    assert result.status == "completed", result.error
    straight = [r["loss"] for r in read_metrics(tmp_path) if r["kind"] == "train"]
    assert straight == pytest.approx(single_qwen, rel=1e-5) and len(straight) == 4
    parallel = result.summary["applied"]["parallel"]
    assert parallel["mode"] == "fsdp2" and parallel["sharded_blocks"] == 2
    resumed = train(compose_cfg([*args, f"checkpoint.resume={tmp_path}/checkpoints/step-00000002"]), run_dir=tmp_path)
    assert resumed.status == "completed", resumed.error
    assert resumed.summary["applied"]["checkpoint"]["resumed_step"] == 2
    assert [r["loss"] for r in read_metrics(tmp_path) if r["kind"] == "train"] == straight


MODULE = ["model=module", "+model.module._target_=tests.model.custom_lm.build", "model.dim=32", "model.layers=2",
          "model.heads=4", "model.ffn_dim=64", "model.vocab_size=96"]


def test_a_users_own_module_goes_the_same_way(tmp_path):
    """model=module: a factory returning a causal LM with names optbench never saw; its parts found
    structurally, activation checkpointing per block with the same losses as without, the estimate
    traced; a shape that disagrees with model.* and an attention kernel it cannot switch are refused."""
    cfg = to_config(compose_cfg([*MODULE, "train.seq_len=16"]))
    parts = decoder_parts(build_model(cfg, build_task(cfg)))
    assert (parts.embed, parts.layers, parts.norm, parts.head) == ("tok", "stack", "final", "unembed")
    curves = {}
    for mode in ("none", "full"):
        result = train(compose_cfg([*MODULE, *RUN, "train.steps=3", f"checkpointing={mode}", "estimate.in_run=true"]),
                       run_dir=tmp_path / mode)
        assert result.status == "completed", result.error
        assert result.summary["memory"]["estimate_bytes"] is not None
        curves[mode] = [r["loss"] for r in read_metrics(tmp_path / mode) if r["kind"] == "train"]
    assert curves["none"] == curves["full"]
    with pytest.raises(ConfigError, match="set model.vocab_size=96"):
        bad = to_config(compose_cfg([*MODULE, "model.vocab_size=128"]))
        build_model(bad, build_task(bad))
    reasons = preflight.gpu_cluster_reasons(to_config(compose_cfg([*MODULE, "attention=math"])), world_size=1)
    assert any("runs its own attention" in r for r in reasons)


# --------------------------------------------------------------------------------- estimate
def test_estimate_traces_the_hf_step_and_stacks_it_byte_for_byte():
    """A 10-block HF Llama and a 20-block GPT-Neo (global and local attention alternating: a unit of
    2 blocks, its attention_types resized with the depth): the stacked trace equals the whole
    model's, component for component. The Llama's FLOPs/token (GQA: smaller k/v projections, the
    scores at the query width) equal what FlopCounterMode counts over a real forward+backward."""
    neo = to_config(compose_cfg(["model=hf_gpt_neo_1.3b", "attention=math", "train.seq_len=16", *(
        f"model.hf.config_overrides.{k}={v}" for k, v in (("hidden_size", 32), ("num_layers", 20), ("num_heads", 4),
                                                           ("vocab_size", 96), ("attention_types", "[[[global,local],10]]")))]))
    assert neo.model.block_period() == 2
    cfg = to_config(compose_cfg(["model=hf_llama_tiny", "model.hf.config_overrides.num_hidden_layers=10",
                                 "model.hf.config_overrides.hidden_size=32", "model.hf.config_overrides.intermediate_size=64",
                                 "train.seq_len=16", "attention=math"]))
    for each, unit in ((cfg, "2 and 3 blocks"), (neo, "4 and 6 blocks")):
        stacked = trace_step(each, world_size=1, micro_batch=2, target="cpu", stacked=True)
        whole = trace_step(each, world_size=1, micro_batch=2, target="cpu", stacked=False)
        assert stacked.method.startswith(f"stacked from traces of {unit}"), stacked.method
        assert stacked.steady_peak().components == whole.steady_peak().components
    task = build_task(cfg)
    model = build_model(cfg, task)
    materialize(model, device=torch.device("cpu"), seed=0)
    batch = {"tokens": torch.randint(0, cfg.model.vocab_size, (2, 17))}
    with FlopCounterMode(display=False) as counter:
        task.losses(model(task.inputs(batch)), batch, with_aux=False).total.backward()
    assert counter.get_total_flops() == count_model(cfg).flops_per_token * 2 * 16



def test_a_compiled_checkpointed_llama_is_estimated_within_2_percent_of_its_measured_peak(tmp_path):
    """compile= with full checkpointing on a Llama block (SwiGLU, grouped KV heads, rotary): its
    measured peak is in a block's compiled backward, where Inductor computes the gate's and the up
    projection's gradients and the down projection's input in one kernel, so the three are live at
    once. The estimate ran them one after another: 7.5% under the profiler's peak at 8 x 128
    tokens (10.6% before the fused values' inputs were held); with the kernels' order, exact here."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(hidden_size=128, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=1024, max_position_embeddings=256)
    torch.manual_seed(1)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "llama")
    result = train(compose_cfg(hf(tmp_path / "llama", "train.device=cpu", "attention=math", "compile=default",
                                  "ac=full", "train.batch_size=8", "train.seq_len=128", "train.steps=3",
                                  "measure.warmup_steps=2", "train.eval_batches=0", "log.progress=log",
                                  "estimate.predict=false", "estimate.in_run=true")), run_dir=tmp_path / "run")
    memory = result.summary["memory"]
    assert result.status == "completed", result.error
    assert "profile_memory" in memory["peak_source"]
    assert abs(memory["estimate_bytes"] - memory["peak_bytes"]) <= 0.02 * memory["peak_bytes"], memory

def test_a_run_records_the_traced_estimate_beside_the_measured_peak(dirs, tmp_path):
    """The CPU trace of the run's own step against MemTracker on the run's real tensors (step 1):
    byte for byte with transformers' eager attention (attention=math) and its SDPA path, as for
    optbench's own model (the SDPA trace kept transformers' causal mask, which a real run skips)."""
    measured = {}
    for kernel in ("math", "sdpa"):
        result = train(compose_cfg(hf(dirs["gpt2"], *RUN, "train.steps=3", "measure.warmup_steps=2",
                                      f"attention={kernel}", "estimate.predict=true", "estimate.in_run=true")), run_dir=tmp_path / kernel)
        memory = result.summary["memory"]
        assert "step 1" in memory["peak_source"]
        assert result.summary["predicted"]["step_time_s"] > 0  # the HF step's ops, benchmarked here
        measured[kernel] = (memory["estimate_bytes"], memory["peak_bytes"])
    assert measured["math"][0] == measured["math"][1]
    assert measured["sdpa"][0] == measured["sdpa"][1]


# ------------------------------------------------------------------------------- bad input
def test_bad_model_directories_name_the_fix(dirs, tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "config.json").write_text('{"model_type": "llama", ')
    from transformers import ViTConfig

    ViTConfig().save_pretrained(tmp_path / "vit")
    cases = {
        "meta-llama/Meta-Llama-3-8B": "looks like a Hugging Face hub id that is not in the local cache",
        str(tmp_path / "missing"): "no such directory",
        str(tmp_path / "empty"): "holds no config.json",
        str(tmp_path / "broken"): "is not valid JSON",
        str(tmp_path / "vit"): "is not a causal language model",
    }
    for path, message in cases.items():
        with pytest.raises(ConfigError, match=message):
            to_config(compose_cfg(hf(path)))
    with pytest.raises(ConfigError, match="change it with model.hf.config_overrides.hidden_size=64"):
        to_config(compose_cfg(hf(dirs["llama"], "model.dim=64")))
    config = json.loads((dirs["llama"] / "config.json").read_text())
    for name, change, message in (  # shapes no model has: the field, where it came from and the fix
            ("kv3", {"num_key_value_heads": 3}, "config.json gives num_key_value_heads=3 for num_attention_heads=4: the "
             "key/value heads must divide the attention heads (one of 1, 2, 4); set model.hf.config_overrides.num_key_value_heads=N"),
            ("width0", {"hidden_size": 0}, "config.json gives hidden_size=0, not a positive integer; fix it there or set "
             "model.hf.config_overrides.hidden_size=N"),
            ("depth", {"num_hidden_layers": -2}, "config.json gives num_hidden_layers=-2, not a positive integer")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps({**config, **change}))
        with pytest.raises(ConfigError) as refused:
            to_config(compose_cfg(hf(tmp_path / name)))
        assert str(refused.value).startswith(str(tmp_path / name / "config.json")) and message in str(refused.value)
    with pytest.raises(ConfigError, match=r"model.hf.config_overrides gives num_key_value_heads=3"):
        to_config(compose_cfg(hf(dirs["llama"], "+model.hf.config_overrides.num_key_value_heads=3")))
    with pytest.raises(ConfigError, match="max_position_embeddings=64"):
        cfg = to_config(compose_cfg(hf(dirs["llama"], "train.seq_len=128")))
        build_model(cfg, build_task(cfg))


def test_weights_that_do_not_match_the_config_name_both_shapes(dirs, tmp_path):
    config = json.loads((dirs["llama"] / "config.json").read_text())
    (tmp_path / "wide").mkdir()
    (tmp_path / "wide" / "config.json").write_text(json.dumps({**config, "intermediate_size": 96}))
    reasons = preflight.gpu_cluster_reasons(to_config(compose_cfg(
        hf(tmp_path / "wide", f"model.hf.weights={dirs['llama']}", "train.seq_len=16"))), world_size=1)
    assert any("[64, 32]" in r and "[96, 32]" in r for r in reasons), reasons
    reasons = preflight.gpu_cluster_reasons(to_config(compose_cfg(
        hf(dirs["llama"], f"model.hf.weights={dirs['gpt2']}", "train.seq_len=16"))), world_size=1)
    assert any("has no tensor model.embed_tokens.weight" in r for r in reasons), reasons


def test_cli_bad_input_is_one_line_and_exit_2(dirs, tmp_path, capsys):
    for args, message in (
        (hf("meta-llama/Meta-Llama-3-8B"), "hub id"),
        (hf(dirs["llama"], f"model.hf.weights={tmp_path}"), "holds no *.safetensors file"),
    ):
        done = run_cli_here("train", *args, *RUN, f"hydra.run.dir={tmp_path / 'run'}", capsys=capsys)
        assert done.returncode == 2, done.stderr[-2000:]
        errors = [line for line in done.stderr.splitlines() if line.startswith("optbench: error")]
        assert len(errors) == 1 and message in errors[0] and "Traceback" not in done.stderr
    assert read_summary(tmp_path / "run")["status"] == "incompatible"


def test_a_compiled_hf_step_is_traced_through_aot_autograd():
    """transformers' blocks take tensors as keyword arguments (``position_embeddings=(cos, sin)``):
    the compiled-memory trace hands them to AOTAutograd as inputs of the block's graph (closed over,
    they were constants of another fake mode: "Mixing fake modes", and every compile= run of an HF
    model failed). What the compiled step saves is no more than the eager step's."""
    shape = ["model=hf_llama_tiny", "model.hf.config_overrides.num_hidden_layers=2", "train.seq_len=16",
             "model.hf.config_overrides.hidden_size=32", "model.hf.config_overrides.intermediate_size=64"]
    peaks = {}
    for mode in ("none", "default"):
        trace = trace_step(to_config(compose_cfg([*shape, f"compile={mode}"])), world_size=1, micro_batch=2,
                           target="cpu", stacked=False)
        peaks[mode] = trace.steady_peak().components["activations"]
    assert 0 < peaks["default"] <= peaks["none"], peaks


def test_integer_weights_for_floating_parameters_are_refused(dirs, tmp_path):
    """An int32 tensor was cast on copy: the model trained from garbage at ln(vocab) and "completed"."""
    from safetensors.torch import load_file, save_file

    (tmp_path / "ints").mkdir()
    tensors = load_file(dirs["llama"] / "model.safetensors")
    tensors["model.layers.0.mlp.up_proj.weight"] = (tensors["model.layers.0.mlp.up_proj.weight"] * 100).to(torch.int32)
    save_file(tensors, tmp_path / "ints" / "model.safetensors", metadata={"format": "pt"})
    result = train(compose_cfg(hf(dirs["llama"], f"model.hf.weights={tmp_path / 'ints'}", *RUN)), run_dir=tmp_path / "run")
    assert result.status == "failed" and result.exit_code == 2 and not result.summary["steps"], result.error
    assert result.error.startswith(f"{tmp_path / 'ints' / 'model.safetensors'}: model.layers.0.mlp.up_proj.weight is "
                                   "I32, not a floating-point type"), result.error


@pytest.mark.parametrize("value", ['"32"', "NaN"])
def test_a_config_field_of_the_wrong_type_is_one_line(dirs, tmp_path, value):
    """transformers' validation message spans lines; optbench's line says the field and the fix."""
    text = (dirs["gpt2"] / "config.json").read_text()
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "config.json").write_text(text.replace('"n_embd": 32', f'"n_embd": {value}'))
    with pytest.raises(ConfigError) as err:
        to_config(compose_cfg(hf(tmp_path / "bad")))
    assert "\n" not in str(err.value) and "transformers refuses this GPT2Config" in str(err.value)
    assert "Field 'n_embd' expected int" in str(err.value) and "fix the file" in str(err.value)
