"""Config names: `--help` lists presets only, presets are named by what they are, and every old
override name still runs under its new one with one line saying so (sweeps included), or is refused
in one line; run directories and checkpoints written before the renames read as today's."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from optbench.checkpoint.resume import config_changes
from optbench.config import compose, conf_dir, to_config, upgrade_config, upgrade_overrides
from optbench.config.renames import config_is_current, upgrade_override
from optbench.errors import ConfigError
from optbench.estimate.api import count_model
from optbench.outputs import config_hash
from optbench.report.analysis import build_report
from optbench.report.format import render
from optbench.report.runs import load_run
from optbench.validate.setup import side_overrides, split_overrides
from tests.helpers import run_cli_here

OLD_RUNS = Path(__file__).resolve().parent.parent / "report" / "runs_before_renames"

# old override -> (the override it runs as, the one line that says so)
RENAMED = {
    "checkpointing=full": ("ac=full", "checkpointing= is now ac=; ran with ac=full"),
    "checkpointing.mode=selective": ("ac.name=selective", "checkpointing.mode= is now ac.name=; ran with ac.name=selective"),
    "checkpointing.every=3": ("ac.every=3", "checkpointing.every= is now ac.every=; ran with ac.every=3"),
    "~checkpointing": ("~ac", "checkpointing= is now ac=; ran with ~ac"),
    "compile=off": ("compile=none", "compile=off is now compile=none; ran with compile=none"),
    "compile.mode=off": ("compile.name=none",
                         "compile.mode= is now compile.name=; off is now none; ran with compile.name=none"),
    "compile.mode=max-autotune": ("compile.name=max-autotune",
                                  "compile.mode= is now compile.name=; ran with compile.name=max-autotune"),
    "attention.kernel=math": ("attention.name=math", "attention.kernel= is now attention.name=; ran with attention.name=math"),
    "parallel.mode=ddp": ("parallel.name=ddp", "parallel.mode= is now parallel.name=; ran with parallel.name=ddp"),
    "fusion.kind=add": ("fusion.name=add", "fusion.kind= is now fusion.name=; ran with fusion.name=add"),
    "profile=off": ("profile=none", "profile=off is now profile=none; ran with profile=none"),
    "profile.enabled=true": ("profile.name=trace",
                             "profile.enabled= is now profile.name=; true is now trace; ran with profile.name=trace"),
    "model=base": ("model=134m", "model=base is now model=134m; ran with model=134m"),
    "phase=2_checkpointing": ("phase=2_ac", "phase=2_checkpointing is now phase=2_ac; ran with phase=2_ac"),
    "ablation=2_checkpointing": ("ablation=2_ac", "ablation=2_checkpointing is now ablation=2_ac; ran with ablation=2_ac"),
    "train.save_every=5": ("checkpoint.every=5", "train.save_every= is now checkpoint.every=; ran with checkpoint.every=5"),
    "train.keep_last=3": ("checkpoint.keep_last=3",
                          "train.keep_last= is now checkpoint.keep_last=; ran with checkpoint.keep_last=3"),
    "train.resume=none": ("checkpoint.resume=none",
                          "train.resume= is now checkpoint.resume=; ran with checkpoint.resume=none"),
    "train.checkpoint_dir=ck": ("checkpoint.dir=ck", "train.checkpoint_dir= is now checkpoint.dir=; ran with checkpoint.dir=ck"),
    "train.log_every=2": ("log.every=2", "train.log_every= is now log.every=; ran with log.every=2"),
    "train.log_level=debug": ("log.level=debug", "train.log_level= is now log.level=; ran with log.level=debug"),
    "train.progress=log": ("log.progress=log", "train.progress= is now log.progress=; ran with log.progress=log"),
    "train.timing_warmup=1": ("measure.warmup_steps=1",
                              "train.timing_warmup= is now measure.warmup_steps=; ran with measure.warmup_steps=1"),
    "train.track_memory=false": ("measure.track_memory=false",
                                 "train.track_memory= is now measure.track_memory=; ran with measure.track_memory=false"),
    "train.stop_timeout_s=5": ("run.stop_timeout_s=5",
                               "train.stop_timeout_s= is now run.stop_timeout_s=; ran with run.stop_timeout_s=5"),
    "train.check_memory=false": ("run.check_memory=false",
                                 "train.check_memory= is now run.check_memory=; ran with run.check_memory=false"),
    "train.max_minutes=0.5": ("run.time_limit_s=30",
                              "train.max_minutes= (minutes) is now run.time_limit_s= (seconds); ran with run.time_limit_s=30"),
}
# a sweep over an old name runs as the same sweep over the new one
SWEEPS = {
    "checkpointing=none,full": "ac=none,full",
    "checkpointing=glob(*)": "ac=glob(*)",
    "model=tiny,base": "model=tiny,134m",
    "ablation=choice(0_baseline,2_checkpointing)": "ablation=choice(0_baseline,2_ac)",
    "train.max_minutes=1,2.5": "run.time_limit_s=60,150",
    "+train.max_minutes=null": "+run.time_limit_s=null",
}
# the same override, in what the old names meant: composed, both give the same config
SAME_CONFIG = {
    "profile.enabled=true": "profile=trace",
    "checkpointing.mode=selective": "ac=selective",
    "compile.mode=off": "compile=none",
}


@pytest.mark.parametrize("old", list(RENAMED))
def test_an_old_name_runs_as_the_new_one_saying_so_in_one_line(old):
    assert upgrade_override(old) == RENAMED[old]


@pytest.mark.parametrize("old", list(SWEEPS))
def test_a_sweep_over_an_old_name_is_the_same_sweep_over_the_new_one(old):
    new, said = upgrade_override(old)
    assert new == SWEEPS[old] and said is not None and said.endswith(f"; ran with {new}")


def test_names_that_did_not_change_are_left_alone():
    kept = ["model=1b", "model=base_model", "phase=glob(*)", "hydra.run.dir=x", "-m", "--cfg", "job",
            "train.steps=3", "stopping.mode=max", "data.paths=[a.nc,tiny.nc]", "train.lr=3e-3"]
    assert upgrade_overrides(kept) == (kept, [])


def _resolved(overrides: list[str]) -> dict:
    return OmegaConf.to_container(compose(overrides), resolve=False, throw_on_missing=False)


@pytest.mark.parametrize("batch", [
    [o for o in RENAMED if not o.startswith(("model=", "phase=", "ablation=", "compile=", "profile=", "~"))
     and o not in SAME_CONFIG],
    ["phase=2_checkpointing", "compile=off", "profile=off", *SAME_CONFIG],
    ["ablation=2_checkpointing"],
    ["model=base"],
])
def test_old_overrides_compose_to_the_config_of_the_new_ones(batch, capsys):
    expected = _resolved([SAME_CONFIG.get(o, RENAMED[o][0]) for o in batch])
    capsys.readouterr()
    assert _resolved(batch) == expected
    assert capsys.readouterr().err.splitlines() == [f"optbench: warning: {RENAMED[o][1]}" for o in batch]


def test_a_sweep_of_minutes_written_as_a_range_is_refused_in_one_line(tmp_path, capsys):
    with pytest.raises(ConfigError, match=r"run.time_limit_s= \(seconds\); write the sweep in seconds"):
        upgrade_override("train.max_minutes=range(1,3)")
    result = run_cli_here("train", "-m", "train.max_minutes=range(1,3)", f"hydra.sweep.dir={tmp_path}", capsys=capsys)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines() == [
        "optbench: error: train.max_minutes= (minutes) is now run.time_limit_s= (seconds); write the sweep in "
        "seconds, e.g. run.time_limit_s=600,1200"]


# ---------------------------------------------------------------------------------------- the CLI
def test_help_lists_every_group_s_presets_and_no_schema(capsys):
    result = run_cli_here("train", "--help", capsys=capsys)
    assert result.returncode == 0
    listing = result.stdout.split("config groups (group=option):")[1].split("\n\n")[0]
    groups = dict(re.findall(r"^  (\w+): (.+?)$(?=\n  \w|\Z)", listing.replace("\n    ", " "), flags=re.M | re.S))
    for group, options in groups.items():
        assert options.split(", ") == sorted(p.stem for p in (conf_dir() / group).glob("*.yaml")), group
    assert "ac" in groups and "checkpointing" not in groups
    assert "schema" not in listing and "base_" not in listing


def test_the_cli_runs_old_names_as_new_ones_saying_so(tmp_path, capsys):
    for command in ("train", "estimate"):
        result = run_cli_here(command, "checkpointing=full", "model=base", "--cfg", "job", capsys=capsys)
        assert result.returncode == 0, result.stderr
        config = OmegaConf.create(result.stdout)
        assert config.ac.name == "full" and config.model.name == "134m" and "checkpointing" not in config
        assert result.stderr.splitlines() == ["optbench: warning: checkpointing= is now ac=; ran with ac=full",
                                              "optbench: warning: model=base is now model=134m; ran with model=134m"]


def test_a_sweep_over_an_old_group_name_trains_each_option(tmp_path, capsys):
    result = run_cli_here("train", "-m", "checkpointing=none,full", "model=tiny", "train.device=cpu", "train.steps=3",
                          "train.batch_size=2", "train.seq_len=16", "measure.warmup_steps=1", "train.eval_batches=1",
                          "log.progress=log", "hydra.callbacks.report.enabled=false", "estimate.predict=false",
                          f"hydra.sweep.dir={tmp_path}",
                          capsys=capsys)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "optbench: warning: checkpointing= is now ac=; ran with ac=none,full" in result.stderr
    summaries = [json.loads(p.read_text()) for p in sorted(tmp_path.glob("*/summary.json"))]
    assert [s["config"]["ac"]["name"] for s in summaries] == ["none", "full"]
    assert [s["applied"]["activation_checkpointing"]["blocks"] for s in summaries] == [0, 4]
    assert sorted(p.parent.name.split(",")[0] for p in tmp_path.glob("*/summary.json")) == ["0_ac=none", "1_ac=full"]


def test_validate_reads_old_names_for_its_sides(capsys):
    phases = sorted(p.stem for p in (conf_dir() / "phase").glob("*.yaml"))
    assert side_overrides(["2_checkpointing"], what="candidate", phases=phases, default_phase="0_baseline") == [
        "phase=2_ac"]
    common, _, candidate = split_overrides(["compile=off", "candidate=phase=2_checkpointing"])
    assert common == ["compile=none"] and candidate == ["phase=2_checkpointing"]  # upgraded as a side, above
    assert "phase=2_checkpointing is now phase=2_ac" in capsys.readouterr().err


# --------------------------------------------------------------------- what was written before
def test_an_old_recorded_config_is_upgraded_key_by_key():
    old = {"checkpointing": {"mode": "selective", "every": 3}, "compile": {"mode": "off", "fullgraph": False},
           "attention": {"kernel": "math"}, "parallel": {"mode": "ddp"}, "fusion": {"name": "add", "kind": "add"},
           "profile": {"enabled": True, "wait": 1}, "model": {"name": "base", "dim": 768},
           "data": {"roles": {"t2m.mean": "temperature"}}, "nccl": {"env": {}},
           "train": {"steps": 9, "save_every": 3, "keep_last": 0, "resume": "none", "checkpoint_dir": None,
                     "log_every": 2, "log_level": "info", "progress": "log", "timing_warmup": 1,
                     "track_memory": False, "max_minutes": 0.5, "stop_timeout_s": 5.0, "check_memory": False}}
    assert upgrade_config(old) == {
        "ac": {"name": "selective", "every": 3}, "compile": {"name": "none", "fullgraph": False},
        "attention": {"name": "math"}, "parallel": {"name": "ddp", "start_method": "forkserver"},  # added since
        "fusion": {"name": "add", "encoder_checkpoint": None, "freeze_encoder": False,  # added since: as before
                   "base_dtype": "fp32"},
        "profile": {"name": "trace", "wait": 1}, "model": {"name": "134m", "dim": 768},
        "data": {"roles": {"t2m.mean": "temperature"}}, "nccl": {"env": {}}, "train": {"steps": 9},
        "checkpoint": {"every": 3, "keep_last": 0, "resume": "none", "dir": None},
        "log": {"every": 2, "level": "info", "progress": "log", "trackers": ["tensorboard"],  # added since: as before
                "mlflow": {"tracking_uri": None, "experiment": "optbench"},
                "wandb": {"project": "optbench", "entity": None, "mode": "auto", "dir": None}},
        "measure": {"warmup_steps": 1, "track_memory": False, "peak_tflops": None},
        "run": {"time_limit_s": 30.0, "stop_timeout_s": 5.0, "check_memory": False, "overwrite": False}}
    assert upgrade_config(None) is None and upgrade_config({"profile": {"enabled": False}}) == {"profile": {"name": "none"}}


def test_a_config_recorded_before_the_renames_reads_as_today_s():
    """Summaries written by optbench before the renames (a real `-m checkpointing=none,full` sweep):
    their resolved config, read under the new names, is what the new names compose; the report reads
    them so (the same config hash: today's runs of that config pool with them as repeats)."""
    for run_dir in sorted(OLD_RUNS.iterdir()):
        summary = json.loads((run_dir / "summary.json").read_text())
        overrides, _ = upgrade_overrides(summary["overrides"])
        today = OmegaConf.to_container(compose(overrides), resolve=True)
        assert upgrade_config(summary["config"]) == today
        assert config_changes(summary["config"], today) == []  # resuming its checkpoint: nothing changed
        assert upgrade_config(today) == today
        assert summary["config"]["train"]["max_minutes"] == 30.0 and today["run"]["time_limit_s"] == 1800
        read = load_run(run_dir)
        assert read.summary.config == today and read.summary.config_hash == config_hash(today)
        assert read.overrides == overrides and read.summary.model.name == "tiny"


def test_the_quick_look_says_current_only_of_configs_the_upgrade_leaves_equal():
    """config_is_current (what the report asks of each of thousands of configs instead of rebuilding
    it) never says "current" of one that upgrade_config changes: each rename, each missing added key,
    a key that is not a string, one at a time, on today's config and on a config before the renames."""
    today = OmegaConf.to_container(compose(["model=tiny"]), resolve=True)
    old = json.loads((OLD_RUNS / "0_checkpointing=none" / "summary.json").read_text())["config"]
    assert config_is_current(today) and upgrade_config(today) == today
    assert not config_is_current(old) and upgrade_config(old) != old
    changed = [{"checkpointing": {"name": "none"}}, {"train": {"steps": 3, "save_every": 2}},
               {"model": {"name": "base"}}, {"compile": "off"}, {"profile": {"enabled": True}},
               {"fusion": {"name": "add"}}, {"log": {"every": 1}}, {"model": {"dim": {1: 2}}}, {3: "x"}]
    for change in changed:
        config = {**today, **change}
        assert upgrade_config(config) != config and not config_is_current(config), change
    for config in ({}, {"model": {"name": "134m"}}, {"data": {"roles": {"t2m.mean": "temperature"}}}, None):
        assert config_is_current(config) and upgrade_config(config) == config, config


def test_the_report_reads_runs_written_before_the_renames(capsys):
    def groups(baseline: str) -> list[dict]:
        return json.loads(render(build_report([OLD_RUNS], baseline=[baseline]), "json"))["groups"]

    old = groups("checkpointing=full")
    assert len(old) == 1 and old[0]["model"] == "tiny"
    labels = {v["label"]: v for v in old[0]["variants"]}
    assert sorted(labels) == ["ac=full", "ac=none"] and labels["ac=full"]["baseline"]
    assert labels["ac=none"]["overrides"][0] == "ac=none"
    assert "checkpointing= is now ac=" in capsys.readouterr().err
    assert {v["label"]: v["baseline"] for v in groups("ac=none")[0]["variants"]} == {"ac=none": True, "ac=full": False}


# ------------------------------------------------------------------------------------ presets
def _size(name: str) -> tuple[float, int]:
    """"134m" -> (134e6, 0 decimals); "9.9b" -> (9.9e9, 1 decimal)."""
    match = re.fullmatch(r"(\d+)(?:\.(\d+))?([mb])", name)
    assert match, f"model preset {name} is not named by its size (like 134m or 9.9b)"
    number = float(f"{match[1]}.{match[2] or 0}")
    return number * {"m": 1e6, "b": 1e9}[match[3]], len(match[2] or "")


# the CPU-sized presets keep the words people type (`model=tiny` in every quick start); their
# sizes stay in the class the word names
SIZE_WORDS = {"tiny": (5e5, 2e6), "small": (5e6, 2e7)}


# hf_* presets carry the published model's name (hf_llama3_8b); model=hf / model=module need a directory
# or a factory of the user's
OWN_PRESETS = sorted(p.stem for p in (conf_dir() / "model").glob("*.yaml")
                     if not p.stem.startswith(("hf", "energy_")) and p.stem != "module")  # energy_*: plan 003's


@pytest.mark.parametrize("preset", OWN_PRESETS)
def test_every_model_preset_is_named_by_its_parameter_count(preset):
    cfg = to_config(compose([f"model={preset}", "train.seq_len=64"]))
    assert cfg.model.name == preset
    params = count_model(cfg).params
    if preset in SIZE_WORDS:
        low, high = SIZE_WORDS[preset]
        assert low <= params < high, f"{preset} holds {params:,} parameters"
        return
    size, decimals = _size(preset)
    unit = 1e9 if preset.endswith("b") else 1e6
    assert round(params / unit, decimals) == size / unit, f"{preset} holds {params:,} parameters"
