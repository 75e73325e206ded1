"""A tiny run writes every output with every contract field; determinism; fp16; divergence."""

from __future__ import annotations

import json

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from optbench.outputs import read_metrics
from optbench.run.train import train
from optbench.summary import SCHEMA_VERSION, RunSummary, read_run_summary
from tests.helpers import FAST, compose_cfg, read_summary, run_cli_here


def _paths(tree: dict, prefix: str = "") -> set[str]:
    """The dotted key paths of a summary's sections and fields (``applied``, ``config``: free-form, not followed)."""
    out = set()
    for key, value in tree.items():
        out.add(prefix + key)
        if isinstance(value, dict) and key not in ("applied", "config", "versions", "predicted"):
            out |= _paths(value, f"{prefix}{key}.")
    return out


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("tiny_run")
    # the measured CPU ceiling MFU is computed against (a contract field's source)
    result = run_cli_here("train", *FAST, "train.eval_every=3", "measure.peak_tflops=null", f"hydra.run.dir={run_dir}")
    assert result.returncode == 0, result.stderr
    return run_dir, result


def test_cli_run_writes_every_output(tiny_run):
    run_dir, result = tiny_run
    for name in (".hydra/config.yaml", ".hydra/overrides.yaml", "train.log", "metrics.jsonl", "summary.json"):
        assert (run_dir / name).is_file(), name
    assert "step 5 (6/6 done)" in (run_dir / "train.log").read_text()
    assert "tokens/s" in result.stdout  # the summary printed at the end


def test_summary_has_every_contract_field(tiny_run):
    run_dir, _ = tiny_run
    written = json.loads((run_dir / "summary.json").read_text())
    missing = _paths(RunSummary().to_dict()) - _paths(written)
    assert not missing, f"summary.json lacks {sorted(missing)}"  # every field a fresh record has
    assert written["schema_version"] == SCHEMA_VERSION and list(written)[0] == "schema_version"
    summary = read_run_summary(run_dir)
    assert summary.to_dict() == written  # read back whole
    assert summary.status == "completed" and summary.error is None
    assert summary.steps == 6 and summary.world_size == 1
    assert summary.overrides[0] == "model=tiny"
    assert len(summary.config_hash) == 12
    assert summary.model.params == 1_049_728  # exact, as built
    assert summary.throughput.timed_steps == 4  # 6 steps minus 2 warm-up
    assert len(summary.throughput.step_times_s) == 4
    tp, memory = summary.throughput, summary.memory
    assert tp.step_time_s.p10 <= tp.step_time_s.median <= tp.step_time_s.p90
    assert tp.tokens_per_s == pytest.approx(4 * 32 / tp.step_time_s.median)
    assert 0 < tp.mfu < 1
    assert tp.peak_source.startswith("measured CPU matmul ceiling")
    assert memory.peak_bytes > 0 and "MemTracker" in memory.peak_source
    assert memory.peak_rss_bytes > memory.peak_bytes
    assert summary.applied["precision"]["name"] == "fp32"
    assert summary.loss.eval is not None
    json.dumps(written, allow_nan=False)  # strict JSON


def test_metrics_jsonl_and_tensorboard(tiny_run):
    run_dir, _ = tiny_run
    records = read_metrics(run_dir)
    train_steps = [r["step"] for r in records if r["kind"] == "train"]
    assert train_steps == list(range(6))
    assert [r["step"] for r in records if r["kind"] == "eval"] == [2, 5]
    assert all(r["timed"] == (r["step"] >= 2) for r in records if r["kind"] == "train")
    acc = EventAccumulator(str(run_dir / "tensorboard"))
    acc.Reload()
    tags = acc.Tags()["scalars"]
    for tag in ("loss/train", "lr", "grad_norm", "throughput/tokens_per_s", "throughput/mfu", "loss/eval",
                "memory/peak_rss_bytes", "memory/tracked_peak_bytes"):  # memory on a CPU too
        assert tag in tags, tag
    assert [e.step for e in acc.Scalars("loss/train")] == list(range(6))
    hparams = list((run_dir / "tensorboard").glob("events.out.tfevents.*"))
    assert len(hparams) >= 2  # scalars + the hparams plugin's summary


def test_same_seed_gives_bit_identical_losses(tmp_path, fast_run):
    runs = [fast_run, train(compose_cfg(FAST), run_dir=tmp_path / "again")]  # two runs of the same config
    losses = [[r["loss"] for r in read_metrics(run.run_dir) if r["kind"] == "train"] for run in runs]
    assert losses[0] == losses[1]
    other = train(compose_cfg([*FAST, "train.seed=1"]), run_dir=tmp_path / "seed1")
    assert [r["loss"] for r in read_metrics(other.run_dir) if r["kind"] == "train"] != losses[0]


def test_loss_falls_on_synthetic_data(tmp_path):
    result = train(compose_cfg([*FAST, "train.steps=25", "model.vocab_size=64"]), run_dir=tmp_path)
    assert result.status == "completed"
    assert result.summary["loss"]["final"] < result.summary["loss"]["first"] - 0.5


def test_fp16_uses_the_grad_scaler(tmp_path, fast_run):
    result = train(compose_cfg([*FAST, "precision=fp16", "measure.peak_tflops=null"]), run_dir=tmp_path)
    assert result.status == "completed", result.error
    assert result.summary["applied"]["precision"] == {
        "name": "fp16", "autocast": "float16", "tf32": False, "grad_scaler": True,
    }
    assert result.summary["throughput"]["peak_source"].startswith("measured CPU matmul ceiling, float16")
    fp32 = fast_run  # the same config in fp32 (precision's default)
    assert result.summary["loss"]["first"] != fp32.summary["loss"]["first"]  # numerics really changed
    assert result.summary["loss"]["first"] == pytest.approx(fp32.summary["loss"]["first"], rel=1e-2)


def test_diverging_run_stops_before_the_update(tmp_path, capsys):
    result = run_cli_here("train", *FAST, "train.lr=1e6", "train.clip_grad=null", "train.warmup_steps=0",
                          f"hydra.run.dir={tmp_path}", capsys=capsys)
    assert result.returncode == 1
    summary = read_summary(tmp_path)
    assert summary["status"] == "diverged"
    step = int(summary["error"].split("at step ")[1].split(";")[0])
    assert "not applied" in summary["error"]
    assert summary["steps"] == step  # the diverging step was not counted as done
    assert "diverged" in result.stderr.splitlines()[-1]


def test_grad_accumulation_matches_one_big_batch(tmp_path):
    """batch 4 x accum 2 sees the same 8 samples as batch 8 x accum 1: same first loss and update."""
    a = train(compose_cfg([*FAST, "train.batch_size=8", "train.grad_accum=1"]), run_dir=tmp_path / "a")
    b = train(compose_cfg([*FAST, "train.batch_size=4", "train.grad_accum=2"]), run_dir=tmp_path / "b")
    la = [r["loss"] for r in read_metrics(a.run_dir) if r["kind"] == "train"]
    lb = [r["loss"] for r in read_metrics(b.run_dir) if r["kind"] == "train"]
    assert la == pytest.approx(lb, rel=1e-5)


def test_tokens_file_round_trip(tmp_path, capsys):
    text = tmp_path / "corpus.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 400)
    out = tmp_path / "corpus.bin"
    tok = run_cli_here("data", "tokenize", str(text), str(out), capsys=capsys)
    assert tok.returncode == 0, tok.stderr
    meta = json.loads((tmp_path / "corpus.bin.json").read_text())
    assert meta["num_tokens"] == len(text.read_bytes()) and meta["vocab_size"] == 256
    import numpy as np

    assert bytes(np.fromfile(out, dtype=np.uint16).astype(np.uint8)) == text.read_bytes()
    result = train(compose_cfg([*FAST, "data=tokens", f"data.path={out}", "model.vocab_size=256"]),
                   run_dir=tmp_path / "run")
    assert result.status == "completed", result.error
    assert result.summary["loss"]["final"] < result.summary["loss"]["first"]


def test_tokens_file_errors(tmp_path, capsys):
    missing = run_cli_here("train", *FAST, "data=tokens", f"data.path={tmp_path}/nope.bin", f"hydra.run.dir={tmp_path}/r",
                           capsys=capsys)
    assert missing.returncode == 2 and "optbench data tokenize" in missing.stderr
    text = tmp_path / "t.txt"
    text.write_text("abc" * 100)
    run_cli_here("data", "tokenize", str(text), str(tmp_path / "t.bin"), capsys=capsys)
    too_big = train(compose_cfg([*FAST, "data=tokens", f"data.path={tmp_path}/t.bin", "model.vocab_size=100"]),
                    run_dir=tmp_path / "r2")
    assert too_big.status == "failed" and too_big.user_error and "model.vocab_size=256" in too_big.error
    bad_tok = run_cli_here("data", "tokenize", str(tmp_path / "absent.txt"), str(tmp_path / "x.bin"), capsys=capsys)
    assert bad_tok.returncode == 2 and "absent.txt" in bad_tok.stderr and "Traceback" not in bad_tok.stderr


def test_aux_loss_only_on_the_steps_loss_freq_names(tmp_path):
    result = train(compose_cfg([*FAST, "train.steps=9", "loss_freq.every=4"]), run_dir=tmp_path)
    assert result.status == "completed", result.error
    records = [r for r in read_metrics(tmp_path) if r["kind"] == "train"]
    assert [r["step"] for r in records if r["aux_computed"]] == [0, 4, 8]
    assert all(r["aux"]["z_loss"] > 0 for r in records if r["aux_computed"])


def test_math_attention_trains_like_sdpa(tmp_path, fast_run):
    sdpa = fast_run  # attention's default is sdpa
    assert sdpa.summary["applied"]["attention"] == "sdpa"
    math = train(compose_cfg([*FAST, "attention=math"]), run_dir=tmp_path / "math")
    assert math.summary["applied"]["attention"] == "math"
    ls = [r["loss"] for r in read_metrics(sdpa.run_dir) if r["kind"] == "train"]
    lm = [r["loss"] for r in read_metrics(math.run_dir) if r["kind"] == "train"]
    assert lm != ls  # the kernels round differently (~1e-7): an ignored attention=math would repeat SDPA's losses
    assert lm == pytest.approx(ls, rel=1e-4)


def test_a_cpu_ceiling_cached_under_load_is_raised_and_never_lowered(tmp_path, monkeypatch):
    """The MFU denominator on a CPU is the fastest matmul this CPU was seen to do: a cached ceiling
    that is too low (measured while the machine was busy) is replaced by the next run's re-check,
    and a re-check slower than the cache (load now) never lowers it."""
    from optbench.measure import cpu_peak

    monkeypatch.setenv("OPTBENCH_CACHE_DIR", str(tmp_path))
    measured = cpu_peak("float32").flops
    cache = tmp_path / "cpu_peak.json"
    (key,) = json.loads(cache.read_text())

    def cache_flops(value: float | None = None) -> float:
        table = json.loads(cache.read_text())
        if value is not None:
            table[key]["flops"] = value
            cache.write_text(json.dumps(table))
        return table[key]["flops"]

    cache_flops(1.0)  # a ceiling no CPU is this slow at
    raised = cpu_peak("float32")
    assert raised.flops > 0.1 * measured and cache_flops() == raised.flops
    cache_flops(1e18)  # faster than any CPU: a re-check cannot beat it, so it stands
    assert cpu_peak("float32").flops == 1e18 and cache_flops() == 1e18


def test_measuring_the_cpu_ceiling_leaves_the_global_rng_alone():
    """The MFU ceiling is measured (or re-checked) inside a run, after seeding: drawing its operands
    from the global RNG shifted the run's data and augmentation, so two runs of one seed in one
    process differed (the climate task's AC test caught it when run alone)."""
    import torch

    from optbench.measure import ceiling_size, measure_cpu_matmul_peak, recheck_cpu_matmul_peak

    torch.manual_seed(0)
    before = torch.get_rng_state()
    recheck_cpu_matmul_peak(torch.float32, 64)
    measure_cpu_matmul_peak(torch.float32, 64, repeats=1)
    ceiling_size(torch.float32, max_size=256)
    assert torch.equal(torch.get_rng_state(), before)
