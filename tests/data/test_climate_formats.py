"""Climate data as it arrives: the same fields as NetCDF4, NetCDF3 (classic, scipy writer) and a
Zarr store read alike (and stream through a real DataLoader worker); time axes called month / t /
anything with integer or no coordinates; inspect's verdict agrees with training."""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import pytest
import xarray as xr
from torch.utils.data import DataLoader

from optbench.config import AugmentConfig, NetCDFDataConfig
from optbench.data import netcdf
from optbench.data.inspect import hydra_value, inspect_files
from optbench.data.netcdf import ClimateSource, build_climate_data, build_layout
from optbench.data.netcdf.synth import synthetic_dataset
from optbench.errors import ConfigError
from optbench.tasks.climate import describe_training_data

ORDER = ["temperature", "pressure", "humidity", "u_wind", "v_wind"]


@pytest.fixture(scope="module")
def formats(tmp_path_factory) -> dict[str, Path]:
    """One dataset (32 steps, 8x16) as NetCDF4 (chunks of 8 steps), NetCDF3 and Zarr (chunks of 8)."""
    root = tmp_path_factory.mktemp("formats")
    ds = synthetic_dataset(days=8, nlat=8, nlon=16)
    ds.to_netcdf(root / "f4.nc", engine="h5netcdf",
                 encoding={v: {"chunksizes": (8, *ds[v].shape[1:])} for v in ds.data_vars})
    ds.to_netcdf(root / "f3.nc", engine="scipy")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # zarr's note on consolidated metadata in format 3
        ds.to_zarr(root / "store.zarr", encoding={v: {"chunks": (8, *ds[v].shape[1:])} for v in ds.data_vars})
    return {"netcdf4": root / "f4.nc", "netcdf3": root / "f3.nc", "zarr": root / "store.zarr"}


def cfg_for(path, tmp_path: Path, **kw) -> NetCDFDataConfig:
    return NetCDFDataConfig(paths=[str(path)], stats_cache=str(tmp_path / "stats"), **kw)


def test_netcdf3_and_zarr_read_exactly_like_netcdf4(formats, tmp_path):
    blocks, chunks = {}, {}
    for name, path in formats.items():
        layout = build_layout(cfg_for(path, tmp_path))
        assert [c.role for c in layout.channels][:5] == ["temperature"] * 4 + ["pressure"]
        blocks[name] = ClimateSource(layout, regrid=False).read(3, 20)
        chunks[name] = layout.time_chunk
        ds = netcdf.open_dataset(path)
        assert ds.encoding["optbench_engine"] == {"netcdf4": "h5netcdf", "netcdf3": "scipy", "zarr": "zarr"}[name]
        ds.close()
    np.testing.assert_array_equal(blocks["netcdf3"], blocks["netcdf4"])
    np.testing.assert_array_equal(blocks["zarr"], blocks["netcdf4"])
    assert chunks == {"netcdf4": 8, "netcdf3": None, "zarr": 8}  # blocks align with Zarr chunks too
    with pytest.raises(ConfigError, match=r"'t2m' is not in .*store.zarr; its variables \(role\) are: .*pressure "
                                          r"\(pressure\)"):
        build_layout(cfg_for(formats["zarr"], tmp_path, variables=["t2m"]))


def test_zarr_store_caches_statistics_and_streams_through_a_worker(formats, tmp_path, monkeypatch):
    cfg = cfg_for(formats["zarr"], tmp_path)
    data = build_climate_data(cfg)
    reference = build_climate_data(cfg_for(formats["netcdf4"], tmp_path / "nc4"))
    np.testing.assert_allclose(data.stats.mean, reference.stats.mean, rtol=1e-12)

    def must_not_run(*args, **kwargs):
        raise AssertionError("statistics recomputed despite the cache")

    monkeypatch.setattr(netcdf.stats, "compute_stats", must_not_run)
    data = build_climate_data(cfg)  # from the cache
    monkeypatch.undo()
    stream = data.train.shard(rank=0, world_size=1, seed=3, start=0, batch_size=4)
    in_process = [b["sample"].tolist() for b, _ in zip(stream.batches(0, 1), range(3), strict=False)]
    loader = DataLoader(stream, batch_size=None, num_workers=1)  # a forked worker reopens the store
    batches = [b for b, _ in zip(loader, range(3), strict=False)]
    assert [b["sample"].tolist() for b in batches] == in_process
    assert batches[0]["frames"].shape == (4, 3, 17, 8, 16)


def _with_time(ds: xr.Dataset, name: str, coord: np.ndarray | None) -> xr.Dataset:
    out = ds.rename(time=name).drop_vars(name)
    return out.assign_coords({name: coord}) if coord is not None else out


def test_time_dims_not_called_time_with_integer_or_no_coordinates(tmp_path):
    ds = synthetic_dataset(days=3, nlat=8, nlon=16)  # 12 steps
    monthly = _with_time(ds, "month", np.arange(1, 13, dtype=np.int32))
    monthly.to_netcdf(tmp_path / "monthly.nc", engine="scipy")
    layout = build_layout(cfg_for(tmp_path / "monthly.nc", tmp_path))
    assert layout.time_dim == "month" and layout.times.tolist() == list(range(1, 13))
    _with_time(ds, "t", None).to_netcdf(tmp_path / "t.nc", engine="h5netcdf")
    assert build_layout(cfg_for(tmp_path / "t.nc", tmp_path)).num_steps == 12
    _with_time(ds, "sample_no", np.arange(12)).to_netcdf(tmp_path / "odd.nc", engine="h5netcdf")
    with pytest.raises(ConfigError, match=r"candidates .* are: sample_no \(12\), level \(4\); set data.time_dim"):
        build_layout(cfg_for(tmp_path / "odd.nc", tmp_path))
    data = build_climate_data(cfg_for(tmp_path / "odd.nc", tmp_path, time_dim="sample_no"))
    assert data.layout.time_dim == "sample_no" and data.train.split.num_samples > 0
    with pytest.raises(ConfigError, match="data.time_dim=step is not a dimension of"):
        build_layout(cfg_for(tmp_path / "odd.nc", tmp_path, time_dim="step"))
    with pytest.raises(ConfigError, match="has 12 time steps; data.history=12 needs at least 13"):
        build_climate_data(cfg_for(tmp_path / "monthly.nc", tmp_path, history=12, augment=AugmentConfig(enabled=False)))


def test_inspect_refuses_an_all_nan_variable_like_training(tmp_path):
    ds = synthetic_dataset(days=4, nlat=8, nlon=16)
    ds["humidity"][:] = np.nan
    ds.to_netcdf(tmp_path / "nan.nc", engine="h5netcdf")
    usable, report = inspect_files([str(tmp_path / "nan.nc")], check=describe_training_data)
    assert not usable and "all NaN/_FillValue" in report.splitlines()[-1]
    usable, report = inspect_files([str(tmp_path / "nan.nc")], check=describe_training_data, variables=["temperature", "pressure"])
    assert usable and "data.variables=[temperature,pressure]" in report


def test_inspect_describes_an_empty_time_axis_and_says_no_like_training(tmp_path):
    synthetic_dataset(days=4, nlat=8, nlon=16).isel(time=slice(0, 0)).to_netcdf(tmp_path / "none.nc", engine="h5netcdf")
    usable, report = inspect_files([str(tmp_path / "none.nc")], check=describe_training_data)
    assert "'time': 0 steps (empty)" in report
    assert not usable and "has 0 time steps" in report.splitlines()[-1]


def test_times_out_of_order_name_the_fix_for_one_file_and_for_overlapping_files(tmp_path):
    ds = synthetic_dataset(days=4, nlat=8, nlon=16)
    ds.isel(time=[0, 2, 1, *range(3, ds.sizes["time"])]).to_netcdf(tmp_path / "shuffled.nc", engine="h5netcdf")
    with pytest.raises(ConfigError, match=r"shuffled.nc itself is not in time order .*ds.sortby\('time'\)"):
        build_layout(cfg_for(tmp_path / "shuffled.nc", tmp_path))
    ds.isel(time=slice(0, 8)).to_netcdf(tmp_path / "a.nc", engine="h5netcdf")
    ds.isel(time=slice(6, 12)).to_netcdf(tmp_path / "b.nc", engine="h5netcdf")
    cfg = NetCDFDataConfig(paths=[str(tmp_path / "a.nc"), str(tmp_path / "b.nc")], stats_cache=str(tmp_path / "stats"))
    with pytest.raises(ConfigError, match="remove overlapping or duplicated files"):
        build_layout(cfg)


def test_hydra_values_are_quoted_only_where_hydra_needs_it():
    assert hydra_value("/data/era5/t2m_2020.nc") == "/data/era5/t2m_2020.nc"
    assert hydra_value("/data/my runs/ü,1.nc") == '"/data/my runs/ü,1.nc"'
    assert hydra_value('a"b\\c') == '"a\\"b\\\\c"'
