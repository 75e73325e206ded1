"""data=netcdf: real-world file variants, cached statistics, regridding, worker x rank sharding and
resume of the streaming loader, and every bad input refused in one line with exit status 2."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import xarray as xr
from torch.utils.data import DataLoader

from optbench.cli import main as cli_main
from optbench.config import NetCDFDataConfig
from optbench.data import netcdf
from optbench.data.netcdf import ClimateSource, build_climate_data, build_layout
from optbench.data.netcdf.stats import compute_stats
from optbench.data.netcdf.synth import synthetic_dataset, write_synthetic
from optbench.errors import ConfigError
from optbench.run.train import train
from tests.helpers import compose_cfg, run_cli_here

ORDER = ["temperature", "pressure", "humidity", "u_wind", "v_wind"]


def reference(ds: xr.Dataset, names: list[str] = ORDER) -> np.ndarray:
    """(time, channel, lat, lon) in optbench's channel order, latitude ascending."""
    parts = []
    for name in names:
        var = ds[name].sortby("lat")
        parts.append(var.values[:, None] if var.ndim == 3 else var.values)
    return np.concatenate(parts, axis=1).astype(np.float32)


def data_cfg(paths, tmp_path: Path, **overrides) -> NetCDFDataConfig:
    return NetCDFDataConfig(paths=paths, stats_cache=str(tmp_path / "stats"), **overrides)


@pytest.fixture(scope="module")
def synth_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("synth") / "small.nc"
    write_synthetic(path, days=16, step_hours=6, nlat=16, nlon=32, time_chunk=8)  # 64 steps
    return path


# ------------------------------------------------------------------------------------ variants
def test_synth_file_reads_back_exactly_and_is_plausible(synth_file, tmp_path):
    layout = build_layout(data_cfg([str(synth_file)], tmp_path))
    assert [c.role for c in layout.channels] == ["temperature"] * 4 + ["pressure"] + ["humidity"] * 4 + \
        ["u_wind"] * 4 + ["v_wind"] * 4
    assert layout.global_lon and layout.time_chunk == 8 and layout.num_steps == 64
    block = ClimateSource(layout, regrid=False).read(0, 64)
    with xr.open_dataset(synth_file, engine="h5netcdf") as ds:
        np.testing.assert_array_equal(block, reference(ds))
    temperature, pressure, humidity = block[:, 0:4], block[:, 4], block[:, 5:9]
    assert 170 < temperature.min() and temperature.max() < 320
    assert temperature[:, 0].mean() > temperature[:, 3].mean() + 40  # colder aloft
    equator, pole = temperature[:, 0, 7:9].mean(), temperature[:, 0, [0, -1]].mean()
    assert equator > pole + 20
    assert 0 <= humidity.min() and humidity.max() < 0.05
    assert 9.5e4 < pressure.min() and pressure.max() < 1.07e5


def _real_world_variant(tmp_path: Path) -> tuple[str, xr.Dataset]:
    """ERA5-like names and layout: latitude/longitude, descending latitude, valid_time with a
    noleap 'days since 1850' encoding, packed int16 temperature with _FillValue and NaN, a
    humidity without standard_name (role from its name), a surface pressure with an unknown name
    (role from the config), levels on 'pressure_level', split over two files along time."""
    ds = synthetic_dataset(days=8, nlat=16, nlon=32)
    ref = ds.copy(deep=True)
    ds["temperature"][3, 1, 5, 7] = np.nan
    ds["temperature"][10, 0, :, 2] = np.nan
    ref["temperature"][3, 1, 5, 7] = np.nan
    ref["temperature"][10, 0, :, 2] = np.nan
    ds = ds.isel(lat=slice(None, None, -1))
    ds = ds.rename(time="valid_time", lat="latitude", lon="longitude", level="pressure_level",
                   temperature="t", humidity="q", u_wind="u", v_wind="v", pressure="surf")
    del ds["q"].attrs["standard_name"]
    ds["surf"].attrs = {"units": "Pa"}
    ds["valid_time"].encoding = {"units": "days since 1850-01-01", "calendar": "noleap"}
    encoding = {"t": {"dtype": "int16", "scale_factor": 0.01, "add_offset": 250.0, "_FillValue": np.int16(-32767)}}
    half = ds.sizes["valid_time"] // 2
    ds.isel(valid_time=slice(half, None)).to_netcdf(tmp_path / "era_a.nc", engine="h5netcdf", encoding=encoding)
    ds.isel(valid_time=slice(None, half)).to_netcdf(tmp_path / "era_b.nc", engine="h5netcdf", encoding=encoding)
    return str(tmp_path / "era_*.nc"), ref


def test_real_world_variant_reads_like_the_original(tmp_path):
    pattern, ref = _real_world_variant(tmp_path)
    cfg = data_cfg(pattern, tmp_path, roles={"surf": "pressure"})
    layout = build_layout(cfg)
    assert [v.name for v in layout.variables] == ["t", "surf", "q", "u", "v"]  # resolved by role
    assert [v.role for v in layout.variables] == ORDER
    assert layout.lat_descending and np.all(np.diff(layout.lat) > 0)
    assert [f.path.name for f in layout.files] == ["era_b.nc", "era_a.nc"]  # ordered by time, not name
    assert layout.time_dim == "valid_time" and layout.num_steps == 32
    block = ClimateSource(layout, regrid=False).read(0, 32)
    expected = reference(ref)
    assert np.array_equal(np.isnan(block), np.isnan(expected))
    np.testing.assert_allclose(block, expected, atol=0.006, equal_nan=True)  # int16 packing: 0.01 K steps
    # the statistics never see the NaN points
    data = build_climate_data(cfg)
    train_steps = data.train.split.num_samples + cfg.history
    np.testing.assert_allclose(data.stats.mean[0], np.nanmean(expected[:train_steps, 0]), rtol=1e-6)
    assert data.stats.count[0] == np.isfinite(expected[:train_steps, 0]).sum()


def test_variables_by_name_and_levels_selection(synth_file, tmp_path):
    layout = build_layout(data_cfg([str(synth_file)], tmp_path, variables=["pressure", "temperature"],
                                   levels=[850, 250]))
    assert [c.label for c in layout.channels] == ["pressure", "temperature@850", "temperature@250"]
    block = ClimateSource(layout, regrid=False).read(5, 7)
    with xr.open_dataset(synth_file, engine="h5netcdf") as ds:
        np.testing.assert_array_equal(block[:, 1], ds.temperature.values[5:7, 1])
        np.testing.assert_array_equal(block[:, 2], ds.temperature.values[5:7, 3])


def test_regridding_with_xarray_interp(synth_file, tmp_path):
    native = build_layout(data_cfg([str(synth_file)], tmp_path))
    same = build_layout(data_cfg([str(synth_file)], tmp_path, resolution=11.25))  # the native spacing
    assert same.grid == native.grid
    np.testing.assert_allclose(ClimateSource(same, regrid=True).read(0, 3),
                               ClimateSource(native, regrid=False).read(0, 3), rtol=1e-5, atol=1e-4)
    coarse = build_layout(data_cfg([str(synth_file)], tmp_path, resolution=22.5))
    assert coarse.grid == (8, 16)
    block = ClimateSource(coarse, regrid=True).read(0, 3)
    assert block.shape == (3, 17, 8, 16) and np.isfinite(block).all()  # longitude wraps around
    native_block = ClimateSource(native, regrid=False).read(0, 3)
    np.testing.assert_allclose(block[:, :, :, 0], native_block[:, :, ::2, 0][:, :, :8], rtol=0.05)


# ---------------------------------------------------------------------------------- statistics
def test_stats_are_cached_and_invalidated_when_the_file_changes(synth_file, tmp_path, monkeypatch):
    path = tmp_path / "copy.nc"
    shutil.copy(synth_file, path)
    cfg = data_cfg([str(path)], tmp_path)
    first = build_climate_data(cfg).stats
    cached = list((tmp_path / "stats").glob("*.json"))
    assert len(cached) == 1 and json.loads(cached[0].read_text())["channels"][0] == "temperature@1000"

    def must_not_run(*args, **kwargs):
        raise AssertionError("statistics recomputed despite the cache")

    monkeypatch.setattr(netcdf.stats, "compute_stats", must_not_run)
    np.testing.assert_array_equal(build_climate_data(cfg).stats.mean, first.mean)
    monkeypatch.undo()
    write_synthetic(path, days=16, step_hours=6, nlat=16, nlon=32, seed=1)  # same name, new content
    assert len(list((tmp_path / "stats").glob("*.json"))) == 1
    second = build_climate_data(cfg).stats
    assert len(list((tmp_path / "stats").glob("*.json"))) == 2
    assert not np.array_equal(second.mean, first.mean)


def test_reused_statistics_are_said_once_and_cache_clear_recomputes_them(synth_file, tmp_path, monkeypatch, caplog,
                                                                          capsys):
    """Issue 47 item 7: a run reused another run's statistics under ~/.cache/optbench silently."""
    from optbench import caches

    monkeypatch.setenv("OPTBENCH_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(caches, "_NOTED", set())
    caplog.set_level("INFO", logger="optbench.caches")
    cfg = NetCDFDataConfig(paths=[str(synth_file)])  # no data.stats_cache: the default cache
    build_climate_data(cfg)
    assert not [r for r in caplog.records if r.name == "optbench.caches"]
    build_climate_data(cfg)
    build_climate_data(cfg)
    said = [r.getMessage() for r in caplog.records if r.name == "optbench.caches"]
    assert len(said) == 1 and said[0].startswith("normalization statistics of ")
    assert f"cached in {tmp_path / 'cache' / 'netcdf-stats'}" in said[0] and "under a minute old" in said[0]
    assert "(measured again after: optbench cache clear netcdf-stats, or data.stats_cache=another directory)" in said[0]
    caches.main(["clear", "netcdf-stats"])
    assert capsys.readouterr().out.startswith(f"netcdf-stats: removed {tmp_path / 'cache' / 'netcdf-stats'}")
    calls = []
    monkeypatch.setattr(netcdf.stats, "compute_stats", lambda *a, **k: calls.append(1) or compute_stats(*a, **k))
    build_climate_data(cfg)
    assert calls == [1]  # computed again


# ------------------------------------------------------------------------------------ sharding
def _samples_of(batches) -> list[int]:
    return [int(i) for b in batches for i in b["sample"]]


def test_stream_batches_have_the_windows_of_their_samples(synth_file, tmp_path):
    data = build_climate_data(data_cfg([str(synth_file)], tmp_path, block_size=8))
    stream = data.train.shard(rank=0, world_size=1, seed=0, start=0, batch_size=4)
    batch = next(stream.batches(0, 1))
    assert batch["frames"].shape == (4, 3, 17, 16, 32)
    raw = ClimateSource(data.layout, regrid=False)
    for frames, sample in zip(batch["frames"], batch["sample"], strict=True):
        expected = raw.read(int(sample), int(sample) + 3)
        expected = (expected - data.stats.mean[:, None, None]) / data.stats.std[:, None, None]
        np.testing.assert_allclose(frames.numpy(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("world_size,num_workers", [(1, 1), (1, 3), (2, 2), (3, 2)])
def test_every_sample_once_per_epoch_across_ranks_and_workers(synth_file, tmp_path, world_size, num_workers):
    data = build_climate_data(data_cfg([str(synth_file)], tmp_path, block_size=8))
    n = data.train.split.num_samples  # 56
    seen: list[int] = []
    for epoch in range(2):
        per_epoch = []
        for rank in range(world_size):
            stream = data.train.shard(rank=rank, world_size=world_size, seed=3, start=0, batch_size=2)
            for worker in range(num_workers):
                runs = stream.worker_samples(worker, num_workers)
                share, count = [], stream.per_worker(num_workers)
                while len(share) < (epoch + 1) * count:
                    share += next(runs).tolist()
                per_epoch += share[epoch * count : (epoch + 1) * count]
        dropped = n - len(per_epoch)
        assert len(set(per_epoch)) == len(per_epoch), "a sample was seen twice in one epoch"
        assert 0 <= dropped < world_size * num_workers
        seen.append(per_epoch)
    if world_size * num_workers in (1, 4):  # 56 divides: nothing dropped
        assert sorted(seen[0]) == list(range(n))
    assert seen[0] != seen[1]  # a new order every epoch


@pytest.mark.parametrize("world_size,num_workers", [(1, 2), (2, 3), (3, 2)])
def test_a_block_a_share_boundary_cuts_is_split_in_time_and_each_side_reads_its_part(
        synth_file, tmp_path, monkeypatch, world_size, num_workers):
    """A block cut by a rank's or a worker's share boundary was read whole by both sides: now each
    side gets a contiguous time range of it (in shuffled order) and reads only that range; the
    windows stay the samples' own and a single process's order is the epoch order as before."""
    data = build_climate_data(data_cfg([str(synth_file)], tmp_path, block_size=8, read_ahead=0))  # reads in order
    reads: list[tuple[int, int, int]] = []
    real = type(data.train).read_block

    def recorded(self, block, lo=0, hi=None):
        out = real(self, block, lo, hi)
        reads.append((block, lo, lo + out.shape[0] - int(self.offsets[-1])))
        return out

    monkeypatch.setattr(type(data.train), "read_block", recorded)
    one = data.train.shard(rank=0, world_size=1, seed=4, start=0, batch_size=2)
    assert np.array_equal(one.share_order(0, 1), one.epoch_order(0))
    raw = ClimateSource(data.layout, regrid=False)
    shares, read_samples = [], 0
    for rank in range(world_size):
        stream = data.train.shard(rank=rank, world_size=world_size, seed=4, start=0, batch_size=2)
        count = stream.per_worker(num_workers)
        for worker in range(num_workers):
            reads.clear()
            share: list[int] = []
            for run, base, block in stream._blocks_of(stream.worker_samples(worker, num_workers)):
                if len(share) == count:  # this side's epoch is over
                    break
                run = run[: count - len(share)]
                share += run.tolist()
                for sample in run:  # the read holds the sample's own window where the gather takes it
                    first = data.train.split.first + int(sample)
                    expected = raw.read(first, first + 3)
                    expected = (expected - data.stats.mean[:, None, None]) / data.stats.std[:, None, None]
                    np.testing.assert_allclose(block[sample - base : sample - base + 3], expected, rtol=1e-5, atol=1e-5)
                used = len(reads)  # not the read of the next epoch's first run
            shares.append(share)
            read_samples += sum(hi - lo for _, lo, hi in reads[:used])
            for block_id in {i // 8 for i in share}:  # what this side has of a block is one time range
                mine = sorted(i for i in share if i // 8 == block_id)
                assert mine == list(range(mine[0], mine[-1] + 1))
    epoch = [i for share in shares for i in share]
    assert len(set(epoch)) == len(epoch) and len(epoch) > 8
    assert read_samples <= len(epoch) + world_size * num_workers  # no block read whole by two sides


def test_real_dataloader_workers_and_ranks_cover_the_epoch(synth_file, tmp_path):
    """Two ranks, two DataLoader worker processes each: one epoch of batches covers the 56 training
    samples exactly once; blocks are read by one worker each."""
    data = build_climate_data(data_cfg([str(synth_file)], tmp_path, block_size=8))
    assert data.train.split.num_samples == 56
    seen = []
    for rank in range(2):
        stream = data.train.shard(rank=rank, world_size=2, seed=0, start=0, batch_size=2)
        loader = DataLoader(stream, batch_size=None, num_workers=2)
        it = iter(loader)
        seen += _samples_of(next(it) for _ in range(28 // 2))
        del it
    assert sorted(seen) == list(range(56))


def test_resume_continues_exactly_where_it_stopped(synth_file, tmp_path, monkeypatch):
    data = build_climate_data(data_cfg([str(synth_file)], tmp_path, block_size=8))
    # the order is what is tested: blocks of one value per step instead of reading the file
    monkeypatch.setattr(type(data.train), "read_block", lambda self, block, *span: np.zeros((8 + 2, 1), np.float32))

    def consumed(start: int, count: int, num_workers: int) -> list[int]:
        """What a DataLoader with ``num_workers`` hands out: its workers' batches in turn."""
        stream = data.train.shard(rank=1, world_size=2, seed=5, start=start, batch_size=2)
        workers = [stream.batches(w, num_workers) for w in range(num_workers)]
        return _samples_of(next(workers[i % num_workers]) for i in range(count))

    for num_workers in (1, 3):
        full = consumed(0, 40, num_workers)  # several epochs of this rank's 28 samples
        for start_batches in (1, 7, 15, 22):
            resumed = consumed(2 * start_batches, 40 - start_batches, num_workers)
            assert resumed == full[2 * start_batches :], (num_workers, start_batches)


def test_shard_refuses_a_start_inside_a_batch(synth_file, tmp_path):
    data = build_climate_data(data_cfg([str(synth_file)], tmp_path))
    with pytest.raises(ValueError, match="whole number of batches"):
        data.train.shard(rank=0, world_size=1, seed=0, start=3, batch_size=2)


# ----------------------------------------------------------------------------------- bad input
def _write(ds: xr.Dataset, path: Path) -> str:
    ds.to_netcdf(path, engine="h5netcdf")
    return str(path)


def _bad_inputs(tmp_path: Path, synth_file: Path) -> dict[str, tuple[list[str], str]]:
    small = synthetic_dataset(days=4, nlat=8, nlon=16)
    all_nan = small.copy(deep=True)
    all_nan["humidity"][:] = np.nan
    extra_dim = small.copy()
    extra_dim["temperature"] = small["temperature"].expand_dims(member=2).transpose("time", "member", ...)
    no_lat = small.rename(lat="cell").drop_vars("cell")
    no_time = small.rename(time="ens").drop_vars("ens")
    (tmp_path / "not_a_store").mkdir()
    (tmp_path / "not_a_store" / "readme.txt").write_text("a directory, not a Zarr store")
    coarse = synthetic_dataset(days=4, nlat=8, nlon=16).isel(time=slice(0, 8))
    coarse = coarse.assign_coords(lat=coarse.lat + 1.0)
    late = small.isel(time=slice(8, None))
    (tmp_path / "garbage.nc").write_bytes(b"this is not a NetCDF file at all" * 10)
    blob = synth_file.read_bytes()
    (tmp_path / "truncated.nc").write_bytes(blob[: len(blob) // 3])
    return {
        "missing": ([str(tmp_path / "nope.nc")], "does not exist"),
        "not_a_store": ([str(tmp_path / "not_a_store")], "is a directory but not a Zarr store"),
        "no_time": ([_write(no_time, tmp_path / "notime.nc")], "its candidates (dimensions besides latitude/longitude) "
                    "are: ens (16), level (4); set data.time_dim=NAME"),
        "mixed_grids": ([_write(coarse, tmp_path / "grid_a.nc"), _write(late, tmp_path / "grid_b.nc")],
                        "on another lat grid"),
        "variables": ([_write(small.drop_vars(["humidity"]), tmp_path / "nohum.nc")],
                      "'humidity' is not in"),
        "extra_dim": ([_write(extra_dim, tmp_path / "member.nc")], "besides time/lat/lon (member, level)"),
        "no_lat": ([_write(no_lat, tmp_path / "nolat.nc")], "no latitude dimension"),
        "all_nan": ([_write(all_nan, tmp_path / "nan.nc")], "all NaN/_FillValue"),
        "garbage": ([str(tmp_path / "garbage.nc")], "not a NetCDF4/HDF5, NetCDF3 or Zarr dataset"),
        "truncated": ([str(tmp_path / "truncated.nc")], "corrupt or truncated"),
        "few_steps": ([_write(small.isel(time=slice(0, 2)), tmp_path / "short.nc")],
                      "needs at least 3 (history + the step to predict)"),
    }


def test_bad_inputs_fail_in_one_line_with_exit_2(synth_file, tmp_path):
    cases = _bad_inputs(tmp_path, synth_file)
    for name, (paths, expected) in cases.items():
        cfg = compose_cfg(["task=climate", "data=netcdf", f"data.paths=[{','.join(paths)}]",
                           f"data.stats_cache={tmp_path / 'stats'}", "train.steps=5", "train.device=cpu"])
        result = train(cfg, run_dir=tmp_path / f"run_{name}")
        assert result.status == "failed" and result.exit_code == 2, (name, result.error)
        assert expected in result.error and "\n" not in result.error, (name, result.error)
        summary = json.loads((tmp_path / f"run_{name}" / "summary.json").read_text())
        assert summary["status"] == "failed" and summary["steps"] == 0
    variables_error = train(compose_cfg(["task=climate", "data=netcdf", f"data.paths=[{cases['variables'][0][0]}]"]),
                            run_dir=tmp_path / "run_vars").error
    assert "temperature (temperature)" in variables_error and "u_wind (u_wind)" in variables_error  # what it has


def test_missing_paths_is_one_line(tmp_path):
    result = train(compose_cfg(["task=climate", "data=netcdf"]), run_dir=tmp_path)
    assert result.exit_code == 2 and result.error.startswith("data.paths is required")


def test_task_and_data_mismatch_is_one_line(tmp_path, synth_file):
    climate_synthetic = train(compose_cfg(["task=climate", "data=synthetic", "estimate.predict=false"]),
                              run_dir=tmp_path / "a")
    assert climate_synthetic.exit_code == 2 and "use data=netcdf data.paths=[FILE.nc]" in climate_synthetic.error
    lm_netcdf = train(compose_cfg(["task=lm", "data=netcdf", f"data.paths=[{synth_file}]", "estimate.predict=false"]),
                      run_dir=tmp_path / "b")
    assert lm_netcdf.exit_code == 2 and "task=lm reads token data" in lm_netcdf.error


def test_cli_bad_inputs_print_one_line(tmp_path, capsys):
    (tmp_path / "store.zarr").mkdir()
    result = run_cli_here("train", "task=climate", "data=netcdf", f"data.paths=[{tmp_path / 'store.zarr'}]",
                          f"hydra.run.dir={tmp_path / 'run'}", capsys=capsys)
    assert result.returncode == 2
    errors = [line for line in result.stderr.splitlines() if line.startswith("optbench: error:")]
    assert len(errors) == 1 and "not a Zarr store" in errors[0] and "Traceback" not in result.stderr
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["status"] == "failed"
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["data", "inspect", str(tmp_path / "missing.nc")])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("optbench: error:") and "does not exist" in err


def test_config_checks():
    with pytest.raises(ConfigError, match="data.paths"):
        NetCDFDataConfig(paths=[])
    with pytest.raises(ConfigError, match="data.roles.x=wind is unknown"):
        NetCDFDataConfig(paths="a.nc", roles={"x": "wind"})
    assert NetCDFDataConfig(paths="a.nc").paths == ["a.nc"]
    with pytest.raises(ConfigError, match="scale_factor_range"):
        compose_and_convert(["data.augment.scale_factor_range=[1.1,0.9]"])


def compose_and_convert(overrides: list[str]):
    from optbench.config import to_config

    return to_config(compose_cfg(["task=climate", "data=netcdf", "data.paths=x.nc", *overrides]))


def test_stream_order_does_not_depend_on_torch_rng(synth_file, tmp_path):
    data = build_climate_data(data_cfg([str(synth_file)], tmp_path))
    stream = data.train.shard(rank=0, world_size=1, seed=0, start=0, batch_size=4)
    torch.manual_seed(1)
    a = _samples_of([next(stream.batches(0, 1))])
    torch.manual_seed(2)
    assert _samples_of([next(stream.batches(0, 1))]) == a


def test_too_many_workers_for_the_samples_is_one_line(synth_file, tmp_path):
    cfg = compose_cfg(["task=climate", "data=netcdf", f"data.paths=[{synth_file}]", "train.device=cpu",
                       f"data.stats_cache={tmp_path / 'stats'}", "dataloader.num_workers=57"])
    result = train(cfg, run_dir=tmp_path)
    assert result.exit_code == 2 and "56 training samples cannot feed 1 rank(s) x 57" in result.error
