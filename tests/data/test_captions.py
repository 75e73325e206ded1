"""optbench data captions: facts computed exactly from the field (checked against xarray's own
decoding of a real-like ERA5 file the test writes: NetCDF3, packed int16, latitude descending, one
variable), regions that fit the grid, anomalies against the training steps only, describe and
forecast modes, the facts parsed back out of text."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
import xarray as xr

from optbench.cli import main
from optbench.data.captions import open_describer, read_spec, write_captions
from optbench.data.facts import anomaly_fact, trend_fact

ROOT = Path(__file__).resolve().parents[2]


def _era5_like():
    spec = importlib.util.spec_from_file_location("era5_like", ROOT / "bench" / "era5_like.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def uk(tmp_path_factory):
    """Six days of 6-hourly t2m over the UK box on a 1-degree grid, as ERA5's CDS files are laid out."""
    path = tmp_path_factory.mktemp("uk") / "uk.nc"
    _era5_like().write_era5_like(path, days=6, step_hours=6, resolution=1.0)
    return path


def _weighted_mean(field: np.ndarray, lat: np.ndarray, mask: np.ndarray | None = None) -> float:
    weight = np.cos(np.deg2rad(lat))[:, None] * np.ones(field.shape[1])
    weight = weight * (mask if mask is not None else 1.0)
    return float((field * weight).sum() / weight.sum())


def test_captions_of_a_regional_file_state_the_field_exactly(uk, tmp_path, capsys):
    out = tmp_path / "uk.jsonl"
    main(["data", "captions", str(uk), str(out), "--eval-fraction", "0.25", "--lines", str(tmp_path / "uk.txt")])
    assert "of t2m (describe" in capsys.readouterr().out  # the file's only variable, no --variables needed
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    spec = read_spec(out)
    assert len(rows) == 24 and spec.mode == "describe" and spec.variables == ["t2m"] and spec.train_steps == 18
    assert (tmp_path / "uk.txt").read_text().splitlines() == [r["text"] for r in rows[:18]]  # training texts only
    ds = xr.open_dataset(uk)  # xarray's own decoding: the packing and the descending latitudes undone by it
    t = 9
    field = ds["t2m"].isel(time=t).values - 273.15
    lat, lon = ds["latitude"].values.astype(float), ds["longitude"].values.astype(float)
    text = rows[t]["text"]
    assert text.startswith("Area 49-61N 11W-2E. Mean ")
    for absent in ("lobal", "north of", "tropics", "south of", "hemisphere", "pressure", "wind", "humidity"):
        assert absent not in text  # nothing the grid or the file does not hold
    clim = np.stack([ds["t2m"].values[h:18:4].mean(0) for h in range(4)]) - 273.15  # training steps, by hour
    previous = ds["t2m"].isel(time=t - 1).values - 273.15
    north, west = lat[:, None] >= np.median(lat), lon[None, :] < np.median(lon)
    expected = {
        "Mean": _weighted_mean(field, lat),
        "Northwest": _weighted_mean(field, lat, north & west), "southeast": _weighted_mean(field, lat, ~north & ~west),
    }
    for label, value in expected.items():
        assert f"{label} {round(value, 1) + 0:.1f} C" in text, (label, value, text)
    assert anomaly_fact(_weighted_mean(field - clim[t % 4], lat)).text in text
    assert trend_fact(_weighted_mean(field, lat) - _weighted_mean(previous, lat), span=" in 6 h").text in text
    i, j = 13 // 4, 14 // 4  # the first named grid point, at a quarter of the grid (south-west first)
    point = ds["t2m"].values[t, ::-1][i, j] - 273.15
    assert f"At {lat[::-1][i]:.0f}N {abs(lon[j]):.0f}W {round(float(point), 1) + 0:.1f} C" in text


def test_facts_parse_back_out_of_text_and_forecast_mode_captions_the_target(uk, tmp_path):
    write_captions([str(uk)], tmp_path / "f.jsonl", history=3, mode="forecast", eval_fraction=0.25)
    spec = read_spec(tmp_path / "f.jsonl")
    assert spec.mode == "forecast" and spec.text_offset() == 3
    layout, source, describer = open_describer([str(uk)], spec=spec)
    try:
        block = source.read(0, layout.num_steps)
    finally:
        source.close()
    rows = [json.loads(line)["text"] for line in (tmp_path / "f.jsonl").read_text().splitlines()]
    t = 10
    facts = describer.facts(block, t, step=t)
    assert rows[t] == describer.caption(block, t, step=t)
    assert {f.parse(rows[t]) for f in facts.values()} == {f.value for f in facts.values()}  # every number
    mean = facts["mean"].value
    previous = describer.facts(block, t - 1, step=t - 1)["mean"].value  # forecast: from the last input step
    assert facts["trend"].value == pytest.approx(mean - previous, abs=0.11)
    assert trend_fact(-1.5, span="").parse("colder, cooling 1.5 K in 6 h") == -1.5
    assert anomaly_fact(0.0).parse("it was near normal") == 0.0 and facts["mean"].parse("no numbers") is None
    describe = open_describer([str(uk)], spec=spec.__class__(**{**spec.__dict__, "mode": "describe"}))
    describe[1].close()
    assert describe[2].trend_start(t) == t - 2 and describer.trend_start(t) == t - 1  # the history window


def test_a_global_grid_names_bands_and_quadrants(tmp_path):
    from optbench.data.netcdf.synth import write_synthetic

    write_synthetic(tmp_path / "g.nc", days=2, step_hours=6, nlat=8, nlon=16, levels=(1000.0,))
    write_captions([str(tmp_path / "g.nc")], tmp_path / "g.jsonl", eval_fraction=0.25)
    text = json.loads((tmp_path / "g.jsonl").read_text().splitlines()[3])["text"]
    for phrase in ("Global mean ", "North of 30N ", "tropics ", "south of 30S ", "northwest ", "southeast ",
                   "Pressure ", " hPa, wind ", " m/s", "humidity ", " g/kg."):
        assert phrase in text, (phrase, text)
    assert not text.startswith("Area")


def test_captions_of_a_file_with_nothing_to_describe_is_one_line_and_exit_2(tmp_path, capsys):
    ds = xr.Dataset({"foo": (("time", "lat", "lon"), np.zeros((3, 2, 2), np.float32))},
                    coords={"time": np.arange(3), "lat": [0.0, 1.0], "lon": [0.0, 1.0]})
    ds["lat"].attrs["units"], ds["lon"].attrs["units"] = "degrees_north", "degrees_east"
    ds.to_netcdf(tmp_path / "x.nc", engine="h5netcdf")
    with pytest.raises(SystemExit) as info:
        main(["data", "captions", str(tmp_path / "x.nc"), str(tmp_path / "x.jsonl")])
    err = capsys.readouterr().err
    assert info.value.code == 2 and "has no variable captions can describe" in err and err.count("\n") == 1


@pytest.fixture(scope="module")
def synth(tmp_path_factory):
    from optbench.data.netcdf.synth import write_synthetic

    path = tmp_path_factory.mktemp("synth") / "s.nc"
    write_synthetic(path, days=3, step_hours=6, nlat=8, nlon=16, levels=(1000.0,))
    return path


@pytest.mark.parametrize("variable, change, expected", [
    ("temperature", "nan", "temperature@1000 (temperature) at 2000-01-02T06:00:00 has no finite value"),
    ("temperature", "all inf", "temperature@1000 (temperature) at 2000-01-02T06:00:00 has no finite value"),
    ("pressure", "all -inf", "pressure (pressure) at 2000-01-02T06:00:00 has no finite value"),
    ("temperature", "1e30", "temperature@1000 (temperature) at 2000-01-02T06:00:00 holds 1e+30 K, outside 150 to 350 K"),
    ("temperature", "20", "temperature@1000 (temperature) at 2000-01-02T06:00:00 holds 20 K, outside 150 to 350 K"),
    ("pressure", "-5", "pressure (pressure) at 2000-01-02T06:00:00 holds -0.05 hPa, outside 1 to 1100 hPa"),
    ("humidity", "1e30", "humidity@1000 (humidity) at 2000-01-02T06:00:00 holds 1e+33 g/kg, outside -1 to 100 g/kg"),
    ("u_wind", "-1e30", "u_wind@1000 (u_wind) at 2000-01-02T06:00:00 holds -1e+30 m/s, outside -200 to 200 m/s"),
])
def test_captions_refuse_non_finite_and_impossible_values(synth, tmp_path, capsys, variable, change, expected):
    """All-NaN or infinite steps and undeclared fill values were captioned ("Global mean 0.0 C",
    "cooling 11.8 K", "Global mean 1000000015047466360614177210368.0 C"): one line, nothing written."""
    with xr.open_dataset(synth, engine="h5netcdf") as ds:
        ds = ds.load()
    values = ds[variable].values
    if change in ("nan", "all inf", "all -inf"):
        values[5] = float(change.removeprefix("all "))
    else:
        values[5, ..., 2, 3] = float(change)  # one grid point of step 5
    ds[variable].values = values
    ds.to_netcdf(tmp_path / "bad.nc", engine="h5netcdf")
    with pytest.raises(SystemExit) as info:
        main(["data", "captions", str(tmp_path / "bad.nc"), str(tmp_path / "c.jsonl"), "--lines", str(tmp_path / "c.txt")])
    err = capsys.readouterr().err
    assert info.value.code == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    assert f"optbench: error: {tmp_path / 'bad.nc'}: {expected}" in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.nc"]


def test_captions_of_a_plausible_file_with_missing_points_are_written(synth, tmp_path):
    with xr.open_dataset(synth, engine="h5netcdf") as ds:
        ds = ds.load()
    values = ds["temperature"].values
    values[5, ..., :2, :] = np.nan  # a few missing points: left out of the means, as before
    values[6, ..., 0, 0] = np.inf  # the reader makes ±inf missing too
    ds["temperature"].values = values
    ds.to_netcdf(tmp_path / "gaps.nc", engine="h5netcdf")
    meta = write_captions([str(tmp_path / "gaps.nc")], tmp_path / "c.jsonl")
    assert meta["captions"] == 12


def test_lines_and_the_captions_in_one_file_is_refused_saying_so(synth, tmp_path, capsys):
    for lines in ("o.jsonl", "./o.jsonl"):
        with pytest.raises(SystemExit) as info:
            main(["data", "captions", str(synth), str(tmp_path / "o.jsonl"), "--lines", str(tmp_path / lines)])
        err = capsys.readouterr().err
        assert info.value.code == 2 and err.count("\n") == 1, err
        assert f"--lines {tmp_path / lines} is the captions' own output file {tmp_path / 'o.jsonl'}" in err, err
        assert "give --lines a file of its own (e.g. captions.txt)" in err and "is also an input" not in err
    assert list(tmp_path.iterdir()) == []
