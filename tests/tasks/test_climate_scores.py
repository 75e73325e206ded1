"""Forecasts scored as the field scores them: cos(latitude)-weighted RMSE and ACC against the
training split's climatology at every lead of an autoregressive rollout, beside persistence and
climatology, checked against a numpy reference computed from the file itself."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import xarray as xr

from optbench.config import to_config
from optbench.data.netcdf import climatology as climatology_module
from optbench.data.netcdf.synth import write_synthetic
from optbench.run.train import train
from optbench.tasks import build_task
from optbench.training.build import build_model, materialize
from tests.helpers import compose_cfg

NAMES = ["temperature", "pressure", "humidity", "u_wind", "v_wind"]


@pytest.fixture(scope="module")
def tiny_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("scores") / "tiny.nc"
    write_synthetic(path, days=6, step_hours=6, nlat=8, nlon=16, time_chunk=4)  # 24 steps
    return path


@pytest.fixture(scope="module")
def task_and_model(tiny_file, tmp_path_factory):
    """The climate task with a two-lead rollout and its (untrained, seeded) model, shared."""
    cfg = to_config(compose_cfg(overrides(tiny_file, tmp_path_factory.mktemp("stats"))))
    task = build_task(cfg)
    model = build_model(cfg, task)
    materialize(model, device=torch.device("cpu"), seed=0)
    return task, model.eval()


def overrides(path, tmp_path, *extra: str) -> list[str]:
    return ["task=climate", "data=netcdf", f"data.paths=[{path}]", f"data.stats_cache={tmp_path / 'stats'}",
            "model=tiny", "train.device=cpu", "data.eval_fraction=0.3", "task.rollout_steps=2",
            "estimate.predict=false", *extra]  # the step's prediction is tested in tests/estimate


def physical_frames(path) -> np.ndarray:
    """(time, channel, lat, lon) straight from the file, latitude ascending, float64."""
    with xr.open_dataset(path, engine="h5netcdf") as ds:
        parts = [ds[n].values[:, None] if ds[n].ndim == 3 else ds[n].values for n in NAMES]
        return np.concatenate(parts, axis=1).astype(np.float64)


def weighted_scores(forecast, target, clim, weight) -> tuple[np.ndarray, np.ndarray]:
    """WeatherBench2's definitions over (sample, channel, lat, lon): RMSE = sqrt of the weighted MSE
    over all samples; ACC = the per-sample weighted anomaly correlation, averaged."""
    w = weight[None, None, :, None]
    rmse = np.sqrt((w * (forecast - target) ** 2).sum(axis=(0, 2, 3)) / (w * np.ones_like(target)).sum(axis=(0, 2, 3)))
    a, b = forecast - clim, target - clim
    with np.errstate(invalid="ignore"):  # the climatology's own ACC is 0/0
        acc = (w * a * b).sum(axis=(2, 3)) / np.sqrt((w * a * a).sum(axis=(2, 3)) * (w * b * b).sum(axis=(2, 3)))
    return rmse, acc.mean(axis=0)


def test_rollout_scores_match_a_numpy_reference_from_the_file(tiny_file, task_and_model):
    task, model = task_and_model
    eval_set = task.build_datasets()[1]
    batches = list(torch.utils.data.DataLoader(eval_set, batch_size=3))
    assert [len(b["sample"]) for b in batches] == [3, 1]  # unequal batches: averaging per batch would be wrong
    sums: dict = {}
    forecasts: list[list[np.ndarray]] = [[], []]
    with torch.no_grad():
        for batch in batches:
            out = model(task.inputs(batch))
            for key, value in task.eval_metrics(out, batch, model=model).items():
                sums[key] = sums[key] + value if key in sums else value
            # the rollout by hand: the first forecast fed back as the newest input
            first = batch["frames"][:, 1] + out[:, 0]
            second = first + model(torch.stack([batch["frames"][:, 1], first], dim=1))[:, 0]
            forecasts[0].append(first.double().numpy())
            forecasts[1].append(second.double().numpy())
    metrics = task.finalize_eval_metrics(sums)

    raw = physical_frames(tiny_file)
    mean, std = task.data.stats.mean[None, :, None, None], task.data.stats.std[None, :, None, None]
    train_steps = task.data.train_steps
    hours = np.arange(24) % 4  # 6-hourly from 00:00: four hours of day
    clim_by_hour = np.stack([raw[:train_steps][hours[:train_steps] == h].mean(axis=0) for h in range(4)])
    np.testing.assert_allclose(task.climatology.mean, clim_by_hour, rtol=1e-5)  # training steps only
    assert not np.allclose(clim_by_hour[0], raw[hours == 0].mean(axis=0), rtol=1e-5)  # eval steps changed it
    lat = np.linspace(-78.75, 78.75, 8)
    weight = np.cos(np.deg2rad(lat)) / np.cos(np.deg2rad(lat)).mean()
    starts = np.arange(eval_set.split.num_samples) + eval_set.split.first
    labels = [c.label for c in task.channels]
    for k, lead in enumerate(["6h", "12h"]):
        target_steps = starts + 2 + k
        target, clim = raw[target_steps], clim_by_hour[hours[target_steps]]
        forecast = np.concatenate(forecasts[k]) * std + mean
        for name, pred in (("", forecast), ("_persistence", raw[starts + 1]), ("_climatology", clim)):
            rmse, acc = weighted_scores(pred, target, clim, weight)
            for c in (0, 4, 13):  # temperature@1000, pressure, u_wind@1000
                assert metrics[f"wrmse{name}/{lead}/{labels[c]}"] == pytest.approx(rmse[c], rel=1e-4)
                if name != "_climatology":
                    assert metrics[f"acc{name}/{lead}/{labels[c]}"] == pytest.approx(acc[c], rel=1e-4, abs=1e-6)
    assert f"acc_climatology/6h/{labels[0]}" not in metrics  # 0 by construction: not reported


def test_a_perfect_forecast_scores_zero_error_and_acc_one_at_every_lead(task_and_model):
    task, _ = task_and_model
    batch = next(iter(torch.utils.data.DataLoader(task.build_datasets()[1], batch_size=4)))
    frames = batch["frames"]
    calls = []

    def oracle(history: torch.Tensor) -> torch.Tensor:  # knows the targets: lead k+1 at frame 2 + k
        calls.append(history)
        change = frames[:, 2 + len(calls)] - history[:, -1]
        return torch.stack([change, change], dim=1)

    first = torch.stack([frames[:, 2] - frames[:, 1]] * 2, dim=1)
    metrics = task.finalize_eval_metrics(task.eval_metrics(first, batch, model=oracle))
    assert len(calls) == 1 and torch.allclose(calls[0][:, -1], frames[:, 2], atol=1e-5)  # fed its own forecast back
    for lead in ("6h", "12h"):
        assert metrics[f"wrmse/{lead}/pressure"] == pytest.approx(0.0, abs=1e-3)
        assert metrics[f"acc/{lead}/temperature@500"] == pytest.approx(1.0, abs=1e-6)
        assert metrics[f"wrmse_persistence/{lead}/pressure"] > 1.0  # Pa: persistence is not perfect
    assert (metrics["wrmse_persistence/12h/temperature@500"] > metrics["wrmse_persistence/6h/temperature@500"])


def test_lead_steps_space_inputs_and_targets_and_the_climatology_is_cached(tiny_file, tmp_path, monkeypatch):
    task = build_task(to_config(compose_cfg(overrides(tiny_file, tmp_path, "task.lead_steps=2"))))
    eval_set = task.build_datasets()[1]
    item = eval_set[0]
    start = int(item["sample"])
    raw = physical_frames(tiny_file)
    stats = task.data.stats
    normalized = (raw[[start, start + 2, start + 4, start + 6]] - stats.mean[None, :, None, None]) / \
        stats.std[None, :, None, None]
    np.testing.assert_allclose(item["frames"].numpy(), normalized, rtol=1e-4, atol=1e-5)
    assert task.lead_labels == ["12h", "24h"]

    def must_not_run(*args, **kwargs):
        raise AssertionError("climatology recomputed despite the cache")

    monkeypatch.setattr(climatology_module, "compute_climatology", must_not_run)
    again = build_task(to_config(compose_cfg(overrides(tiny_file, tmp_path, "task.lead_steps=2"))))
    np.testing.assert_array_equal(again.climatology.mean, task.climatology.mean)


def test_lead_past_the_data_is_one_line(tiny_file, tmp_path):
    for name, extra, expected in (
        ("lead", "task.lead_steps=20", "has 24 time steps; data.history=2 with task.lead_steps=20 needs at least 41"),
        ("rollout", "task.lead_steps=5", "24 time steps: too few for a train split of at least 11 and an eval "
                                         "split of at least 16 steps (data.history=2, task.lead_steps=5, "
                                         "task.rollout_steps=2"),
    ):
        result = train(compose_cfg(overrides(tiny_file, tmp_path, extra)), run_dir=tmp_path / name)
        assert result.exit_code == 2 and "\n" not in result.error and expected in result.error, result.error
        assert json.loads((tmp_path / name / "summary.json").read_text())["steps"] == 0


@pytest.mark.parametrize("width", [80, 132])
def test_the_end_of_run_summary_shows_the_scores_as_a_table_that_fits(task_and_model, width):
    """Issue 47 item 2: twelve lines of 17 channels each, hundreds of characters wide; now a table
    of channels x leads, each score beside persistence's and climatology's, within the terminal."""
    from optbench.outputs import format_summary
    from optbench.summary import Loss, RunSummary

    task, model = task_and_model
    batch = next(iter(torch.utils.data.DataLoader(task.build_datasets()[1], batch_size=4)))
    with torch.no_grad():
        metrics = task.finalize_eval_metrics(task.eval_metrics(model(task.inputs(batch)), batch, model=model))
    text = format_summary(RunSummary(status="completed", loss=Loss(eval_metrics=metrics)), "run", width=width)
    lines = text.splitlines()
    assert max(len(line) for line in lines) <= width
    assert "every value in summary.json loss.eval_metrics" in " ".join(text.split())
    header = next(i for i, line in enumerate(lines) if line.split()[:3] == ["channel", "wRMSE", "pers"])
    assert lines[header].split()[1:6] == ["wRMSE", "pers", "clim", "ACC", "pers"]
    rows = {line.split()[0]: line.split()[1:] for line in lines[header + 1:header + 1 + len(task.channels)]}
    assert list(rows) == [c.label for c in task.channels]  # one row per channel, names whole
    for label, cells in rows.items():
        assert float(cells[0]) == pytest.approx(metrics[f"wrmse/6h/{label}"], rel=2e-3)  # 3 significant digits
        assert float(cells[2]) == pytest.approx(metrics[f"wrmse_climatology/6h/{label}"], rel=2e-3)
        assert cells[3] == f"{metrics[f'acc/6h/{label}']:.3f}"
    assert not any(line.lstrip().startswith("wrmse") for line in lines)  # no line per metric and lead
