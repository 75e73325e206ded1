"""make fusion-matrix's statistics and verdicts (bench/fusion_stats.py, bench/fusion_matrix.py),
without running the benchmark: the gap's test over seeds, Holm's correction, the paired
block-bootstrap interval, misses counted, the ridge read-out, and which comparisons the headline
judges."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from tests.helpers import bench_module


@pytest.fixture(scope="module")
def bench():
    with bench_module("fusion_matrix") as module:
        yield module


def test_the_gap_test_is_over_seeds_and_holm_adjusts_across_tests(bench):
    fs = bench.fs
    clear = fs.gap_test([0.030, 0.032, 0.028, 0.031, 0.029])
    assert clear["n"] == 5 and clear["low"] > fs.MIN_GAP and clear["p"] < 1e-4
    crossing = fs.gap_test([0.030, -0.010, 0.002, 0.025, -0.004])  # one good seed does not decide it
    assert crossing["low"] < 0 < crossing["high"] and crossing["p"] > 0.2
    assert fs.gap_test([0.5])["p"] == 1.0  # one seed: no spread, no verdict
    assert fs.holm([0.01, 0.04, 0.03]) == pytest.approx([0.03, 0.06, 0.06])
    assert fs.holm([0.001, 0.9]) == pytest.approx([0.002, 0.9])


def test_the_paired_interval_resamples_blocks_and_drops_misses(bench):
    fs = bench.fs
    times = [f"2000-01-{day:02d}T00:00:00" for day in range(1, 31)]
    blocks = fs.block_ids(times)
    assert blocks.tolist() == [d // 5 for d in range(30)]  # 5 days a block
    other = np.arange(30, dtype=float)
    shifted = fs.paired_interval(other + 1.0, other, blocks)
    assert (shifted["value"], shifted["low"], shifted["high"], shifted["n"], shifted["blocks"]) == (1.0, 1.0, 1.0, 30, 6)
    mine = other + np.where(np.arange(30) < 15, 2.0, 0.0)
    mine[[0, 29]] = np.nan  # two texts that never state the number: left out of the pairs
    varied = fs.paired_interval(mine, other, blocks)
    assert varied["n"] == 28 and varied["low"] < varied["value"] < varied["high"]
    records = [{"field": {"mean": 5.0, "region:north": 1.0}, "numbers": {"mean": 6.5}},
               {"field": {"mean": 5.0, "region:north": 1.0}, "numbers": {}}]
    err, share = fs.errors(records, "area mean")
    assert err[0] == 1.5 and math.isnan(err[1]) and share.tolist() == [1.0, 0.0]


def test_the_ridge_read_out_recovers_a_linear_field(bench):
    rng = np.random.default_rng(0)
    x, w = rng.normal(size=(40, 200)), rng.normal(size=200)
    x_new = rng.normal(size=(5, 200))
    got = bench.fs.ridge(x, x @ w + 3.0, x_new, lam=1e-6)
    assert np.corrcoef(got, x_new @ w + 3.0)[0, 1] > 0.2  # more features than samples: a shrunk read-out
    small = rng.normal(size=(60, 3))
    assert bench.fs.ridge(small, small @ [1.0, -2.0, 0.5] + 3.0, small[:4], lam=1e-9) == pytest.approx(
        small[:4] @ [1.0, -2.0, 0.5] + 3.0, abs=1e-5)


def _versus(low: float, high: float, blocks: int) -> dict:
    return {"mae": 1.0, "stated": 1.0, "value": (low + high) / 2, "low": low, "high": high, "n": 10, "blocks": blocks}


def test_the_headline_judges_only_intervals_from_enough_blocks(bench):
    result = {"gap": bench.fs.gap_test([0.03, 0.031, 0.029]), "quantities": {
        "area mean": {"mae": 1.0, "stated": 1.0, "versus": {"best constant (training mean)": _versus(-0.9, -0.2, 6),
                                                            "persistence (the last input step's value)":
                                                                _versus(-0.9, -0.2, 3)}},
        "regions": {"mae": 1.0, "stated": 1.0, "versus": {"best constant (training mean)": _versus(0.1, 0.4, 6)}},
        "points": {"mae": 1.0, "stated": 1.0, "versus": {"best constant (training mean)": _versus(-0.9, -0.2, 6)}}}}
    tie = {"gap": bench.fs.gap_test([0.03, -0.02, 0.001]), "quantities": {}}
    bench.verdicts([result, tie])
    assert result["verdict"].startswith("reads the climate") and tie["verdict"].startswith("no evidence")
    assert result["gap"]["p_holm"] == pytest.approx(2 * result["gap"]["p"])
    assert result["beats"] == ["best constant (training mean) (area mean)"]  # persistence: 3 blocks, not judged
    assert result["loses_to"] == ["best constant (training mean) (regions)"]  # points: not in the headline
    assert bench.mae_cell(math.nan, 0.0) == "never stated (0%)" and bench.mae_cell(1.234, 0.5) == "1.23 (50%)"


def test_resume_goes_on_only_with_the_same_sizes_and_keeps_what_is_complete(bench, tmp_path):
    args = bench.argparse.Namespace(resume=False, **{k: 1 for k in bench.SIZES})
    with pytest.raises(SystemExit, match="no earlier run"):
        bench.claim(tmp_path / "out", bench.argparse.Namespace(**{**vars(args), "resume": True}))
    bench.claim(tmp_path / "out", args)
    record = (tmp_path / "out" / "matrix.json").read_text()
    with pytest.raises(SystemExit, match="--resume to go on"):
        bench.claim(tmp_path / "out", args)  # a second benchmark never mixes its runs with the first's
    bench.claim(tmp_path / "out", bench.argparse.Namespace(**{**vars(args), "resume": True}))
    with pytest.raises(SystemExit, match="--steps 1 there, 400 here"):
        bench.claim(tmp_path / "out", bench.argparse.Namespace(**{**vars(args), "resume": True, "steps": 400}))
    assert (tmp_path / "out" / "matrix.json").read_text() == record  # nothing rewritten
    # a run recorded before the base kind was a size had optbench's own base: it resumes as that only
    older = tmp_path / "older"
    bench.claim(older, args)
    recorded = json.loads((older / "matrix.json").read_text())
    del recorded["base"]
    (older / "matrix.json").write_text(json.dumps(recorded))
    bench.claim(older, bench.argparse.Namespace(**{**vars(args), "resume": True, "base": "own"}))
    with pytest.raises(SystemExit, match="--base own there, hf here"):
        bench.claim(older, bench.argparse.Namespace(**{**vars(args), "resume": True, "base": "hf"}))
    run = tmp_path / "run"
    run.mkdir()
    assert not bench.completed(run)
    (run / "summary.json").write_text('{"status": "interrupted"}')
    assert not bench.completed(run)  # an interrupted base is trained again
    (run / "summary.json").write_text('{"status": "completed"}')
    assert bench.completed(run)


def test_a_real_file_not_in_the_repository_is_refused_before_anything_is_written(bench, tmp_path, monkeypatch):
    monkeypatch.setitem(bench.DATA, "ncep", {**bench.DATA["ncep"], "copy": "bench/data/not-here.nc"})
    out = tmp_path / "out"
    with pytest.raises(SystemExit, match=r"--data ncep \(bench/data/not-here.nc\): the file is absent: .*README"):
        bench.main(["--data", "ncep,era5uk", "--out", str(out), "--results", str(tmp_path / "results")])
    assert not out.exists() and not (tmp_path / "results").exists()


def test_the_ncep_file_is_trained_on_2013_and_judged_on_the_whole_of_2014(bench):
    import xarray as xr

    from optbench.data.captions import make_spec

    spec, path = bench.DATA["ncep"], bench.HERE.parent / bench.DATA["ncep"]["copy"]
    split = make_spec([str(path)], variables=None, history=2, mode="forecast", eval_fraction=spec["eval_fraction"])
    with xr.open_dataset(path) as ds:
        times = ds["time"].dt.strftime("%Y-%m-%dT%H").values.tolist()
    assert (times[0], times[split.train_steps - 1]) == ("2013-01-01T00", "2013-12-31T18")
    assert (times[split.train_steps], times[-1], len(times)) == ("2014-01-01T00", "2014-12-31T18", 2920)


def test_a_resume_launches_only_the_seeds_with_a_run_to_train(bench, tmp_path):
    args = bench.argparse.Namespace(seeds=5, fusions=["gated", "cross_attention"])
    for seed in range(3):
        for kind in args.fusions:
            for control in (False, True):
                run = tmp_path / f"{kind}-text_only_{control}-seed{seed}"
                run.mkdir()
                (run / "summary.json").write_text('{"status": "completed"}')
    assert bench.todo_seeds(tmp_path, args) == [3, 4]  # a copy of --out: its finished seeds are not trained again
    (tmp_path / "cross_attention-text_only_True-seed1" / "summary.json").write_text('{"status": "interrupted"}')
    assert bench.todo_seeds(tmp_path, args) == [1, 3, 4]
    assert bench.todo_seeds(tmp_path, bench.argparse.Namespace(seeds=2, fusions=["gated"])) == []


@pytest.fixture(scope="module")
def fused_run(tmp_path_factory):
    """A gated fused model trained 2 steps on the captions of a small synthetic file, checkpointed."""
    from tests.helpers import train_fused_climate_run

    return train_fused_climate_run(tmp_path_factory.mktemp("probe"), fusion="gated", steps=2)


def test_the_encoder_probe_reads_the_windows_the_model_reads_from_the_runs_files_wherever_they_are(bench, fused_run,
                                                                                                   tmp_path):
    """The probe's features of an eval step are the trained encoder's output for that eval sample's
    own climate (the run's eval set, batched as training batches it); a run whose files were copied
    elsewhere is probed from the copies; the probe errors average the seeds' per sample."""
    import shutil

    import torch

    from optbench.generate.load import load_run

    for name in ("data.nc", "c.jsonl", "c.jsonl.json"):
        shutil.copyfile(fused_run / name, tmp_path / name)
    data, text = tmp_path / "data.nc", tmp_path / "c.jsonl"
    loaded = load_run(fused_run / "run")
    task, model = loaded.task, loaded.model
    _, evaluation = task.build_datasets()
    batch = torch.utils.data.default_collate(evaluation.__getitems__([0, len(evaluation) - 1]))
    with torch.no_grad():
        expected = model.fusion.encode(task.context(batch), model.rope_cos, model.rope_sin).flatten(1).double()
    steps = [int(s) + task.text_offset for s in batch["sample"]]
    (fused_run / "data.nc").rename(fused_run / "moved.nc")  # the run's own file gone: the copy is read
    try:
        got = bench.fp.encoder_features(fused_run / "run", steps, data=data, text=text)
    finally:
        (fused_run / "moved.nc").rename(fused_run / "data.nc")
    assert torch.equal(torch.from_numpy(got), expected)
    field = bench.fs.Field(data, text)
    ref = [{"step": s, "field": field.facts[s]} for s in steps]
    one = bench.fp.probe_errors([fused_run / "run"], ref, "area mean", data=data, text=text)
    assert one.shape == (2,) and np.all(np.isfinite(one))
    assert bench.fp.probe_errors([fused_run / "run"] * 2, ref, "area mean", data=data, text=text) == pytest.approx(one)


def test_the_gate_openings_are_the_checkpoints_gates_and_are_tabled_per_layer(bench, fused_run):
    """A gated run's gate openings are |tanh(alpha)| of the gates its last checkpoint holds (read
    here straight from the DCP files), per fused layer; after two steps of Adam they have moved off
    zero; the table gives the mean over seeds with their range, under the layers' names."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    (step,) = sorted((fused_run / "run" / "checkpoints").glob("step-*"))
    reader = FileSystemReader(step)
    names = [k for k in reader.read_metadata().state_dict_metadata if k.startswith("app.model.fusion.layers.")
             and k.endswith("_gate.alpha")]
    state = {k: torch.empty(1) for k in names}
    dcp.load(state, storage_reader=reader, no_dist=True)
    want = {}
    for k, v in state.items():
        index, gate = k.split(".")[4], k.split(".")[5].removesuffix("_gate")
        want.setdefault(index, {})[gate] = abs(float(v.tanh()))
    got = bench.fp.gate_openings(fused_run / "run", data=fused_run / "data.nc", text=fused_run / "c.jsonl")
    assert got == want and set(got) == {"0"} and all(0 < v < 0.1 for g in got.values() for v in g.values())
    other = {"0": {"attn": 0.5, "mlp": 0.25}}
    text = bench.gates_table([{"file": "f", "mode": "describe", "gates": [got, other]}, {"kind": "cross_attention"}])
    attn = (got["0"]["attn"] + 0.5) / 2
    assert f"| f | describe | 2 | {attn:.3f} [{got['0']['attn']:.3f}, 0.500] |" in text
    assert "layer 0 attn | layer 0 mlp" in text and bench.gates_table([{"kind": "cross_attention"}]) == ""


def test_parallel_jobs_each_get_their_log_and_share_the_cores_and_a_failure_waits_for_the_others(bench, tmp_path,
                                                                                                monkeypatch):
    """--jobs 2: the files' bases first, each file's matrices once its base is trained; every job in
    its own log with CPUs/2 threads; one failing does not stop the others and is raised after them;
    --jobs 1 runs them in order, no log. An earlier run's directory is refused before any job."""
    import threading
    import time

    seen, started, lock = [], threading.Barrier(2, timeout=30), threading.Lock()

    def note(*what):
        with lock:
            seen.append((*what, getattr(bench._JOB, "log", None), getattr(bench._JOB, "threads", None)))

    def prepare(name, out, args):
        if args.jobs > 1 and name in ("era5uk", "era5"):
            started.wait()  # two bases at once
        time.sleep(0.05 if name == "era5uk" else 0)
        note(name, "base")
        if name == "synthetic":
            raise SystemExit("train exited with 1")

    def matrix(name, mode, data, out, args):
        assert data == out / name / "data.nc"
        note(name, mode)
        if mode == "forecast":
            time.sleep(0.05)
            raise SystemExit("generate exited with 1")

    monkeypatch.setattr(bench, "prepare", prepare)
    monkeypatch.setattr(bench, "matrix", matrix)
    monkeypatch.setattr(bench.os, "cpu_count", lambda: 4)
    args = bench.argparse.Namespace(jobs=2, modes=["describe", "forecast"], resume=False)
    with pytest.raises(SystemExit, match="exited with 1"):
        bench.run_all(["era5uk", "era5", "synthetic"], tmp_path / "a", args)
    logs = {(name, what): (log, threads) for name, what, log, threads in seen}
    assert set(logs) == {("era5uk", "base"), ("era5", "base"), ("synthetic", "base"), ("era5uk", "describe"),
                         ("era5uk", "forecast"), ("era5", "describe"), ("era5", "forecast")}  # none of the failed base
    assert logs["era5uk", "base"] == (tmp_path / "a" / "era5uk" / "prepare.log", 2)
    assert logs["era5", "forecast"] == (tmp_path / "a" / "era5" / "forecast.log", 2)
    order = [(name, what) for name, what, *_ in seen]
    assert all(order.index((name, "base")) < order.index((name, mode)) for name, mode in logs if mode != "base")
    seen.clear()
    args.jobs = 1
    with pytest.raises(SystemExit, match="generate exited with 1"):
        bench.run_all(["era5uk"], tmp_path / "b", args)
    assert seen == [("era5uk", "base", None, None), ("era5uk", "describe", None, None),
                    ("era5uk", "forecast", None, None)]
    with pytest.raises(SystemExit, match="era5uk exists from an earlier run"):
        bench.run_all(["era5", "era5uk"], tmp_path / "b", args)  # era5uk's directory is there
    assert not (tmp_path / "b" / "era5").exists()
