"""task=climate_text: captions from the fields, paired data, fusion layers, a frozen base."""

from __future__ import annotations

import copy
import dataclasses
import json
import re

import numpy as np
import pytest
import torch

from optbench.config import FusionConfig, to_config
from optbench.data.captions import write_captions
from optbench.distributed import Machine
from optbench.errors import ConfigError
from optbench.model.counts import count_parameters
from optbench.model.decoder import flops_per_token
from optbench.model.fusion import base_parameters, freeze_base, measured_flops_per_token
from optbench.model.transformer import Transformer, sdpa_attention
from optbench.optim.optimizers import param_groups
from optbench.outputs import read_metrics
from optbench.run.train import train
from optbench.tasks import build_task
from optbench.training.preflight import blocking_reasons
from tests.helpers import TEST_DEFAULTS, assert_cached_decoding_matches, compose_cfg, once_per_session

STEPS = 120  # 30 days, 6-hourly
SWING = 30.0 * np.sin(2 * np.pi * np.arange(STEPS) / 10.0)  # a global warm/cold swing of 10 steps
# a model small enough that a few hundred steps take seconds on one core
SMALL = ["model.dim=64", "model.heads=4", "model.layers=2", "model.ffn_dim=256", "model.vocab_size=256"]


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    """A NetCDF file whose temperature swings warm and cold every 10 steps, its full captions, and
    short texts of the test's own (no sidecar: a user's texts) saying only the anomaly's sign of
    each step ("Above normal." ...): the texts for training. Once per session (read only)."""
    def make(root):
        from optbench.data.netcdf.synth import synthetic_dataset

        ds = synthetic_dataset(days=30, step_hours=6, nlat=8, nlon=16, levels=(1000.0,))
        ds["temperature"] = ds["temperature"] + SWING[:, None, None, None].astype("float32")
        ds[["temperature", "u_wind", "v_wind", "pressure"]].to_netcdf(root / "data.nc", engine="h5netcdf")
        write_captions([str(root / "data.nc")], root / "captions.jsonl", variables=["temperature", "pressure", "u_wind",
                                                                                 "v_wind"])
        rows = [json.loads(line) for line in (root / "captions.jsonl").read_text().splitlines()]
        short = [re.search(r"(above|below|near) normal", row["text"]).group(1).capitalize() + " normal." for row in rows]
        with (root / "first.jsonl").open("w") as f:
            for row, text in zip(rows, short, strict=True):
                f.write(json.dumps({"time": row["time"], "text": text}) + "\n")
        (root / "first.txt").write_text("".join(text + "\n" for text in short))

    return once_per_session(tmp_path_factory, "fusion_pairs", make)[0]


RUN = ["train.device=cpu", "log.progress=log", "measure.track_memory=false", "measure.warmup_steps=1",
       "estimate.predict=false", *TEST_DEFAULTS]  # the step's prediction is tested in tests/estimate


@pytest.fixture(scope="module")
def base_checkpoint(pairs, tmp_path_factory):
    """A task=lm run on the texts, one per line, checkpointed after its 4 steps: a base decoder; once
    per session."""
    def make(run):
        from optbench.data.pack import tokenize_bytes

        tokenize_bytes(pairs / "first.txt", run / "first.bin")
        result = train(compose_cfg(["task=lm", "data=tokens", f"data.path={run / 'first.bin'}", *SMALL, *RUN,
                                    "train.seq_len=24", "train.steps=4", "checkpoint.every=4"]), run_dir=run / "run")
        assert result.status == "completed", result.error

    return once_per_session(tmp_path_factory, "fusion_base_checkpoint", make)[0] / "run" / "checkpoints"


@pytest.fixture(scope="module")
def gated(pairs):
    """The gated task (a fusion kind is a field away: ``with_fusion``)."""
    return build_task(cfg_for(pairs))


def with_fusion(task, **fields):
    """The same task (data already read) with other ``fusion`` fields."""
    other = copy.copy(task)
    other.cfg = dataclasses.replace(task.cfg, fusion=FusionConfig(**{"name": "gated", **fields}))
    return other


def cfg_for(pairs, *overrides, text="first.jsonl", fusion="gated"):
    return to_config(compose_cfg([
        "task=climate_text", "data=netcdf", f"data.paths=[{pairs / 'data.nc'}]", f"data.text={pairs / text}",
        "data.variables=[temperature,pressure,u_wind,v_wind]", "data.augment.enabled=false", f"fusion={fusion}",
        "train.seq_len=24", "train.batch_size=8", "train.device=cpu", *SMALL, *overrides,
    ]))


def build(cfg, task, *, fusion: bool = True) -> Transformer:
    with torch.device("meta"):
        model = Transformer(cfg.model, embed=task.build_embed(), head=task.build_head(), causal=True,
                            max_seq_len=task.tokens_per_sample(), attention=sdpa_attention,
                            fusion=task.build_fusion(attention=sdpa_attention) if fusion else None)
    return model


def materialized(model: Transformer, seed: int = 0) -> Transformer:
    model.to_empty(device="cpu")
    torch.manual_seed(seed)
    model.init_weights()
    return model


def eval_batch(task):
    _, evaluation = task.build_datasets()
    return torch.utils.data.default_collate(evaluation.__getitems__(list(range(8))))


# ------------------------------------------------------------------------------------- captions
def test_captions_describe_each_step_from_its_fields(pairs):
    rows = [json.loads(line) for line in (pairs / "captions.jsonl").read_text().splitlines()]
    assert len(rows) == STEPS and rows[0]["time"] == "2000-01-01T00:00:00"
    above = [i for i, r in enumerate(rows) if " above normal" in r["text"]]
    below = [i for i, r in enumerate(rows) if " below normal" in r["text"]]
    # the swing is the anomaly against the training steps' climatology (by hour of day)
    assert above and below and all(SWING[i] > -5 for i in above) and all(SWING[i] < 5 for i in below)
    assert set(np.flatnonzero(SWING > 5)) <= set(above) and set(np.flatnonzero(SWING < -5)) <= set(below)
    text = rows[25]["text"]  # describe: the trend over the 2-step history window, t-1 -> t
    for phrase in ("Global mean", " in 6 h", "North of 30N", "tropics", "northwest", " at ", "Pressure", "hPa",
                   "wind", "m/s from the"):
        assert phrase in text
    assert ("warming" in text) == (SWING[25] > SWING[24])


def test_captions_command(pairs, tmp_path, capsys):
    from optbench.cli import main

    main(["data", "captions", str(pairs / "data.nc"), str(tmp_path / "c.jsonl"), "--variables", "temperature",
          "--lines", str(tmp_path / "c.txt")])
    assert "wrote 120 captions of temperature" in capsys.readouterr().out
    rows = [json.loads(line)["text"] for line in (tmp_path / "c.jsonl").read_text().splitlines()]
    assert len(rows) == STEPS and (tmp_path / "c.txt").read_text().splitlines() == rows[:108]  # the train split's
    with pytest.raises(SystemExit) as exit_info:
        main(["data", "captions", str(pairs / "data.nc")])
    assert exit_info.value.code == 2


# ------------------------------------------------------------------------------------ paired data
def test_samples_pair_the_climate_window_with_the_text_of_its_last_input_step(pairs, gated):
    task, cfg = gated, gated.cfg
    train, evaluation = task.build_datasets()
    rows = [json.loads(line)["text"] for line in (pairs / "first.jsonl").read_text().splitlines()]
    assert task.text_offset == cfg.data.history - 1  # no sidecar: describe, the last step the model sees
    item = evaluation[3]
    step = int(item["sample"]) + task.text_offset
    tokens = item["tokens"][: int(item["length"])].tolist()
    assert bytes(tokens) == b"\n" + rows[step].encode() + b"\n"  # BOS text END, then padding
    batch = next(iter(train.shard(rank=0, world_size=1, seed=0, start=0, batch_size=8)))
    assert batch["tokens"].shape == (8, 25) and batch["frames"].shape[:2] == (8, 3)
    for tokens, length, sample in zip(batch["tokens"], batch["length"], batch["sample"], strict=True):
        assert bytes(tokens[1 : int(length) - 1].tolist()).decode() == rows[int(sample) + task.text_offset]
    with pytest.raises(ConfigError, match="written with --mode describe .* but task.text_mode=forecast"):
        build_task(cfg_for(pairs, "task.text_mode=forecast", text="captions.jsonl"))
    with pytest.raises(ConfigError, match="written for data.history=2 data.eval_fraction=0.1 .* data.history=3"):
        build_task(cfg_for(pairs, "data.history=3", text="captions.jsonl"))


def test_forecast_captions_pair_each_text_with_the_sample_whose_target_it_describes(pairs, tmp_path):
    write_captions([str(pairs / "data.nc")], tmp_path / "f.jsonl", variables=["temperature"], mode="forecast")
    task = build_task(cfg_for(pairs, text=str(tmp_path / "f.jsonl")))  # the sidecar says forecast
    assert task.text_mode == "forecast" and task.text_offset == task.cfg.data.history
    rows = [json.loads(line)["text"] for line in (tmp_path / "f.jsonl").read_text().splitlines()]
    item = task.build_datasets()[1][0]
    assert bytes(item["tokens"][1:9].tolist()).decode() == rows[int(item["sample"]) + 2][:8]


def test_eval_samples_are_spread_over_the_split_and_shuffled_by_a_derangement(pairs, gated):
    _, evaluation = gated.build_datasets()
    samples = [int(evaluation[i]["sample"]) for i in range(len(evaluation))]
    split = gated.data.eval.split
    assert samples == list(range(split.first, split.first + split.num_samples))  # fewer than 128: all, in order
    assert not np.any(evaluation.partners == np.arange(len(evaluation)))  # never its own climate
    item = evaluation[2]
    partner = evaluation[int(evaluation.partners[2])]
    assert torch.equal(item["frames_shuffled"], partner["frames"]) and int(item["eval_index"]) == 2
    few = build_task(cfg_for(pairs, "task.eval_samples=4"))
    assert [int(s["sample"]) for s in few.build_datasets()[1].__getitems__([0, 1, 2, 3])] == \
        [split.first + round(k * (split.num_samples - 1) / 3) for k in range(4)]
    with pytest.raises(ConfigError, match="pairs every one of the 4 eval samples with its own climate"):
        build_task(cfg_for(pairs, "task.eval_samples=4", "task.shuffle_offset=8")).build_datasets()


def test_the_text_only_control_reads_an_all_zero_climate(pairs, gated):
    task = build_task(cfg_for(pairs, "task.text_only=true", fusion="cross_attention"))
    model = materialized(build(task.cfg, task))
    batch = eval_batch(task)
    other = {**batch, "frames": torch.randn_like(batch["frames"])}
    with torch.no_grad():
        outputs = task.forward(model, batch)
        assert torch.equal(outputs, task.forward(model, other))  # no information from the climate
        assert not torch.equal(outputs, model(task.inputs(batch)))  # but the same fused layers as the true run
        m = task.finalize_eval_metrics(task.eval_metrics(outputs, batch, model=model))
    assert "fusion/loss_shuffled" not in m and m["fusion/eval_samples"] == 8


def _write(path, lines):
    path.write_text("".join(line + "\n" for line in lines))
    return path


@pytest.mark.parametrize("case, expected", [
    ("absent", "time 1999-12-31T18:00:00 is not a time step of the NetCDF data"),
    ("empty", "holds no text"),
    ("garbled", ":2 is not a JSON object"),
    ("missing", "has no text for time 2000-01-01T18:00:00"),
    ("nofile", "does not exist"),
    ("blank", ":2: the text of time 2000-01-01T06:00:00 is empty"),
    ("binary", "cannot be read .*'utf-8' codec can't decode"),
    ("duplicate", ":3: time 2000-01-01T06:00:00 has a text already"),
])
def test_bad_text_files_are_refused_naming_the_problem(pairs, gated, tmp_path, case, expected):
    rows = (pairs / "first.jsonl").read_text().splitlines()
    if case == "absent":
        path = _write(tmp_path / "t.jsonl", [*rows, json.dumps({"time": "1999-12-31T18:00:00", "text": "x"}),
                                            json.dumps({"time": "1999-01-01T00:00:00", "text": "y"})])
    elif case == "empty":
        path = _write(tmp_path / "t.jsonl", [])
    elif case == "garbled":
        path = _write(tmp_path / "t.jsonl", [rows[0], "{not json"])
    elif case == "missing":
        path = _write(tmp_path / "t.jsonl", rows[:3] + rows[4:])
    elif case == "blank":
        path = _write(tmp_path / "t.jsonl", [rows[0], json.dumps({"time": "2000-01-01T06:00:00", "text": "  "})])
    elif case == "binary":
        path = tmp_path / "t.jsonl"
        path.write_bytes(rows[0].encode() + b"\n" + json.dumps({"time": "2000-01-01T06:00:00"}).encode()[:-1]
                         + b', "text": "caf\xe9"}\n')  # Latin-1, not UTF-8
    elif case == "duplicate":
        path = _write(tmp_path / "t.jsonl", [rows[0], rows[1], rows[1].replace("normal", "average")])
    else:
        path = tmp_path / "none.jsonl"
    with pytest.raises(ConfigError, match=expected):
        build_task(dataclasses.replace(gated.cfg, data=dataclasses.replace(gated.cfg.data, text=str(path))))


def test_fusion_options_are_checked_against_the_task(gated):
    machine = Machine(device=torch.device("cpu"), cuda_available=False, cuda_devices=0, cpu_threads=1)
    lm = to_config(compose_cfg([]))

    def reasons(cfg, **fusion):
        return " ".join(blocking_reasons(dataclasses.replace(cfg, fusion=FusionConfig(**fusion)), machine))

    assert "only task=climate_text provides" in reasons(lm, name="gated")
    assert "only task=climate_text provides" in reasons(lm, base_checkpoint="/x")
    assert "nothing is left to train" in reasons(lm, freeze_base=True)
    assert "would never read the climate" in reasons(gated.cfg)
    assert reasons(lm) == "" and reasons(gated.cfg, name="gated") == ""


# ----------------------------------------------------------------------------------------- model
def test_fusion_leaves_the_decoder_alone_and_gated_starts_as_the_base_model(gated):
    task, cfg = gated, gated.cfg
    base = materialized(build(cfg, task, fusion=False))
    fused = materialized(build(cfg, task))
    assert dict(base_parameters(base)).keys() == dict(base.named_parameters()).keys()
    # same names and, for a seed, the same initial decoder weights as the plain model
    assert all(torch.equal(p, dict(base.named_parameters())[n]) for n, p in base_parameters(fused))
    batch = eval_batch(task)
    with torch.no_grad():
        reference = base(task.inputs(batch))
        assert torch.equal(fused(task.inputs(batch)), reference)  # no context: the decoder alone
        assert torch.equal(task.forward(fused, batch), reference)  # gated, gates closed: exactly the base
        for kind in ("add", "cross_attention"):
            other = with_fusion(task, name=kind)
            model = materialized(build(other.cfg, other))
            assert torch.equal(model(task.inputs(batch)), reference)
            assert not torch.allclose(other.forward(model, batch), reference)


def test_gated_layers_sit_before_every_nth_decoder_layer(gated):
    task = with_fusion(gated, every=2, encoder_layers=2)
    task.cfg = dataclasses.replace(task.cfg, model=dataclasses.replace(task.cfg.model, layers=4))
    fusion = build(task.cfg, task).fusion
    assert list(fusion.layers) == ["0", "2"] and list(fusion.encoder) == ["0", "1"]
    assert fusion.num_tokens == task.context_tokens() == 2 * 4  # 8x16 grid in 4x4 patches


def test_freeze_base_trains_only_the_fusion_and_counts_what_autograd_computes(gated):
    task = with_fusion(gated, name="cross_attention")
    cfg = task.cfg

    def flops(model):
        return measured_flops_per_token(model, forward=lambda m: task.forward(m, task.meta_batch(1)),
                                        tokens_per_sample=task.tokens_per_sample())

    model = build(cfg, task)
    full = flops(model)
    frozen_numel = freeze_base(model)
    counts = count_parameters(model)
    base_numel = sum(p.numel() for _, p in base_parameters(model))
    assert frozen_numel == counts["frozen"] == base_numel and counts["trainable"] == counts["total"] - base_numel
    frozen = flops(model)
    # a frozen decoder's matmuls need no weight gradient (and those below the first fusion layer,
    # none here, no input gradient either): a frozen step computes less, its forward the same
    assert frozen["forward"] == full["forward"] and frozen["training"] < full["training"]
    decoder_weight_grads = 2 * sum(m.weight.numel() for n, m in model.named_modules()
                                   if isinstance(m, torch.nn.Linear) and n.split(".")[0] in ("layers", "head"))
    assert full["training"] - frozen["training"] == pytest.approx(decoder_weight_grads, rel=1e-12)
    groups = param_groups(model, weight_decay=0.1)
    assert sum(p.numel() for g in groups for p in g["params"]) == counts["trainable"]
    model = materialized(model)
    task.losses(task.forward(model, eval_batch(task)), eval_batch(task), with_aux=False).main.backward()
    assert all(p.grad is None for _, p in base_parameters(model))
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
    plain = build(cfg, task, fusion=False)  # the counter agrees with 6 N + 12 L d T on a plain decoder
    assert measured_flops_per_token(plain, forward=lambda m: m(task.inputs(task.meta_batch(1))),
                                    tokens_per_sample=24)["training"] == flops_per_token(plain, seq_len=24)


def test_fusion_blocks_go_through_activation_checkpointing_and_compile(gated):
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    from optbench.training.kinds import model_spec
    from optbench.training.parallelize import parallelize

    machine = Machine(device=torch.device("cpu"), cuda_available=False, cuda_devices=0, cpu_threads=1)
    task = with_fusion(gated, name="cross_attention")
    batch = eval_batch(task)
    losses = []
    for overrides in ({}, {"ac": dataclasses.replace(task.cfg.ac, name="full")}):
        model = build(task.cfg, task)
        applied = parallelize(model, cfg=dataclasses.replace(task.cfg, **overrides), machine=machine)
        wrapped = [isinstance(b, CheckpointWrapper) for g in model_spec(task.cfg).block_groups(model).values() for b in g.values()]
        assert all(wrapped) if overrides else not any(wrapped)
        assert applied["activation_checkpointing"].get("fusion_blocks", 0) == (2 if overrides else 0)
        model = materialized(model)
        loss = task.losses(task.forward(model, batch), batch, with_aux=False).main
        loss.backward()
        losses.append((loss.detach(), model.fusion.layers["0"].attn.wq.weight.grad.clone()))
    assert torch.equal(losses[0][0], losses[1][0]) and torch.equal(losses[0][1], losses[1][1])
    model = build(task.cfg, task)
    applied = parallelize(model, cfg=dataclasses.replace(
        task.cfg, compile=dataclasses.replace(task.cfg.compile, name="default")), machine=machine)
    assert applied["compile"]["fusion_blocks"] == 2  # the encoder block and the cross-attention layer
    assert all(b._compiled_call_impl is not None for g in model_spec(task.cfg).block_groups(model).values() for b in g.values())


def test_ddp_all_reduces_only_the_trainable_gradients(gated, tmp_path):
    import torch.distributed as dist

    from optbench.training.data_parallel import apply_ddp

    task = with_fusion(gated, name="gated", freeze_base=True)
    model = build(task.cfg, task)
    freeze_base(model)
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        apply_ddp(model, world_size=1, device=torch.device("cpu"), compiled=False)
        model = materialized(model)
        batch = eval_batch(task)
        reduced = []

        def count(state, bucket):  # a comm hook: what DDP hands to all-reduce, bucket by bucket
            reduced.append(bucket.buffer().numel())
            return dist.all_reduce(bucket.buffer(), async_op=True).get_future().then(lambda f: f.value()[0])

        model.register_comm_hook(None, count)  # replicate's DDP is built at the first forward, with it
        task.losses(task.forward(model, batch), batch, with_aux=False).main.backward()
        assert sum(reduced) == count_parameters(model)["trainable"] < count_parameters(model)["total"] // 2
    finally:
        dist.destroy_process_group()


# --------------------------------------------------------------------------------- in training
def test_fusion_learns_to_use_the_climate(pairs, tmp_path, capsys):
    """A few dozen steps: the text loss with each sample's own climate falls clearly below the loss
    with the climate of another time (the gap many standard errors above 0)."""
    result = train(cfg_for(pairs, "fusion.encoder_layers=0", "train.batch_size=16", "train.lr=1e-2",
                           "train.warmup_steps=10", "train.steps=50", "train.eval_batches=2", *RUN, fusion="add"),
                   run_dir=tmp_path / "run")
    assert result.status == "completed", result.error
    m = result.summary["loss"]["eval_metrics"]
    assert m["fusion/loss_gap"] == pytest.approx(m["fusion/loss_shuffled"] - m["fusion/loss_true"])
    assert m["fusion/loss_gap"] > 0.1 and m["fusion/loss_gap_low"] > 0, m  # the 95% interval excludes 0
    assert m["fusion/loss_gap_low"] < m["fusion/loss_gap"] < m["fusion/loss_gap_high"] and m["fusion/eval_samples"] == 10
    assert m["fusion/loss_true"] == pytest.approx(result.summary["loss"]["eval"], rel=1e-6)
    from optbench.report.command import main as report

    with pytest.raises(SystemExit):  # the report shows the three losses and the gap
        report([str(tmp_path / "run"), "--format", "markdown", "--no-plots"])
    out = capsys.readouterr().out
    assert "Climate-text fusion" in out and f"{m['fusion/loss_gap']:+.4f} ± {m['fusion/loss_gap_stderr']:.4f}" in out


def test_a_gated_model_over_a_base_checkpoint_starts_as_the_base_and_resumes_exactly(pairs, gated, base_checkpoint,
                                                                                    tmp_path):
    from optbench.checkpoint.base import check_base_checkpoint, load_base

    task = with_fusion(gated, freeze_base=True, base_checkpoint=str(base_checkpoint))
    fused, base = materialized(build(task.cfg, task)), materialized(build(task.cfg, task, fusion=False), seed=1)
    assert load_base(fused, base_checkpoint)["tensors"] == len(base_parameters(base))
    load_base(base, base_checkpoint)
    batch = eval_batch(task)
    with torch.no_grad():
        outputs = task.forward(fused, batch)
        assert torch.equal(outputs, base(task.inputs(batch)))
        m = task.finalize_eval_metrics(task.eval_metrics(outputs, batch, model=fused))
    assert m["fusion/loss_true"] == m["fusion/loss_base"]  # gates closed: exactly the base model's loss
    wrong = dataclasses.replace(task.cfg.model, dim=32, heads=2)
    with pytest.raises(ConfigError, match="shape dim=64 layers=2 heads=4 ffn_dim=256 vocab_size=256 but this "
                                          "run's model is dim=32 layers=2 heads=2"):
        check_base_checkpoint(base_checkpoint, model=wrong)

    overrides = ["fusion.freeze_base=true", f"fusion.base_checkpoint={base_checkpoint}", "train.steps=4",
                 "checkpoint.every=2", "checkpoint.keep_last=0", "train.eval_every=2",
                 *[o for o in RUN if not o.startswith(("measure.track_memory", "measure.warmup_steps"))],
                 "measure.warmup_steps=2", "estimate.in_run=true"]  # MemTracker follows step 1, a steady step
    full = train(cfg_for(pairs, *overrides), run_dir=tmp_path / "full")
    assert full.status == "completed", full.error
    memory = full.summary["memory"]  # the estimate's trace of a frozen base is MemTracker's peak, exactly
    assert memory["peak_bytes"] == memory["estimate_bytes"] and "MemTracker" in memory["peak_source"]
    applied = full.summary["applied"]["fusion"]
    assert applied["base_checkpoint"]["numel"] == full.summary["model"]["frozen_params"]
    assert full.summary["model"]["trainable_params"] + full.summary["model"]["frozen_params"] == \
        full.summary["model"]["params"]
    resumed = train(cfg_for(pairs, *overrides, f"checkpoint.resume={tmp_path / 'full/checkpoints/step-00000002'}"),
                    run_dir=tmp_path / "resumed")
    assert resumed.status == "completed", resumed.error

    def losses(run):
        return {r["step"]: r["loss"] for r in read_metrics(run) if r["kind"] == "train"}

    assert losses(tmp_path / "resumed") == {k: v for k, v in losses(tmp_path / "full").items() if k >= 2}
    assert resumed.summary["loss"]["eval_metrics"] == full.summary["loss"]["eval_metrics"]


def test_bad_fusion_input_is_one_line_and_exit_2(pairs, base_checkpoint, tmp_path):
    cases = {
        "lm": (compose_cfg(["fusion=cross_attention", *RUN]), "only task=climate_text provides"),
        "shape": (cfg_for(pairs, f"fusion.base_checkpoint={base_checkpoint}", "model.dim=32", "model.heads=2", *RUN),
                  "but this run's model is dim=32"),
        "nothing": (compose_cfg(["fusion.freeze_base=true", *RUN]), "nothing is left to train"),
    }
    for name, (cfg, expected) in cases.items():
        result = train(cfg, run_dir=tmp_path / name)
        assert result.exit_code == 2 and expected in result.error and "\n" not in result.error, (name, result.error)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_fsdp2_over_two_workers_trains_the_fusion_and_leaves_the_frozen_base_as_loaded(pairs, gated, base_checkpoint,
                                                                                     tmp_path):
    import torch.distributed.checkpoint as dcp

    from optbench.checkpoint.base import load_base

    result = train(cfg_for(pairs, "fusion.freeze_base=true", f"fusion.base_checkpoint={base_checkpoint}",
                           "parallel=fsdp2", "parallel.nproc_per_node=2", "train.batch_size=4", "train.steps=3",
                           "checkpoint.every=3", *RUN), run_dir=tmp_path / "run")
    assert result.status == "completed", result.error
    assert result.summary["applied"]["parallel"]["mode"] == "fsdp2" and result.summary["world_size"] == 2
    assert "fusion/loss_gap" in result.summary["loss"]["eval_metrics"]
    task = with_fusion(gated)
    trained, base = materialized(build(task.cfg, task)), materialized(build(task.cfg, task), seed=1)
    load_base(trained, tmp_path / "run/checkpoints")
    load_base(base, base_checkpoint)
    assert all(torch.equal(p, dict(base_parameters(base))[n]) for n, p in base_parameters(trained))
    gate = {"app": {"model": {"fusion.layers.0.attn_gate.alpha": torch.zeros(1)}}}
    dcp.load(gate, checkpoint_id=str(next((tmp_path / "run/checkpoints").glob("step-*"))), no_dist=True)
    assert gate["app"]["model"]["fusion.layers.0.attn_gate.alpha"].abs().item() > 0  # the fusion trained


# ------------------------------------------------------------------------- prefix, climate encoder
def test_prefix_puts_the_climate_tokens_before_the_text_and_keeps_the_text_causal(gated):
    task = with_fusion(gated, name="prefix")
    model = materialized(build(task.cfg, task))
    base = materialized(build(task.cfg, task, fusion=False))
    assert model.rope_len == task.tokens_per_sample() + task.context_tokens()
    assert sorted({n.split(".")[0] for n, _ in model.fusion.named_parameters()}) == ["embed", "encoder", "norm", "proj"]
    batch = eval_batch(task)
    inputs = task.inputs(batch)
    with torch.no_grad():
        fused = task.forward(model, batch)
        assert fused.shape == base(inputs).shape  # the climate positions' outputs are dropped
        assert torch.equal(model(inputs), base(inputs))  # no climate: the decoder alone
        assert not torch.allclose(fused, base(inputs))
        changed = inputs.clone()
        changed[:, 10:] = (changed[:, 10:] + 1) % 256  # later text cannot change earlier positions
        again = model(changed, context=task.context(batch))
        assert torch.allclose(again[:, :10], fused[:, :10], atol=1e-6) and not torch.allclose(again, fused)
        other = model(inputs, context=task.shuffled_context(batch))
        assert not torch.allclose(other, fused)  # every text position reads the climate


@pytest.fixture(scope="module")
def climate_run(pairs, tmp_path_factory):
    """A task=climate run (the forecaster) on the pairs' file at the fused models' width, checkpointed;
    once per session."""
    def make(run):
        result = train(compose_cfg(["task=climate", "data=netcdf", f"data.paths=[{pairs / 'data.nc'}]",
                                    "data.variables=[temperature,pressure,u_wind,v_wind]", "data.augment.enabled=false",
                                    *SMALL, *RUN, "train.batch_size=4", "train.steps=2", "checkpoint.every=2",
                                    "train.eval_batches=1"]), run_dir=run)
        assert result.status == "completed", result.error

    return once_per_session(tmp_path_factory, "fusion_climate_run", make)[0]


def test_the_encoder_is_the_climate_runs_trunk_frozen_or_trained(pairs, climate_run, tmp_path):
    import torch.distributed.checkpoint as dcp

    from optbench.training.climate_encoder import load_encoder, resolve_encoder_checkpoint

    checkpoint = resolve_encoder_checkpoint(climate_run)
    stored = {k: torch.empty(m.size) for k, m in
              dcp.FileSystemReader(str(checkpoint)).read_metadata().state_dict_metadata.items()
              if k.startswith("app.model.") and hasattr(m, "size")}
    dcp.load(stored, checkpoint_id=str(checkpoint), no_dist=True)
    overrides = [f"fusion.encoder_checkpoint={climate_run}", "fusion.freeze_encoder=true", "fusion.freeze_base=true",
                 "train.steps=2", "checkpoint.every=2", "train.eval_every=0", *RUN]
    result = train(cfg_for(pairs, *overrides, fusion="prefix"), run_dir=tmp_path / "run")
    assert result.status == "completed", result.error
    applied = result.summary["applied"]["fusion"]["encoder_checkpoint"]
    trunk = [k for k in stored if k.startswith(("app.model.embed.", "app.model.layers.0.", "app.model.norm."))]
    assert applied["path"] == str(checkpoint) and applied["tensors"] == len(trunk) and len(trunk) > 8
    saved = resolve_encoder_checkpoint(tmp_path / "run")
    after = {k: torch.empty(m.size) for k, m in
             dcp.FileSystemReader(str(saved)).read_metadata().state_dict_metadata.items()
             if k.startswith("app.model.fusion.") and hasattr(m, "size")}
    dcp.load(after, checkpoint_id=str(saved), no_dist=True)
    for theirs, ours in (("embed.proj.weight", "fusion.embed.proj.weight"), ("embed.pos.weight", "fusion.embed.pos.weight"),
                         ("layers.0.attn.wq.weight", "fusion.encoder.0.attn.wq.weight"), ("norm.weight", "fusion.norm.weight")):
        assert torch.equal(after["app.model." + ours], stored["app.model." + theirs]), ours  # frozen: as loaded
    assert result.summary["model"]["trainable_params"] == sum(
        v.numel() for k, v in after.items() if k.startswith("app.model.fusion.proj."))  # only the projection trains
    task = build_task(cfg_for(pairs, f"fusion.encoder_checkpoint={climate_run}", fusion="cross_attention"))
    model = materialized(build(task.cfg, task))
    load_encoder(model, climate_run)  # trained (not frozen): loaded, every encoder parameter trainable
    assert torch.equal(model.fusion.norm.weight, stored["app.model.norm.weight"])
    assert all(p.requires_grad for p in model.fusion.parameters())


def test_a_bad_encoder_checkpoint_is_one_line_and_exit_2(pairs, climate_run, base_checkpoint, tmp_path):
    from optbench.data.netcdf.synth import write_synthetic

    write_synthetic(tmp_path / "data.nc", days=30, step_hours=6, nlat=12, nlon=16, levels=(1000.0,))
    (tmp_path / "first.jsonl").write_text((pairs / "first.jsonl").read_text())  # the same times, a 12x16 grid
    cases = {
        "grid": (cfg_for(tmp_path, f"fusion.encoder_checkpoint={climate_run}", *RUN),
                 "another grid, other variables or levels"),
        "patch": (cfg_for(pairs, f"fusion.encoder_checkpoint={climate_run}", "task.patch_size=2", *RUN),
                  "patches the climate in 4x4 patches over"),
        "lm": (cfg_for(pairs, f"fusion.encoder_checkpoint={base_checkpoint}", *RUN), "is a task=lm run"),
        "width": (cfg_for(pairs, f"fusion.encoder_checkpoint={climate_run}", "model.dim=32", "model.heads=2", *RUN),
                  "has a trunk of dim=64 (here 32)"),
        "rope": (cfg_for(pairs, f"fusion.encoder_checkpoint={climate_run}", "model.rope_theta=500000", *RUN),
                 "rope_theta=10000.0 (here 500000.0)"),
        "eps": (cfg_for(pairs, f"fusion.encoder_checkpoint={climate_run}", "model.norm_eps=1e-6", *RUN),
                "norm_eps=1e-05 (here 1e-06)"),
        "none": (cfg_for(pairs, f"fusion.encoder_checkpoint={tmp_path}", *RUN), "is not an optbench checkpoint"),
        "task": (compose_cfg([f"fusion.encoder_checkpoint={climate_run}", *RUN]), "only task=climate_text provides"),
    }
    for name, (cfg, expected) in cases.items():
        result = train(cfg, run_dir=tmp_path / f"run-{name}")
        assert result.exit_code == 2 and expected in result.error and "\n" not in result.error, (name, result.error)


@pytest.mark.filterwarnings("ignore:DTensor random operators")
def test_the_estimate_shards_the_fusion_blocks_as_training_does(gated):
    """The run's own estimate builds its fake model through training's parallelize: FSDP2 shards every
    block of every group (the decoder's, the encoder's, the fusion layers'), not the decoder's alone
    (a real 2-rank run of this shape measured exactly the new estimate; sharding only the decoder's
    blocks overestimated it by 10-12%)."""
    from torch.distributed.fsdp import FSDPModule

    from optbench.estimate.fake import fake_mesh
    from optbench.estimate.memtrace import build_fake
    from optbench.training.kinds import model_spec

    cfg = dataclasses.replace(with_fusion(gated, name="cross_attention").cfg,
                              parallel=dataclasses.replace(gated.cfg.parallel, name="fsdp2"))
    with fake_mesh(2) as mesh:
        traced = build_fake(cfg, mesh=mesh, target="cpu")
        groups = model_spec(cfg).block_groups(traced.model)
        assert list(groups) == ["layers", "fusion.encoder", "fusion.layers"]
        assert all(isinstance(block, FSDPModule) for group in groups.values() for block in group.children())


# ------------------------------------------------------------------------------ cached decoding
@pytest.mark.parametrize("kind", ["add", "cross_attention", "gated", "prefix"])
def test_cached_decoding_gives_the_uncached_forwards_logits(gated, kind):
    """optbench generate's key/value cache: the prompt, then one token at a time, gives the logits
    of the whole sequence run at once, with a climate and without (the base alone)."""
    task = with_fusion(gated, name=kind)
    model = materialized(build(task.cfg, task), seed=3).eval()
    for block in model.fusion.layers.values():  # open the gated blocks' gates: the climate counts
        for gate in (getattr(block, "attn_gate", None), getattr(block, "mlp_gate", None)):
            if gate is not None:
                torch.nn.init.constant_(gate.alpha, 0.7)
    batch = eval_batch(task)
    tokens, context = batch["tokens"][:, :12], task.context(batch)
    assert_cached_decoding_matches(model, task.cfg, tokens, context, prompt=5, rtol=1e-5)
    with torch.no_grad():
        assert not torch.allclose(model(tokens, context=context), model(tokens))  # the climate is read


def test_a_bf16_frozen_base_trains_loads_its_checkpoint_and_halves_its_bytes(pairs, base_checkpoint, tmp_path):
    """fusion.base_dtype=bf16: the frozen decoder stored in bf16 (loaded from an fp32 base), the
    fusion in fp32 under bf16 autocast; refused without freeze_base and bf16."""
    cfg = cfg_for(pairs, "fusion.freeze_base=true", f"fusion.base_checkpoint={base_checkpoint}",
                  "fusion.base_dtype=bf16", "precision=bf16", "train.steps=3", *RUN)
    result = train(cfg, run_dir=tmp_path / "run")
    assert result.status == "completed", result.error
    from optbench.training.build import build_model

    model = build_model(cfg, build_task(cfg))
    dtypes = {name.split(".")[0]: p.dtype for name, p in model.named_parameters()}
    assert dtypes["layers"] == torch.bfloat16 and dtypes["fusion"] == torch.float32
    with pytest.raises(ConfigError, match="fusion.freeze_base=true precision=bf16"):
        cfg_for(pairs, "fusion.base_dtype=bf16", "precision=bf16")


def test_the_plan_004_preset_is_its_shape_from_shapes_alone(tmp_path):
    """preset=plan004_llama3_8b_cross_attention: Llama-3-8B frozen + 4 cross-attention blocks, no
    file read (task.climate_shape); training such a task is refused, naming the fix."""
    from optbench.model.counts import count_parameters
    from optbench.training.build import build_model

    cfg = to_config(compose_cfg(["preset=plan004_llama3_8b_cross_attention"]))
    task = build_task(cfg)
    counts = count_parameters(build_model(cfg, task))
    assert (counts["total"], counts["trainable"]) == (8_768_761_856, 738_500_608)  # the plan: 8.79B, 760M
    assert counts["frozen"] == 8_030_261_248 and task.context_tokens() == 32
    with pytest.raises(ConfigError, match="for optbench estimate only"):
        task.build_datasets()
    with pytest.raises(ConfigError, match=r"task.climate_shape=\[2, 1\]"):
        to_config(compose_cfg(["task=climate_text", "task.climate_shape=[2,1]"]))


@pytest.mark.parametrize(("low", "high", "said"), [
    (0.01, 0.05, "reads the climate it is given"), (-0.02, 0.03, "shows no use of its climate"),
    (-0.05, -0.01, "does worse with its own climate than another's")])
def test_the_end_of_run_summary_states_the_gaps_verdict_in_words(low, high, said):
    from optbench.outputs import format_summary
    from optbench.summary import Loss, RunSummary

    metrics = {"fusion/loss_gap": (low + high) / 2, "fusion/loss_gap_low": low, "fusion/loss_gap_high": high}
    text = format_summary(RunSummary(status="completed", loss=Loss(eval_metrics=metrics)), "run", width=80)
    verdict = " ".join(" ".join(line.split()) for line in text.splitlines()[next(
        i for i, line in enumerate(text.splitlines()) if line.lstrip().startswith("verdict")):])
    assert f"verdict the model {said}" in verdict and f"(95% interval {low:+.3g} .. {high:+.3g}" in verdict
    assert max(len(line) for line in text.splitlines()) <= 80
    assert "verdict" not in format_summary(RunSummary(status="completed", loss=Loss(eval_metrics={})), "run")
