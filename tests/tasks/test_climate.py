"""task=climate: synth -> inspect -> train end to end, patch embedding and head, auxiliary losses
only on loss_freq steps, physics constraints, augmentation bounds and seeding, NRMSE from sums."""

from __future__ import annotations

import json
import math
import re
import shlex

import numpy as np
import pytest
import torch
import xarray as xr
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from optbench.cli import main as cli_main
from optbench.config import AugmentConfig, to_config
from optbench.data.augment import PhysicsAugment
from optbench.data.netcdf.synth import write_synthetic
from optbench.errors import ConfigError
from optbench.model.decoder import flops_per_token
from optbench.outputs import read_metrics
from optbench.report.command import main as report_main
from optbench.run.train import train
from optbench.tasks import build_task
from optbench.tasks.climate import PatchEmbed, PatchHead, PhysicsConstraints
from optbench.training.build import build_model, materialize
from tests.helpers import compose_cfg, read_summary, run_cli_here

VARIABLES = ("temperature", "pressure", "humidity", "u_wind", "v_wind")


@pytest.fixture(scope="module")
def tiny_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("climate") / "tiny.nc"
    write_synthetic(path, days=6, step_hours=6, nlat=8, nlon=16, time_chunk=4)  # 24 steps
    return path


def climate_overrides(path, tmp_path, *extra: str, device: str = "cpu") -> list[str]:
    """Small and fast; on the CPU like the rest of the fast tier (the CUDA checks are at the end)."""
    return ["task=climate", "data=netcdf", f"data.paths=[{path}]", f"data.stats_cache={tmp_path / 'stats'}",
            f"train.device={device}",
            "data.eval_fraction=0.2", "model=tiny", "train.steps=5", "train.batch_size=4", "measure.warmup_steps=1",
            "train.eval_batches=1", "log.progress=log", "measure.track_memory=false", "loss_freq.num_queries=32",
            "estimate.predict=false", *extra]  # predicted in the command-line run below only


# ------------------------------------------------------------------------------------ end to end
def test_synth_inspect_train_from_the_command_line(tmp_path, capsys):
    data = tmp_path / "data.nc"
    cli_main(["data", "synth", str(data), "--days", "8", "--nlat", "8", "--nlon", "16"])
    assert "32 steps x 17 channels on a 8x16 grid" in capsys.readouterr().out
    cli_main(["data", "inspect", str(data)])
    report = capsys.readouterr().out
    for text in ("time 32", "every 6 h", "(ascending, global)", "air_temperature", "8x4x8x16 zlib",
                 "NetCDF4/HDF5, read with xarray engine 'h5netcdf'", "usable by optbench: yes: 17 channels on a 8x16 grid"):
        assert text in report, text
    # what a user downloads: a regional NetCDF3 file in a folder whose name has a space and an umlaut
    folder = tmp_path / "Downloads für mich"
    folder.mkdir()
    regional = folder / "era5 europe.nc"
    with xr.open_dataset(data) as ds:
        ds.isel(lon=slice(0, 8)).load().to_netcdf(regional, engine="scipy")
    cli_main(["data", "inspect", str(regional)])
    report = capsys.readouterr().out
    assert "NetCDF3 (classic), read with xarray engine 'scipy'" in report and "(ascending, regional)" in report
    command = report.strip().splitlines()[-1].strip()
    assert command.startswith("optbench train task=climate data=netcdf 'data.paths=[\"")
    run_dir = tmp_path / "run"
    args = shlex.split(command)[2:]  # exactly as printed, then the test's size and place
    result = run_cli_here("train", *args, "model=tiny", "train.device=cpu", "train.steps=4", "train.batch_size=4",
                          "measure.warmup_steps=1", "log.progress=log", f"hydra.run.dir={run_dir}", capsys=capsys)
    assert result.returncode == 0, result.stderr[-2000:]
    summary = read_summary(run_dir)
    assert summary["status"] == "completed" and summary["task"] == "climate"
    assert summary["predicted"]["step_time_s"] > 0 and summary["predicted"]["data"]["seconds_per_batch"] > 0
    metrics = summary["loss"]["eval_metrics"]
    for name in VARIABLES:
        assert 0 < metrics[f"nrmse/{name}"] < 2 and metrics[f"rmse/{name}"] > 0
    assert "nrmse       temperature" in result.stdout  # printed per variable
    assert summary["throughput"]["tokens_per_step"] == 4 * (8 // 4) * (8 // 4)
    assert summary["throughput"]["data_wait_frac"] is not None
    evals = [r for r in read_metrics(run_dir) if r["kind"] == "eval"]
    assert evals[-1]["nrmse/temperature"] == metrics["nrmse/temperature"]
    # the field's scores at every lead of the rollout (6-hourly steps): summary, log, TensorBoard, report
    for key in ("wrmse/6h/temperature@500", "wrmse/18h/pressure", "wrmse_persistence/12h/u_wind@850",
                "wrmse_climatology/6h/v_wind@250", "acc/18h/humidity@1000", "acc_persistence/6h/pressure"):
        assert math.isfinite(metrics[key]) and evals[-1][key] == metrics[key], key
    assert -1 <= metrics["acc/6h/temperature@500"] <= 1 and "lead 18h" in result.stdout  # the table's leads
    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    assert "eval/acc/12h/temperature@500" in events.Tags()["scalars"]
    with pytest.raises(SystemExit):
        report_main([str(run_dir), "--no-plots", "--out", str(tmp_path / "report")])
    report = capsys.readouterr().out
    assert "Forecast scores" in report and re.search(r"12h\s+temperature@500\s+[0-9.]+\s+[0-9.]+", report)


def test_aux_losses_only_on_loss_freq_steps(tiny_file, tmp_path):
    cfg = compose_cfg(climate_overrides(tiny_file, tmp_path, "loss_freq.every=2"))
    result = train(cfg, run_dir=tmp_path / "run")
    assert result.status == "completed", result.error
    records = [r for r in read_metrics(tmp_path / "run") if r["kind"] == "train"]
    for record in records:
        on = record["step"] % 2 == 0
        assert record["aux_computed"] == on
        if on:
            assert set(record["aux"]) == {"inverse", "physics_humidity", "physics_mass", "physics_energy"}
            assert all(math.isfinite(v) and v >= 0 for v in record["aux"].values())
    assert result.summary["applied"]["loss_freq"] == {"name": "every_step", "every": 2, "num_queries": 32}


def test_activation_checkpointing_applies_to_the_climate_task(tiny_file, tmp_path):
    losses = {}
    for mode in ("none", "full"):
        cfg = compose_cfg(climate_overrides(tiny_file, tmp_path, f"ac={mode}", "train.steps=3"))
        result = train(cfg, run_dir=tmp_path / mode)
        assert result.status == "completed", result.error
        losses[mode] = [r["loss"] for r in read_metrics(tmp_path / mode) if r["kind"] == "train"]
    assert losses["none"] == losses["full"]


# ------------------------------------------------------------------------------------ the model
def test_patch_embedding_and_head_pad_and_crop_the_grid():
    torch.manual_seed(0)
    embed = PatchEmbed(channels=2 * 3, patch=4, grid=(10, 18), dim=8, init_std=0.02)
    head = PatchHead(channels=3, patch=4, grid=(10, 18), dim=8)
    for module in (embed.proj, embed.pos, head.proj):
        module.reset_parameters()
    x = torch.randn(5, 2, 3, 10, 18)
    tokens = embed(x)
    assert tokens.shape == (5, 3 * 5, 8)
    out = head(tokens)
    assert out.shape == (5, 2, 3, 10, 18)
    # token (0, 0) sees exactly the top-left 4x4 patch of every step and channel
    changed = x.clone()
    changed[..., 5:, 5:] += 1.0
    assert torch.equal(embed(changed)[:, 0], tokens[:, 0])
    assert not torch.equal(embed(changed)[:, 6], tokens[:, 6])


def test_climate_model_flops_count_the_patch_embedding_and_head(tiny_file, tmp_path):
    """FlopCounterMode agrees with 6 N_matmul + 12 L d T, except that no gradient flows into the
    data, so the patch embedding's input gradient (2 N_embed per token) is never computed. The
    math attention path is used: FlopCounterMode has no formula for CPU flash attention."""
    cfg = to_config(compose_cfg(climate_overrides(tiny_file, tmp_path, "attention=math")))
    task = build_task(cfg)
    assert task.tokens_per_sample() == (8 // 4) * (16 // 4)
    model = build_model(cfg, task)
    materialize(model, device=torch.device("cpu"), seed=0)
    embed_in, head_out = 2 * 17 * 16, 2 * 17 * 16
    assert model.embed.proj.weight.shape == (128, embed_in) and model.head.proj.weight.shape == (head_out, 128)
    from torch.utils.flop_counter import FlopCounterMode

    batch = next(iter(torch.utils.data.DataLoader(task.build_datasets()[1], batch_size=1)))
    counter = FlopCounterMode(display=False)
    with counter:
        task.losses(model(task.inputs(batch)), batch, with_aux=False).total.backward()
    tokens = task.tokens_per_sample()
    embed_params = model.embed.proj.weight.numel()
    assert counter.get_total_flops() == (flops_per_token(model, seq_len=tokens) - 2 * embed_params) * tokens


# ------------------------------------------------------------------------------------ physics
def _physics(channels_roles, *, lat=np.linspace(-80, 80, 6), weights=None):
    c = len(channels_roles)
    lower = np.array([0.0 if r == "humidity" else -np.inf for r in channels_roles])
    upper = np.array([0.05 if r == "humidity" else np.inf for r in channels_roles])
    return PhysicsConstraints(roles=list(channels_roles), mean=np.linspace(1.0, 2.0, c), std=np.full(c, 0.5),
                              lower=lower, upper=upper, lat=lat,
                              weights=weights or {"humidity": 1.0, "mass": 1.0, "energy": 1.0})


def test_physics_constraints_are_zero_for_a_conserving_forecast_and_grow_with_violations():
    roles = ["temperature", "pressure", "humidity", "u_wind", "v_wind"]
    physics = _physics(roles)
    # humidity inside [0, 0.05] in physical units: mean 1.5 std 0.5 -> normalized (q - 1.5) / 0.5
    last = torch.randn(3, 5, 6, 12) * 0.1
    last[:, 2] = (0.02 - 1.5) / 0.5
    valid = torch.ones_like(last, dtype=torch.bool)
    terms = physics(last.clone(), last, valid)
    assert set(terms) == {"physics_humidity", "physics_mass", "physics_energy"}
    assert all(float(v) == pytest.approx(0.0, abs=1e-10) for v in terms.values())
    rolled = physics(last.roll(5, dims=-1), last, valid)  # a zonal shift conserves global means
    assert float(rolled["physics_mass"]) == pytest.approx(0.0, abs=1e-10)
    assert float(rolled["physics_energy"]) == pytest.approx(0.0, abs=1e-8)
    warmer = last.clone()
    warmer[:, 0] += 0.2
    assert float(physics(warmer, last, valid)["physics_energy"]) > 0
    heavier = last.clone()
    heavier[:, 1] += 0.3
    assert float(physics(heavier, last, valid)["physics_mass"]) == pytest.approx(0.09, rel=1e-4)
    negative_q = last.clone()
    negative_q[:, 2, 0, 0] = (-0.1 - 1.5) / 0.5  # q = -0.1: 0.1 below the bound = 0.2 std
    expected = 3 * 0.2**2 / (3 * 6 * 12)  # one violating point per sample
    assert float(physics(negative_q, last, valid)["physics_humidity"]) == pytest.approx(expected, rel=1e-4)


def test_physics_ignores_missing_points_and_absent_roles():
    physics = _physics(["temperature", "other"], weights={"humidity": 1.0, "mass": 1.0, "energy": 2.0})
    last = torch.zeros(2, 2, 6, 12)
    valid = torch.ones_like(last, dtype=torch.bool)
    valid[:, :, 0, 0] = False
    forecast = last.clone()
    forecast[:, 0, 0, 0] = 50.0  # a change only where the input is missing
    assert set(physics(forecast, last, valid)) == {"physics_energy"}
    assert float(physics(forecast, last, valid)["physics_energy"]) == 0.0


# ------------------------------------------------------------------------------------ augmentation
def _augmenter(cfg: AugmentConfig, *, global_lon=True, history=2):
    roles = ["temperature", "pressure", "humidity", "u_wind"]
    mean, std = np.array([280.0, 1e5, 0.01, 5.0]), np.array([20.0, 800.0, 0.005, 8.0])
    lower = np.array([-np.inf, -np.inf, 0.0, -np.inf])
    upper = np.array([np.inf, np.inf, 0.03, np.inf])
    return PhysicsAugment(cfg, roles=roles, mean=mean, std=std, lower=lower, upper=upper, history=history,
                          global_lon=global_lon, seed=7), mean, std


def _frames(batch=16, history=2):
    torch.manual_seed(0)
    frames = torch.randn(batch, history + 1, 4, 6, 12)
    frames[:, :, 2] *= 3  # humidity from -0.035 to 0.055 kg/kg: outside its bounds here and there
    frames[0, 0, 1, 2, 3] = float("nan")
    return frames


def test_augmentation_keeps_humidity_within_bounds_and_missing_points_missing():
    aug, mean, std = _augmenter(AugmentConfig(prob=1.0, humidity_noise_std=5.0, scale_factor_range=[0.5, 2.0]))
    frames = _frames()
    out = aug(frames, step=3)
    humidity = out[:, :, 2] * std[2] + mean[2]
    assert humidity.min() >= -1e-7 and humidity.max() <= 0.03 + 1e-7
    before = frames[:, :, 2] * std[2] + mean[2]
    assert before.min() < 0 and before.max() > 0.03  # the bounds were really needed
    assert torch.isnan(out).sum() == 1
    assert not torch.equal(out[:, :2, 0], frames[:, :2, 0])  # temperature noise on the inputs


def test_augmentation_is_seeded_by_step_and_leaves_its_input_alone():
    aug, _, _ = _augmenter(AugmentConfig())
    frames = _frames()
    copy = frames.clone()
    first, again = aug(frames, step=5, micro=1), aug(frames, step=5, micro=1)
    assert torch.equal(first.nan_to_num(), again.nan_to_num())
    assert torch.equal(frames.nan_to_num(), copy.nan_to_num())
    assert not torch.equal(aug(frames, step=6, micro=1).nan_to_num(), first.nan_to_num())
    assert not torch.equal(aug(frames, step=5, micro=0).nan_to_num(), first.nan_to_num())


def test_augmentation_probability_zero_is_the_identity():
    aug, _, _ = _augmenter(AugmentConfig(prob=0.0))
    frames = _frames()
    assert torch.equal(aug(frames, step=1).nan_to_num(), frames.nan_to_num())


def test_roll_moves_inputs_and_target_together():
    cfg = AugmentConfig(prob=1.0, temperature_noise_std=0, pressure_noise_std=0, humidity_noise_std=0,
                        roll_prob=1.0, temporal_shift_prob=0.0, scale_factor_range=[1.0, 1.0])
    aug, _, _ = _augmenter(cfg)
    frames = _frames().nan_to_num()
    frames[:, :, 2] = frames[:, :, 2].clamp(-2.0, 2.0)  # inside the humidity bounds: no clamping
    out = aug(frames, step=2)
    shifts = []
    for sample, original in zip(out, frames, strict=True):
        matches = [s for s in range(12) if torch.equal(sample, original.roll(s, dims=-1))]
        assert len(matches) == 1  # the whole sample, every step, rolled by one shift
        shifts.append(matches[0])
    assert len(set(shifts)) > 3


def test_temporal_shift_lags_the_inputs_only():
    cfg = AugmentConfig(prob=1.0, temperature_noise_std=0, pressure_noise_std=0, humidity_noise_std=0,
                        roll_prob=0.0, temporal_shift_prob=1.0, scale_factor_range=[1.0, 1.0])
    aug, _, _ = _augmenter(cfg, history=3)
    frames = _frames(history=3).nan_to_num().clamp(-2.0, 2.0)
    out = aug(frames, step=0)
    assert torch.equal(out[:, 0], frames[:, 0]) and torch.equal(out[:, 1], frames[:, 0])
    assert torch.equal(out[:, 2], frames[:, 1]) and torch.equal(out[:, 3], frames[:, 3])


def test_roll_defaults_to_the_grid_and_an_explicit_roll_is_refused_on_a_regional_grid():
    with pytest.raises(ConfigError, match="data.augment.roll_prob=0"):
        _augmenter(AugmentConfig(roll_prob=0.3), global_lon=False)
    assert _augmenter(AugmentConfig(roll_prob=0.0), global_lon=False)[0].roll_prob == 0.0
    assert _augmenter(AugmentConfig(), global_lon=False)[0].roll_prob == 0.0  # the default fits the grid
    assert _augmenter(AugmentConfig(), global_lon=True)[0].roll_prob == 0.3


# ------------------------------------------------------------------------------------ evaluation
def test_nrmse_is_computed_from_sums_over_all_eval_batches(tiny_file, tmp_path):
    cfg = to_config(compose_cfg(climate_overrides(tiny_file, tmp_path, "task.rollout_steps=1")))  # no model here
    task = build_task(cfg)
    eval_set = task.build_datasets()[1]
    batches = list(torch.utils.data.DataLoader(eval_set, batch_size=2))
    assert len(batches) == 2 and len(batches[1]["sample"]) == 1  # unequal batches: averaging would be wrong
    torch.manual_seed(0)
    outputs = [torch.randn(len(b["sample"]), 2, 17, 8, 16) * 0.3 for b in batches]
    sums: dict = {}
    for out, batch in zip(outputs, batches, strict=True):
        for key, value in task.eval_metrics(out, batch).items():
            sums[key] = sums[key] + value if key in sums else value
    metrics = task.finalize_eval_metrics(sums)
    # the same from all samples at once, in numpy
    mean, std = task.data.stats.mean[:, None, None], task.data.stats.std[:, None, None]
    frames = np.concatenate([b["frames"].numpy() for b in batches]).astype(np.float64)
    delta = np.concatenate([o[:, 0].numpy() for o in outputs]).astype(np.float64)
    forecast = (frames[:, 1] + delta) * std + mean
    target = frames[:, 2] * std + mean
    channels = [0, 1, 2, 3]  # temperature at its four levels
    sse = ((forecast - target)[:, channels] ** 2).sum()
    sst = sum(((target[:, c] - target[:, c].mean()) ** 2).sum() for c in channels)
    assert metrics["nrmse/temperature"] == pytest.approx(math.sqrt(sse / sst), rel=1e-6)
    persistence = (((frames[:, 1] * std + mean) - target)[:, channels] ** 2).sum()
    assert metrics["nrmse_persistence/temperature"] == pytest.approx(math.sqrt(persistence / sst), rel=1e-6)
    assert metrics["rmse/temperature"] == pytest.approx(math.sqrt(sse / target[:, channels].size), rel=1e-6)
    assert metrics["nrmse/mean"] == pytest.approx(np.mean([metrics[f"nrmse/{v}"] for v in VARIABLES]))
    json.dumps(metrics)


# ------------------------------------------------------------------------------------ CUDA (lead's GPU check)
@pytest.mark.cuda
def test_augmentation_runs_on_the_gpu_where_the_batch_lives():
    aug, mean, std = _augmenter(AugmentConfig(prob=1.0, humidity_noise_std=5.0))
    frames = _frames().cuda()
    out = aug(frames, step=4)
    assert out.device == frames.device
    assert torch.equal(out.nan_to_num(), aug(frames, step=4).nan_to_num())
    humidity = out[:, :, 2] * std[2] + mean[2]
    assert humidity.nan_to_num(0.01).min() >= -1e-7 and humidity.nan_to_num(0.01).max() <= 0.03 + 1e-7


@pytest.mark.cuda
def test_climate_trains_on_cuda_with_a_worker_and_bf16(tiny_file, tmp_path):
    cfg = compose_cfg(climate_overrides(tiny_file, tmp_path, "precision=bf16", "dataloader.num_workers=1",
                                        "dataloader.pin_memory=true", device="cuda"))
    result = train(cfg, run_dir=tmp_path / "run")
    assert result.status == "completed", result.error
    assert all(math.isfinite(result.summary["loss"]["eval_metrics"][f"nrmse/{v}"]) for v in VARIABLES)
