"""optbench generate: a trained climate_text checkpoint writes text for a climate (true, shuffled,
none), greedy or sampled; the true texts' teacher-forced loss is the run's own eval loss; the
numbers a text states are scored against the field; bad input is one line and exit 2."""

from __future__ import annotations

import json

import pytest

from optbench.cli import main
from optbench.data.captions import write_captions
from optbench.run.train import train
from tests.helpers import TEST_DEFAULTS, cli_one_line, compose_cfg, train_fused_climate_run

SMALL = ["model.dim=32", "model.heads=2", "model.layers=2", "model.ffn_dim=64", "model.vocab_size=256"]
RUN = ["train.device=cpu", "log.progress=log", "measure.track_memory=false", "measure.warmup_steps=1",
       "estimate.predict=false", *TEST_DEFAULTS]  # the step's prediction is tested in tests/estimate


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A fused model trained 4 steps on the captions of a small synthetic file, checkpointed."""
    return train_fused_climate_run(tmp_path_factory.mktemp("gen"), fusion="cross_attention", steps=4,
                                   more=("data.augment.enabled=false",))


def _records(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_generate_writes_texts_whose_true_loss_is_the_runs_eval_loss(run, tmp_path, capsys):
    out = tmp_path / "g.jsonl"
    main(["generate", str(run / "run"), "--samples", "128", "--climate", "true,shuffled", "--max-tokens", "8",
          "--prompt", "Global", "--out", str(out), "--score"])
    printed = capsys.readouterr().out
    assert "(eval sample 0)" in printed and "number score over 10 samples" in printed and "area mean" in printed
    lines = _records(out)
    samples, score = lines[:-1], lines[-1]
    assert len(samples) == 2 * 10 and score["kind"] == "score"  # all 10 eval samples (fewer than 128), 2 climates
    assert all(r["text"].startswith("Global") and len(r["text"].encode()) <= len("Global") + 8 for r in samples)
    assert all(set(r["field"]) >= {"mean", "anomaly", "trend", "region:tropics"} for r in samples)
    metrics = json.loads((run / "run" / "summary.json").read_text())["loss"]["eval_metrics"]
    for climate, key in (("true", "fusion/loss_true"), ("shuffled", "fusion/loss_shuffled")):
        picked = [r for r in samples if r["climate"] == climate]
        loss = sum(r["nll"] for r in picked) / sum(r["tokens"] for r in picked)
        assert loss == pytest.approx(metrics[key], rel=1e-5)  # the same samples, the same derangement
        assert score["score"][climate]["loss"] == pytest.approx(loss)


def test_decoding_is_greedy_or_seeded_and_a_time_names_its_sample(run, tmp_path):
    def texts(*args):
        main(["generate", str(run / "run" / "checkpoints"), "--out", str(tmp_path / "t.jsonl"), "--quiet", *args])
        return [r["text"] for r in _records(tmp_path / "t.jsonl")]

    greedy = texts("--samples", "2", "--max-tokens", "6")
    assert greedy == texts("--samples", "2", "--max-tokens", "6") and len(greedy) == 2
    sampled = texts("--samples", "2", "--max-tokens", "6", "--temperature", "1.5", "--seed", "3")
    assert sampled == texts("--samples", "2", "--max-tokens", "6", "--temperature", "1.5", "--seed", "3")
    assert sampled != texts("--samples", "2", "--max-tokens", "6", "--temperature", "1.5", "--seed", "4")
    one = _records(tmp_path / "t.jsonl") and texts("--time", "2000-01-20T06:00:00", "--climate", "all",
                                                   "--max-tokens", "4")
    records = _records(tmp_path / "t.jsonl")
    assert len(one) == 3 and {r["climate"] for r in records} == {"true", "shuffled", "base"}
    assert all(r["time"] == "2000-01-20T06:00:00" and r["step"] == 77 for r in records)  # describe: that step


def test_a_training_samples_climate_is_a_seeded_control_of_the_training_split(run, tmp_path):
    """--climate train: each text given the window of a random training sample (seeded by --seed),
    read from the training split; its loss is recomputed from that climate, not the sample's own."""
    from optbench.generate.api import with_train_climates
    from optbench.generate.load import load_run

    def nll(seed):
        main(["generate", str(run / "run"), "--samples", "3", "--climate", "true,train", "--max-tokens", "2",
              "--quiet", "--seed", str(seed), "--out", str(tmp_path / f"t{seed}.jsonl")])
        records = _records(tmp_path / f"t{seed}.jsonl")
        return {c: [r["nll"] for r in records if r["climate"] == c] for c in ("true", "train")}

    zero, again, one = nll(0), nll(0), nll(1)
    assert zero == again and zero["true"] == one["true"] and zero["train"] != one["train"]
    assert zero["train"] != zero["true"] and len(zero["train"]) == 3
    task = load_run(str(run / "run")).task
    items = with_train_climates(task, [{"frames": None}] * 4, seed=0)
    train, evaluation = task.data.train.split, task.data.eval.split
    assert train.first + train.num_samples <= evaluation.first  # from the training steps only
    windows = [task.data.eval.__class__(task.data.train.source, stats=task.data.stats, split=train,
                                        history=task.history, offsets=task.data.eval.offsets)[i]["frames"]
               for i in range(train.num_samples)]
    assert all(any(bool((item["frames_train"] == w).all()) for w in windows) for item in items)


def test_the_number_score_compares_stated_numbers_with_the_field(run):
    from optbench.data.captions import read_spec
    from optbench.generate.score import FieldFacts, number_score, stated

    field = FieldFacts([str(run / "data.nc")], spec=read_spec(run / "c.jsonl"))
    try:
        facts = [field.facts(step) for step in (50, 51)]
    finally:
        field.close()
    captions = [json.loads(line)["text"] for line in (run / "c.jsonl").read_text().splitlines()]
    exact = [{"numbers": stated(f, captions[s])} for f, s in zip(facts, (50, 51), strict=True)]
    scored = number_score(exact, facts)  # the captions themselves: every number stated, no error
    assert all(e["mae"] == 0 and e["stated"] == 1 for e in scored.values())
    assert scored["anomaly"]["sign_accuracy"] == 1
    mean = facts[0]["mean"].value
    wrong = captions[50].replace(f"Global mean {mean:.1f} C", f"Global mean {mean + 2.5:.1f} C")
    off = number_score([{"numbers": stated(facts[0], wrong)}], facts[:1])
    assert off["area mean"]["mae"] == pytest.approx(2.5) and off["regions"]["mae"] == 0
    assert number_score([{"numbers": {}}], facts[:1])["points"] == {"mae": None, "stated": 0.0,
                                                                     "sign_accuracy": None, "n": 2}


@pytest.mark.parametrize("case, expected", [
    ("nocheckpoint", "holds no checkpoint to read the model from"),
    ("missing", "does not exist"),
    ("time", "--time 1999-01-01T00:00:00 is not the time of a sample's text"),
    ("climate", "--climate warm: use true, shuffled, train, base"),
    ("tokens", "--max-tokens 500 after a prompt of 1 tokens exceeds the model's train.seq_len=48"),
])
def test_bad_generate_input_is_one_line_and_exit_2(run, tmp_path, capsys, case, expected):
    (tmp_path / "empty").mkdir()
    args = {"nocheckpoint": [str(tmp_path / "empty")], "missing": [str(tmp_path / "nope")],
            "time": [str(run / "run"), "--time", "1999-01-01T00:00:00"],
            "climate": [str(run / "run"), "--climate", "warm"],
            "tokens": [str(run / "run"), "--max-tokens", "500"]}[case]
    with pytest.raises(SystemExit) as info:
        main(["generate", *args])
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("optbench: error:")]
    assert info.value.code == 2 and len(errors) == 1 and expected in errors[0] and "Traceback" not in err, err


def test_generate_refuses_an_lm_run_and_a_score_without_captions_facts(run, tmp_path, capsys):
    lm = train(compose_cfg(["task=lm", "train.seq_len=16", "train.batch_size=2", "train.steps=2", "checkpoint.every=2",
                            *SMALL, *RUN]), run_dir=tmp_path / "lm")
    assert lm.status == "completed", lm.error
    side = run / "c.jsonl.json"
    side.rename(tmp_path / "side.json")
    try:
        for args, expected in (([str(tmp_path / "lm")], "is a task=lm run; optbench generate writes the text of a "
                                                        "task=climate_text model"),
                               ([str(run / "run"), "--score"], "has no sidecar (.json beside it): the number score")):
            with pytest.raises(SystemExit) as info:
                main(["generate", *args])
            errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("optbench: error:")]
            assert info.value.code == 2 and len(errors) == 1 and expected in errors[0]
    finally:
        (tmp_path / "side.json").rename(side)



# --------------------------------------------------------------------- nothing lost, round four
@pytest.mark.parametrize("case, expected", [
    ("samples0", "--samples 0: give at least 1"),
    ("nan", "--temperature nan: give a finite temperature >= 0"),
    ("inf", "--temperature inf: give a finite temperature >= 0"),
    ("negative", "--temperature -1.0: give a finite temperature >= 0"),
    ("tokens-5", "--max-tokens -5: give at least 1"),
    ("tokens0", "--max-tokens 0: give at least 1"),
    ("outdir", "is a directory: give a file name in it, e.g. --out"),
    ("outmissing", "missing/dir does not exist: create it first (mkdir -p"),
])
def test_bad_generate_options_are_one_line_before_loading(run, tmp_path, capsys, monkeypatch, case, expected):
    from optbench.generate import load

    monkeypatch.setattr(load, "load_run", lambda *_: pytest.fail("loaded the model before refusing"))
    args = {"samples0": ["--samples", "0"], "nan": ["--temperature", "nan"], "inf": ["--temperature", "inf"],
            "negative": ["--temperature", "-1"], "tokens-5": ["--max-tokens", "-5"], "tokens0": ["--max-tokens", "0"],
            "outdir": ["--out", str(tmp_path)], "outmissing": ["--out", str(tmp_path / "missing" / "dir" / "o.jsonl")]}
    code, err = cli_one_line(capsys, "generate", str(run / "run"), *args[case])
    assert code == 2 and expected in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def _a_run_with_every_file(run, tmp_path):
    """A copy of the fixture's run with the files a run started by the CLI also has."""
    import shutil

    copy = tmp_path / "ct"
    shutil.copytree(run / "run", copy, ignore=shutil.ignore_patterns(".optbench.lock"))
    (copy / ".hydra").mkdir()
    (copy / ".hydra" / "config.yaml").write_text("train: {}\n")
    (copy / "train.log").write_text("[INFO] step 0\n")
    (copy / "summary.step-00000004.json").write_text("{}\n")
    return copy


def test_generate_never_writes_over_a_runs_files_or_a_stranger(run, tmp_path, capsys, monkeypatch):
    from optbench.generate import load

    ct = _a_run_with_every_file(run, tmp_path)
    (tmp_path / "notes.txt").write_text("my notes\n")
    (tmp_path / "linked.jsonl").symlink_to(ct / "metrics.jsonl")
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    event = sorted((ct / "tensorboard").iterdir())[0]
    owned = {"summary.json": "the run's summary", "metrics.jsonl": "the run's per-step metrics",
             "train.log": "the run's log", ".hydra/config.yaml": "the run's config",
             "summary.step-00000004.json": "the run's summary", f"tensorboard/{event.name}": "the run's TensorBoard",
             "checkpoints/step-00000004/optbench.json": "the run's checkpoints",
             "checkpoints/new.jsonl": "the run's checkpoints", ".hydra/new.jsonl": "the run's config"}
    monkeypatch.setattr(load, "load_run", lambda *_: pytest.fail("loaded the model before refusing"))
    for name, what in owned.items():
        code, err = cli_one_line(capsys, "generate", str(ct), "--out", str(ct / name))
        assert code == 2 and f"--out {ct / name} is {what}" in err and "give a file of its own" in err, (name, err)
    for path, what in ((tmp_path / "notes.txt", "exists and is not an earlier output of optbench generate"),
                       (tmp_path / "linked.jsonl", "the run's per-step metrics")):
        code, err = cli_one_line(capsys, "generate", str(ct), "--out", str(path))
        assert code == 2 and what in err, err
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before
    monkeypatch.undo()
    for _ in range(2):  # a new file in the run directory, then that output again: written
        main(["generate", str(ct), "--samples", "1", "--max-tokens", "2", "--quiet", "--out", str(ct / "g.jsonl")])
        assert _records(ct / "g.jsonl")[0]["kind"] == "sample"


def test_several_runs_are_generated_in_turn_each_as_alone_with_its_file_in_its_directory(run, tmp_path, capsys):
    """optbench generate RUN RUN ...: each run's lines as a command of its own writes them, --out-name
    NAME in each run; --out with several runs, a path for --out-name, or a run given twice, is refused
    before a model is loaded."""
    import shutil

    from optbench.generate import load

    runs = [tmp_path / "a", tmp_path / "b"]
    for r in runs:
        shutil.copytree(run / "run", r, ignore=shutil.ignore_patterns(".optbench.lock"))
    options = ["--samples", "2", "--climate", "true,train", "--max-tokens", "4", "--score", "--quiet"]
    main(["generate", str(runs[0]), *options, "--out", str(tmp_path / "alone.jsonl")])
    main(["generate", *map(str, runs), *options, "--out-name", "g.jsonl"])
    printed = capsys.readouterr().out
    assert printed.count("number score over 2 samples") == 3 and f"== {runs[1]}" in printed
    alone = (tmp_path / "alone.jsonl").read_text()
    assert all((r / "g.jsonl").read_text() == alone for r in runs)  # the same model, the same lines
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(load, "load_run", lambda *_: pytest.fail("loaded the model before refusing"))
        for args, expected in (([*map(str, runs), "--out", str(tmp_path / "x.jsonl")],
                                "with 2 RUNs: give --out-name NAME (e.g. generated.jsonl)"),
                               ([str(runs[0]), "--out-name", "sub/g.jsonl"], "--out-name sub/g.jsonl: give a file name"),
                               ([str(runs[0]), f"{runs[0]}/"], "is given twice: give each RUN once"),
                               ([*map(str, runs), "--out-name", "summary.json"], "is the run's summary")):
            code, err = cli_one_line(capsys, "generate", *args)
            assert code == 2 and expected in err, err


def test_the_task_preset_fits_every_caption_turns_augmentation_off_and_checkpoints_the_last_step(tmp_path):
    """What docs/climate-llm.md's recipe relies on: no caption of a global file with all five
    variables is cut at the default train.seq_len, and the run leaves a checkpoint for generate."""
    from optbench.config import to_config
    from optbench.data.netcdf.synth import write_synthetic
    from optbench.data.paired import encode

    write_synthetic(tmp_path / "data.nc", days=3, step_hours=6, nlat=8, nlon=16)
    write_captions([str(tmp_path / "data.nc")], tmp_path / "c.jsonl")
    cfg = to_config(compose_cfg(["task=climate_text", "data=netcdf", f"data.paths=[{tmp_path / 'data.nc'}]",
                                 f"data.text={tmp_path / 'c.jsonl'}", "fusion=gated", "train.steps=7"]))
    texts = [json.loads(line)["text"] for line in (tmp_path / "c.jsonl").read_text().splitlines()]
    assert all(len(t.encode()) >= 250 for t in texts)  # all five roles stated
    assert all(encode(t, seq_len=cfg.train.seq_len)[1] <= cfg.train.seq_len + 1 for t in texts)
    assert cfg.data.augment.enabled is False and cfg.checkpoint.every == 7
    other = to_config(compose_cfg(["task=climate", "data=netcdf", f"data.paths=[{tmp_path / 'data.nc'}]"]))
    assert other.data.augment.enabled is True and other.checkpoint.every == 0 and other.train.seq_len == 256
