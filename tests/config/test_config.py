"""Every preset composes and converts; exact parameter counts; bad values are refused clearly."""

from __future__ import annotations

import pytest
import torch

from optbench.config import Config, conf_dir, to_config
from optbench.errors import ConfigError
from optbench.model.counts import count_params
from optbench.tasks import build_task
from optbench.training.build import build_model
from tests.helpers import compose_cfg, run_cli, run_cli_here


def presets(group: str) -> list[str]:
    return sorted(p.stem for p in (conf_dir() / group).glob("*.yaml"))


@pytest.mark.parametrize(
    "group",
    ["model", "precision", "task", "data", "optimizer", "dataloader", "loss_freq", "compile",
     "ac", "attention", "parallel", "nccl", "fusion", "stopping", "profile"],
)
def test_every_preset_composes_and_converts(group):
    names = presets(group)
    assert names, f"no presets in conf/{group}"
    for name in names:
        extra = {("data", "tokens"): ["data.path=unused.bin"], ("data", "netcdf"): ["data.paths=unused.nc"],
                 ("data", "embeddings"): ["data.path=unused.emb"],
                 ("model", "hf"): ["model.hf.model_type=llama"],
                 ("model", "module"): ["+model.module._target_=tests.model.custom_lm.build"]}.get(
            (group, name), [])
        cfg = to_config(compose_cfg([f"{group}={name}", *extra]))
        assert isinstance(cfg, Config)
        assert getattr(cfg, group).name == name


@pytest.mark.parametrize(
    ("preset", "expected"),
    [("9.9b", 9_926_217_728), ("13.1b", 13_059_688_400)],
)
def test_exact_parameter_counts_on_meta_device(preset, expected):
    cfg = to_config(compose_cfg([f"model={preset}", "train.seq_len=2048"]))
    model = build_model(cfg, build_task(cfg))
    assert all(p.device.type == "meta" for p in model.parameters())
    assert count_params(model) == expected


def test_plan_13b_shape_is_refused_naming_both_numbers():
    with pytest.raises(ConfigError) as err:
        to_config(compose_cfg(["model=13.1b", "model.dim=4400", "model.heads=64"]))
    assert "4400" in str(err.value) and "64" in str(err.value)


def test_plan_13b_shape_is_refused_by_the_cli_in_one_line(tmp_path, capsys):
    result = run_cli_here("train", "model.dim=4400", "model.heads=64", f"hydra.run.dir={tmp_path}", capsys=capsys)
    assert result.returncode == 2
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert lines[-1].startswith("optbench: error:")
    assert "model.dim=4400" in lines[-1] and "model.heads=64" in lines[-1]
    assert "Traceback" not in result.stderr + result.stdout


@pytest.mark.parametrize(
    ("override", "needle"),
    [
        ("train.steps=0", "train.steps must be positive"),
        ("train.batch_size=-1", "train.batch_size must be positive"),
        ("train.grad_accum=0", "train.grad_accum must be positive"),
        ("train.lr=0", "train.lr must be positive"),
        ("train.clip_grad=-1", "train.clip_grad=null"),
        ("train.schedule=linear", "train.schedule=linear is unknown"),
        ("train.steps=3", "leaves no timed step"),
        ("train.device=tpu", "train.device=tpu is unknown"),
        ("model.heads=3", "model.heads=3"),
        ("optimizer.betas=[0.9,1.5]", "optimizer.betas"),
        ("data.noise=2", "data.noise"),
        ("train.lr=inf", "train.lr must be positive, got inf"),
        ("train.lr=nan", "train.lr must be positive, got nan"),
        ("train.clip_grad=inf", "train.clip_grad=null"),
        ("measure.warmup_steps=30", "train.steps=30 leaves no timed step after measure.warmup_steps=30"),
        ("measure.warmup_steps=-1", "measure.warmup_steps must be >= 0"),
        ("checkpoint.every=-1", "checkpoint.every must be >= 0"),
        ("checkpoint.keep_last=-2", "checkpoint.keep_last must be >= 0"),
        ("checkpoint.resume=''", "checkpoint.resume is empty"),
        ("log.every=0", "log.every must be positive"),
        ("log.level=loud", "log.level=loud is unknown"),
        ("log.progress=tqdm", "log.progress=tqdm is unknown"),
        ("run.time_limit_s=0", "run.time_limit_s must be a positive number of seconds"),
        ("run.time_limit_s=inf", "run.time_limit_s=null for no time limit"),
        ("run.stop_timeout_s=nan", "run.stop_timeout_s must be positive"),
        ("run.stop_timeout_s=inf", "run.stop_timeout_s must be positive, got inf"),
        ("stopping.spike_factor=inf", "stopping.spike_factor must be > 1"),
        ("model.norm_eps=nan", "model.norm_eps must be a finite number, got nan"),
        ("model.rope_theta=inf", "model.rope_theta must be a finite number, got inf"),
        ("model.init_std=-inf", "model.init_std must be a finite number"),
        ("ac.name=half", "ac=half is unknown; use one of none, selective, full"),
        ("compile.name=eager", "compile=eager is unknown; use one of none, default"),
        ("profile.name=all", "profile=all is unknown; use one of none, trace"),
        ("fusion.name=concat", "fusion=concat is unknown"),
        ("parallel.start_method=fork", "parallel.start_method=fork is unknown; use one of forkserver, spawn"),
        ("estimate.mfu=nan", "estimate.mfu must be in (0, 1]"),
    ],
)
def test_bad_values_are_config_errors(override, needle):
    with pytest.raises(ConfigError) as err:
        to_config(compose_cfg([override]))
    assert needle in str(err.value)


def test_bad_value_exits_2_with_one_line_and_no_completed_run(tmp_path, capsys):
    result = run_cli_here("train", "train.steps=0", f"hydra.run.dir={tmp_path}", capsys=capsys)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1] == "optbench: error: train.steps must be positive, got 0"
    import json

    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["steps"] == 0
    assert not (tmp_path / "metrics.jsonl").exists()


def test_full_error_shows_the_traceback(tmp_path):
    result = run_cli("train", "train.steps=0", f"hydra.run.dir={tmp_path}", env={"HYDRA_FULL_ERROR": "1"})
    assert result.returncode == 2
    assert "Traceback" in result.stderr


@pytest.mark.parametrize(("override", "line"), [
    ("train.stepz=5", "Could not override 'train.stepz': Key 'stepz' not in 'TrainConfig' (its keys are "),
    ("optimizer.lr=0.5", "Could not override 'optimizer.lr': Key 'lr' not in 'OptimizerConfig' (its keys are "),
    ("model=huge", "In 'train': Could not find 'model/huge'; available options in 'model': 13.1b, 134m, 1b"),
    ("train.steps=many", "Error merging override train.steps=many: Value 'many' of type 'str' could not be "
                         "converted to Integer"),
    ("train.steps=[1", "no viable alternative at input '[1'; see https://hydra.cc/docs/"),
])
def test_hydra_errors_are_one_line_and_exit_2(tmp_path, capsys, override, line):
    """Hydra printed these as blocks (full_key, reference_type, the config search path, a hint to
    set HYDRA_FULL_ERROR): one line, the fix in it, nothing created."""
    result = run_cli_here("train", override, f"hydra.run.dir={tmp_path / 'run'}", capsys=capsys)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert result.stderr.startswith(f"optbench: error: {line}"), result.stderr
    assert not (tmp_path / "run").exists()


def test_hydra_flags_keep_working(capsys):
    result = run_cli_here("train", "--cfg", "job", "model=small", capsys=capsys)
    assert result.returncode == 0, result.stderr
    assert "dim: 256" in result.stdout and "steps:" in result.stdout


def test_tf32_on_cpu_is_incompatible_not_mislabelled(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("CUDA present: tf32 is valid here")
    from optbench.run.train import train

    result = train(compose_cfg(["precision=tf32", "model=tiny"]), run_dir=tmp_path)
    assert result.status == "incompatible"
    assert "precision=fp32" in result.error
    assert result.exit_code == 2


def test_a_composed_config_is_the_callers_own_and_old_names_still_warn_every_time(capsys):
    """compose keeps what Hydra composed for the process: a second compose of the same overrides is
    equal to the first, a key the first caller set is not in it, and an old name warns again."""
    from optbench.config import compose

    first = compose(["model=tiny", "train.steps=3"])
    first.train.steps = 99
    second = compose(["model=tiny", "train.steps=3"])
    assert second.train.steps == 3 and second.model.name == "tiny"
    capsys.readouterr()
    for _ in range(2):
        assert compose(["checkpointing=full"]).ac.name == "full"
    assert capsys.readouterr().err.count("checkpointing= is now ac=") == 2


@pytest.mark.parametrize("overrides", [
    ["model=tiny", "train.steps=3"],
    ["phase=2_ac", "train.batch_size=4", "model=small"],  # a preset's value, then the line's
    ["model=hf", "model.hf.config=/x/y", "train.seq_len=16", "+model.hf.config_overrides.hidden_size=32"],
    ["model=module", "+model.module._target_=tests.model.custom_lm.build", "model.dim=32"],
    ["task=climate", "data=netcdf", "data.paths=[a.nc,b.nc]", "data.levels=null"],
    ["train.steps=3", "precision=bf16", "parallel=fsdp2", "parallel.nproc_per_node=2", "estimate.gpu=h100"],
    ["task=climate_text", "fusion=gated", "fusion.freeze_base=true", "train.clip_grad=null"],
    # the overrides of keys in the order given, whatever their kind (found in review: ++ came first)
    ["model.dim=3", "++model.dim=4"],
    ["+model.extra=1", "model.extra=2", "model=small"],
    ["++train.steps=9", "train.steps=7", "model=small"],
])
def test_compose_is_hydras_compose_first_and_from_its_cache(overrides):
    """optbench.config.compose keeps what Hydra composed for each override list in the process: the
    result is Hydra's own, to the YAML and the struct flag, the first time and from the cache."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from omegaconf import OmegaConf

    from optbench.config import compose

    with initialize_config_dir(version_base="1.3", config_dir=str(conf_dir())):
        reference = hydra_compose(config_name="train", overrides=overrides)
    for _ in range(2):  # composed, then from the cache
        ours = compose(overrides)
        assert OmegaConf.to_yaml(ours) == OmegaConf.to_yaml(reference)
        assert OmegaConf.is_struct(ours) and OmegaConf.is_struct(reference)


@pytest.mark.parametrize("overrides", [
    ["model=tiny", "train.steps=abc"],  # a value of the wrong type
    ["model=tiny", "train.no_such_key=1"],
    ["train.steps=1,2"],  # a sweep outside -m
    ["train.steps=[1"],  # a syntax error
    ["model=no_such_preset", "train.steps=abc"],  # the preset's error comes first, as in one compose
    ["model=tiny", "~train.steps"],
    ["model.extra=2", "+model.extra=1"],  # a key set before it is added: Hydra refuses it
    ["model=small", "~model.rope_theta"],
])
def test_a_bad_override_fails_with_hydras_own_error(overrides):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from optbench.config import compose

    errors = []
    for attempt in ("hydra", "ours"):
        with pytest.raises(Exception) as raised:  # noqa: PT011 -- the type is compared below
            if attempt == "hydra":
                with initialize_config_dir(version_base="1.3", config_dir=str(conf_dir())):
                    hydra_compose(config_name="train", overrides=overrides)
            else:
                compose(overrides)
        errors.append((type(raised.value), str(raised.value)))
    assert errors[0] == errors[1]


def test_value_overrides_reuse_the_presets_merged_once(monkeypatch):
    """Two override lists that choose the same presets merge them once (Hydra's first phase); each
    gets its own values applied."""
    import optbench.config as config
    from optbench.config import hydra_loader

    calls = []
    original = hydra_loader.first_phase
    monkeypatch.setattr(hydra_loader, "first_phase", lambda d, n, o: calls.append(o) or original(d, n, o))
    monkeypatch.setattr(config, "_COMPOSED", {})
    first = config.compose(["model=small", "train.steps=3", "train.seq_len=16"])
    second = config.compose(["model=small", "train.steps=5"])
    assert calls == [["model=small"]]
    assert (first.train.steps, first.train.seq_len, second.train.steps) == (3, 16, 5)
    assert second.train.seq_len == config.compose(["model=small"]).train.seq_len != 16


def test_the_first_phase_parses_each_file_once_and_shares_no_node_between_compositions(tmp_path, monkeypatch):
    """optbench.config.hydra_loader: one loader per config directory for the process. A second
    composition parses no file again, a composed config changed in place changes no later one, and
    each result is hydra.compose's own, to the YAML and the struct flag."""
    import shutil

    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra._internal.config_repository import ConfigRepository
    from omegaconf import OmegaConf

    from optbench.config.hydra_loader import first_phase

    directory = str(shutil.copytree(conf_dir(), tmp_path / "conf"))  # a directory no loader has read yet
    parsed = []
    original = ConfigRepository.load_config
    monkeypatch.setattr(ConfigRepository, "load_config", lambda self, config_path: parsed.append(config_path) or original(
        self, config_path))
    a, b = ["model=small", "precision=bf16", "ac=full"], ["phase=2_ac", "model=small"]
    first = first_phase(directory, "train", a)
    assert "model/small" in parsed and "precision/bf16" in parsed
    first.model.dim, first.precision.autocast, first.ac.name = 1, "float16", "changed"  # in place
    parsed.clear()
    ours = [first_phase(directory, "train", b), first_phase(directory, "train", a)]
    assert "model/small" not in parsed and "precision/bf16" not in parsed and "phase/2_ac" in parsed
    monkeypatch.undo()
    with initialize_config_dir(version_base="1.3", config_dir=directory):
        reference = [hydra_compose(config_name="train", overrides=overrides) for overrides in (b, a)]
    for mine, theirs in zip(ours, reference, strict=True):
        assert OmegaConf.to_yaml(mine) == OmegaConf.to_yaml(theirs)
        assert OmegaConf.is_struct(mine) and OmegaConf.is_struct(theirs)
        assert OmegaConf.get_type(mine.model) is OmegaConf.get_type(theirs.model)
    assert ours[1].model.dim == 256 and ours[1].ac.name == "full"


def test_inside_composing_once_per_file_hydra_lists_the_groups_and_options_it_lists_outside():
    """What Hydra's help and its missing-choice errors list: a group's configs, its subgroups, both
    (``results_filter`` None), read through the repository that parses each file once."""
    from hydra._internal.config_loader_impl import ConfigLoaderImpl
    from hydra._internal.utils import create_config_search_path
    from hydra.core.object_type import ObjectType

    from optbench.config.hydra_loader import composing_once_per_file

    loader = ConfigLoaderImpl(config_search_path=create_config_search_path(str(conf_dir())))
    asks = [(group, kind) for group in ("", "model", "hydra", "hydra/launcher")
            for kind in (ObjectType.CONFIG, ObjectType.GROUP, None)]
    outside = [loader.get_group_options(group, kind) for group, kind in asks]
    with composing_once_per_file():
        assert [loader.get_group_options(group, kind) for group, kind in asks] == outside
    assert "tiny" in outside[asks.index(("model", ObjectType.CONFIG))] and "launcher" in outside[
        asks.index(("hydra", None))]


def test_the_map_of_known_choices_is_built_only_for_a_node_with_an_interpolated_default(tmp_path, monkeypatch):
    """optbench.config.hydra_loader.composing_once_per_file: a defaults list that interpolates a
    choice (``- b: ${a}``) composes as Hydra composes it, and Hydra's map of the known choices is
    built for that node alone, not for every node of the defaults tree."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra._internal import defaults_list as tree
    from omegaconf import OmegaConf

    from optbench.config.hydra_loader import first_phase

    conf = tmp_path / "conf"
    files = {"train.yaml": "defaults:\n  - a: x\n  - b: ${a}\n  - _self_\ntop: 1\n",
             "a/x.yaml": "defaults:\n  - _self_\nax: 1\n", "a/y.yaml": "defaults:\n  - _self_\nay: 2\n",
             "b/x.yaml": "defaults:\n  - _self_\nbx: 3\n", "b/y.yaml": "defaults:\n  - _self_\nby: 4\n"}
    for name, text in files.items():
        (conf / name).parent.mkdir(parents=True, exist_ok=True)
        (conf / name).write_text(text)
    built = []
    original = tree._create_interpolation_map
    monkeypatch.setattr(tree, "_create_interpolation_map", lambda overrides, defaults_list, self_added: built.append(
        [str(d) for d in defaults_list]) or original(overrides, defaults_list, self_added))
    ours = first_phase(str(conf), "train", ["a=y"])
    assert len(built) == 1 and any("${a}" in d for d in built[0])  # the primary config's node alone
    built.clear()
    with initialize_config_dir(version_base="1.3", config_dir=str(conf)):
        theirs = hydra_compose(config_name="train", overrides=["a=y"])
    assert len(built) >= 3  # Hydra's own: at every node (the primary config, a/y, b/y and Hydra's own nodes)
    assert OmegaConf.to_yaml(ours) == OmegaConf.to_yaml(theirs) == "a:\n  ay: 2\nb:\n  by: 4\ntop: 1\n"
    assert tree._create_interpolation_map is not original and tree._create_interpolation_map.__name__ == "<lambda>"


def test_a_value_override_of_a_key_that_is_not_there_fails_as_in_hydra():
    from hydra.errors import ConfigCompositionException

    from optbench.config import compose

    compose(["model=tiny"])
    with pytest.raises(ConfigCompositionException, match="Could not override 'train.no_such_key'"):
        compose(["model=tiny", "train.no_such_key=1"])


# --------------------------------------------------------------------- keys that nothing reads
def test_a_key_that_no_schema_reads_is_refused_naming_the_valid_keys():
    """``+trackers=mlflow`` (a tracker switched on by a key optbench has no schema for: the group is
    ``logger=``, the key ``log.trackers``) must not run and log nowhere."""
    import dataclasses

    with pytest.raises(ConfigError) as err:
        to_config(compose_cfg(["+trackers=mlflow"]))
    message = str(err.value)
    assert message.startswith("trackers is not a key of optbench's config: no schema reads it, so it would do nothing")
    roots = [f.name for f in dataclasses.fields(Config)]  # derived from the schema: a new group is listed too
    assert f"the root keys are {', '.join(sorted(roots))}" in message and "\n" not in message
    with pytest.raises(ConfigError, match=r"train.nope is not a key of train \(TrainConfig\): no schema reads it.*"
                                          r"its keys are .*seq_len, steps"):
        to_config(compose_cfg(["+train.nope=3"]))
    with pytest.raises(ConfigError, match=r"optimizer.momentum is not a key of optimizer \(OptimizerConfig\)"):
        to_config(compose_cfg(["+optimizer.momentum=0.9"]))
    to_config(compose_cfg(["optimizer=muon", "model=hf_llama_tiny"]))  # every kind's own keys are read


def test_an_unread_key_exits_2_in_one_line_before_training(tmp_path, capsys):
    result = run_cli_here("train", "+trackers=mlflow", "train.steps=3", "measure.warmup_steps=1",
                          f"hydra.run.dir={tmp_path}", capsys=capsys)
    errors = [line for line in result.stderr.splitlines() if line.startswith("optbench: error:")]
    assert result.returncode == 2 and len(errors) == 1 and "trackers is not a key" in errors[0], result.stderr
    assert "Traceback" not in result.stderr and not (tmp_path / "metrics.jsonl").exists()


# ------------------------------------------------------------------- Hydra's mode, read once
def _key_paths(node, prefix: str):
    if isinstance(node, dict):
        for key, value in node.items():
            path = f"{prefix}.{key}" if prefix else str(key)
            yield path
            yield from _key_paths(value, path)


@pytest.fixture
def compositions(monkeypatch) -> list:
    """Grows by one for each composition Hydra makes (``ConfigLoaderImpl.load_configuration``)."""
    from hydra._internal.config_loader_impl import ConfigLoaderImpl

    made = []
    original = ConfigLoaderImpl.load_configuration
    monkeypatch.setattr(ConfigLoaderImpl, "load_configuration",
                        lambda self, *a, **k: (made.append(1), original(self, *a, **k))[1])
    return made


def test_no_config_file_sets_hydra_mode():
    """What lets ``optbench train``/``estimate`` read Hydra's mode without composing
    (optbench.config.hydra_mode): no file under conf/, at whatever package it is merged, sets
    ``hydra.mode``."""
    import re

    import yaml

    files = sorted(conf_dir().rglob("*.yaml"))
    assert len(files) > 50
    for path in files:
        text = path.read_text()
        header = re.search(r"^# *@package +(\S+)", text, re.M)
        group = path.parent.relative_to(conf_dir()).as_posix()
        package = header.group(1) if header else (group.replace("/", ".") if group != "." else "_global_")
        package = "" if package == "_global_" else package.replace("_group_", group.replace("/", "."))
        paths = set(_key_paths(yaml.safe_load(text) or {}, package))
        assert "hydra.mode" not in paths, f"{path.relative_to(conf_dir())} sets hydra.mode"


@pytest.mark.parametrize("overrides, mode, composes", [
    (["model=small", "train.steps=3", "hydra.run.dir=somewhere", "hydra.job.chdir=false"], None, 0),
    (["hydra.mode=MULTIRUN", "model=tiny"], "MULTIRUN", 1),
    (["+hydra.mode=RUN"], "RUN", 1),
    (["hydra/launcher=basic"], None, 1),
])
def test_hydra_reads_the_same_mode_without_composing_a_line_that_cannot_set_it(overrides, mode, composes,
                                                                                compositions):
    """``Hydra.get_mode`` (the composition ``@hydra.main`` makes before the run's own) gives the same
    answer under ``mode_read_without_composing``, composing nothing where the command line cannot set
    the mode; a line that can (``hydra.mode``, a ``hydra/`` group) is composed by Hydra as before."""
    from hydra._internal.hydra import Hydra
    from hydra._internal.utils import create_config_search_path
    from hydra.core.global_hydra import GlobalHydra

    from optbench.config.hydra_mode import mode_read_without_composing

    was_on, before = GlobalHydra.instance().is_initialized(), Hydra.get_mode
    hydra = Hydra.create_main_hydra2(task_name="train", config_search_path=create_config_search_path(str(conf_dir())))
    try:
        expected = hydra.get_mode(config_name="train", overrides=list(overrides))
        assert str(expected.name if expected else None) == str(mode)
        compositions.clear()  # counted from here: the mode read under the shortcut
        with mode_read_without_composing():
            assert hydra.get_mode(config_name="train", overrides=list(overrides)) == expected
        assert len(compositions) == composes
    finally:
        if not was_on:
            GlobalHydra.instance().clear()
    assert Hydra.get_mode is before  # Hydra's own again once the command is done


def test_a_config_directory_of_the_user_s_own_is_left_to_hydra():
    from optbench.config.hydra_mode import may_set_mode

    main = str(conf_dir())
    ours = [("hydra", "hydra.conf"), ("main", main), ("schema", "")]
    assert not may_set_mode(["model=tiny", "hydra.run.dir=x", "~hydra.job.chdir"], ours, main=main)
    assert may_set_mode(["model=tiny"], [*ours, ("command-line", "/mine")], main=main)
    assert may_set_mode(["model=tiny"], [("hydra", "hydra.conf"), ("main", "/mine"), ("schema", "")], main=main)
    for override in ("hydra.mode=RUN", "++hydra.mode=MULTIRUN", "~hydra.mode", "hydra={mode:RUN}",
                     "hydra/sweeper=basic", "hydra.searchpath=[file:///mine]", "+hydra.searchpath=[pkg://x]"):
        assert may_set_mode([override], ours, main=main), override


@pytest.mark.parametrize("command, override, needle", [
    ("train", "train.steps=0", "train.steps"),
    ("estimate", "train.stepz=3", "stepz"),
])
def test_a_command_composes_its_config_once(command, override, needle, tmp_path, capsys, compositions, monkeypatch):
    """``optbench train``/``estimate`` compose the config once (Hydra's mode is read without a
    composition of its own), whether the config is refused after composing or while composing.
    Inside them (optbench.config.hydra_loader.composing_once_per_file) Hydra builds its map of known
    choices for no node (no default under conf/ is interpolated), and the same command again in
    the process parses no config file again and says the same."""
    from hydra._internal import defaults_list as tree
    from hydra._internal.config_repository import ConfigRepository

    built, parsed = [], []
    original_map, original_load = tree._create_interpolation_map, ConfigRepository.load_config
    monkeypatch.setattr(tree, "_create_interpolation_map", lambda overrides, defaults_list, self_added: built.append(1) or
                        original_map(overrides, defaults_list, self_added))
    monkeypatch.setattr(ConfigRepository, "load_config", lambda self, config_path: parsed.append(config_path) or
                        original_load(self, config_path))
    results = []
    for _ in range(2):
        parsed.clear()
        results.append(run_cli_here(command, override, f"hydra.run.dir={tmp_path}", capsys=capsys))
    assert results[0].returncode == results[1].returncode == 2 and needle in results[0].stderr, results[0].stderr
    assert results[1].stderr == results[0].stderr
    assert len(compositions) == 2 and built == [] and parsed == []
