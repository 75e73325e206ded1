"""Typed config schemas, registered in Hydra's ConfigStore; the modules mirror the packages (model,
training, optim, data, tasks, run, estimate) and every name is importable from here.

Every YAML preset under ``conf/<group>/`` starts with ``defaults: [/schema_<group>@_here_, _self_]``
so Hydra checks it against the dataclass here (a typo or a wrong type fails with Hydra's own
message). The schemas are top-level configs, not options of a group, so ``optbench train --help``
lists only the presets. The YAML chooses presets; every default is a dataclass field's, once.
``OmegaConf.to_object`` then builds these dataclasses, and their ``__post_init__`` runs the
cross-field checks, which raise ``ConfigError`` with a message that names the fix.

Code after composition reads typed fields (``cfg.train.steps``), never ``cfg.get(...)``.
Groups whose presets differ in shape (``data``, ``task``) use a base dataclass and one subclass per
kind; the top-level field is typed with the base so any registered kind can be selected.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import MissingMandatoryValue

from optbench.config.checks import (
    non_negative,
    one_of,
    positive,
)
from optbench.config.data import (
    AugmentConfig,
    DataConfig,
    DataLoaderConfig,
    NetCDFDataConfig,
    SyntheticDataConfig,
    TokensDataConfig,
)
from optbench.config.energy import (
    EmbeddingsDataConfig,
    EnergyFlowModelConfig,
    EnergyFlowTaskConfig,
    EnergySyntheticDataConfig,
)
from optbench.config.estimate import ESTIMATE_FORMATS, ESTIMATE_GPUS, EstimateConfig
from optbench.config.hf import HFModelConfig, HFSpec, ModuleModelConfig
from optbench.config.model import FUSION_KINDS, FusionConfig, ModelConfig
from optbench.config.optim import (
    MUON_LR_ADJUSTMENTS,
    CPUOffloadOptimizerConfig,
    MuonOptimizerConfig,
    OptimizerConfig,
)
from optbench.config.renames import upgrade_and_warn, upgrade_config, upgrade_overrides
from optbench.config.run import (
    DEVICES,
    LOG_LEVELS,
    PROFILES,
    SCHEDULES,
    CheckpointConfig,
    LogConfig,
    MeasureConfig,
    ProfileConfig,
    RunControlConfig,
    StoppingConfig,
    TrainConfig,
)
from optbench.config.tasks import ClimateTaskConfig, ClimateTextTaskConfig, LMTaskConfig, TaskConfig
from optbench.config.training import (
    AC_MODES,
    ATTENTION_KERNELS,
    COMPILE_MODES,
    FLOAT8_RECIPES,
    PARALLEL_MODES,
    PRECISIONS,
    ACConfig,
    AttentionConfig,
    CompileConfig,
    LossFreqConfig,
    NCCLConfig,
    ParallelConfig,
    PrecisionConfig,
)
from optbench.errors import ConfigError
from optbench.files import job_dir_name


# ------------------------------------------------------------------------------------------ top
@dataclass
class Config:
    """A composed run: one node per group (presets chosen in conf/train.yaml's defaults list) and
    the nodes without presets (``train``, ``checkpoint``, ``log``, ``measure``, ``run``,
    ``estimate``), whose defaults are these dataclasses' and nowhere else."""

    model: ModelConfig = MISSING
    precision: PrecisionConfig = MISSING
    task: TaskConfig = MISSING
    data: DataConfig = MISSING
    optimizer: OptimizerConfig = MISSING
    dataloader: DataLoaderConfig = MISSING
    loss_freq: LossFreqConfig = MISSING
    compile: CompileConfig = MISSING
    ac: ACConfig = MISSING
    attention: AttentionConfig = MISSING
    parallel: ParallelConfig = MISSING
    nccl: NCCLConfig = MISSING
    fusion: FusionConfig = field(default_factory=FusionConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    log: LogConfig = field(default_factory=LogConfig)
    measure: MeasureConfig = field(default_factory=MeasureConfig)
    run: RunControlConfig = field(default_factory=RunControlConfig)
    stopping: StoppingConfig = field(default_factory=StoppingConfig)
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    estimate: EstimateConfig = field(default_factory=EstimateConfig)

    def __post_init__(self) -> None:
        if self.fusion.base_dtype != "fp32" and not (self.fusion.freeze_base and self.precision.autocast == "bfloat16"):
            raise ConfigError(f"fusion.base_dtype={self.fusion.base_dtype} stores the decoder in bf16, which needs it "
                              "frozen and bf16 matmuls: add fusion.freeze_base=true precision=bf16, or drop "
                              "fusion.base_dtype")
        if self.train.steps <= self.measure.warmup_steps:
            raise ConfigError(
                f"train.steps={self.train.steps} leaves no timed step after measure.warmup_steps="
                f"{self.measure.warmup_steps}; raise train.steps or lower measure.warmup_steps"
            )


# The schemas, one per group (and one per kind where a group's presets differ in shape), stored as
# top-level configs rather than group options so that `optbench train --help` lists only the
# presets. A preset is checked against its schema by its first default: `/schema_<group>@_here_`.
SCHEMAS: dict[str, Any] = {
    "schema_config": Config,
    "schema_model": ModelConfig,
    "schema_model_hf": HFModelConfig,
    "schema_model_module": ModuleModelConfig,
    "schema_precision": PrecisionConfig,
    "schema_task_lm": LMTaskConfig,
    "schema_task_climate": ClimateTaskConfig,
    "schema_task_climate_text": ClimateTextTaskConfig,
    "schema_model_energy_flow": EnergyFlowModelConfig,
    "schema_task_energy_flow": EnergyFlowTaskConfig,
    "schema_data_embeddings": EmbeddingsDataConfig,
    "schema_data_energy_synthetic": EnergySyntheticDataConfig,
    "schema_fusion": FusionConfig,
    "schema_data_synthetic": SyntheticDataConfig,
    "schema_data_tokens": TokensDataConfig,
    "schema_data_netcdf": NetCDFDataConfig,
    "schema_optimizer": OptimizerConfig,
    "schema_optimizer_cpu_offload": CPUOffloadOptimizerConfig,
    "schema_optimizer_muon": MuonOptimizerConfig,
    "schema_dataloader": DataLoaderConfig,
    "schema_loss_freq": LossFreqConfig,
    "schema_compile": CompileConfig,
    "schema_ac": ACConfig,
    "schema_attention": AttentionConfig,
    "schema_parallel": ParallelConfig,
    "schema_nccl": NCCLConfig,
    "schema_stopping": StoppingConfig,
    "schema_profile": ProfileConfig,
}


def augments_by_default(task: str) -> bool:
    """``data.augment.enabled`` of ``data=netcdf`` unless overridden: on, except for
    ``task=climate_text`` (a longitude roll would move every place its texts name)."""
    return task != "climate_text"


def register_configs() -> None:
    """Store every schema in Hydra's ConfigStore under its ``SCHEMAS`` name, and the resolvers the
    presets use (idempotent)."""
    cs = ConfigStore.instance()
    for name, node in SCHEMAS.items():
        cs.store(name=name, node=node)
    if not OmegaConf.has_resolver("optbench_augments"):
        OmegaConf.register_new_resolver("optbench_augments", augments_by_default)


def to_config(cfg: DictConfig | Config) -> Config:
    """Turn a composed DictConfig into typed dataclasses; the schemas' checks run here."""
    if isinstance(cfg, Config):
        return cfg
    refuse_unread_keys(cfg)
    try:
        obj: Any = OmegaConf.to_object(cfg)
    except MissingMandatoryValue as exc:  # a ??? left in a preset, e.g. data.paths of data=netcdf
        example = {"data.paths": "data.paths=[data.nc] (`optbench data synth data.nc` writes one)",
                   "data.path": "data.path=corpus.bin (`optbench data tokenize TEXT corpus.bin` writes one)",
                   "model.hf.config": "model.hf.config=DIR (a local directory holding a transformers config.json)"}
        raise ConfigError(f"{exc.full_key} is required and has no value; pass "
                          f"{example.get(exc.full_key, exc.full_key + '=...')}") from exc
    assert isinstance(obj, Config), f"composed config is {type(obj).__name__}, not Config"
    return obj


def refuse_unread_keys(node: DictConfig, *, where: str = "") -> None:
    """ConfigError, one line, for a key that no schema has (a ``+key=value`` override adds one that
    Hydra's own checks let through and nothing would ever read): the valid keys are the fields of
    the node's schema (for the root, ``Config``'s: a new group is a new field, listed by itself)."""
    import dataclasses

    schema = OmegaConf.get_type(node)
    if not dataclasses.is_dataclass(schema):
        return  # a free-form node (a dict the schema types as such)
    fields = sorted(f.name for f in dataclasses.fields(schema))
    for key in node.keys():
        name = f"{where}{key}"
        if key not in fields:
            if not where:
                raise ConfigError(f"{name} is not a key of optbench's config: no schema reads it, so it would do "
                                  f"nothing (a typo, or a feature optbench does not have?); remove the override; "
                                  f"the root keys are {', '.join(fields)}")
            raise ConfigError(f"{name} is not a key of {where[:-1]} ({schema.__name__}): no schema reads it, so it "
                              f"would do nothing; remove the override; its keys are {', '.join(fields)}")
        child = node._get_node(key)
        if isinstance(child, DictConfig) and not child._is_missing() and not child._is_none():
            refuse_unread_keys(child, where=f"{name}.")


register_configs()
# a sweep job's directory name that fits the filesystem (conf/train.yaml's hydra.sweep.subdir)
OmegaConf.register_new_resolver("optbench_job_dir", job_dir_name, replace=True)


def conf_dir() -> Path:
    """The directory of Hydra configs: in an installed wheel the copy packaged as ``optbench.conf``
    (``optbench/conf/`` inside the installed package), in a source checkout ``conf/`` beside the
    package. A real directory either way: ``optbench.conf`` has no ``__init__.py``, so
    ``importlib.resources.files`` would give a MultiplexedPath, whose ``str()`` Hydra cannot load."""
    package = Path(__file__).resolve().parent.parent  # optbench/ (this is optbench/config/__init__.py)
    candidates = (package / "conf", package.parent / "conf")
    for candidate in candidates:
        if (candidate / "train.yaml").is_file():
            return candidate
    raise ConfigError(
        f"optbench's configs are missing (no train.yaml in {' or '.join(map(str, candidates))}); "
        "reinstall optbench (pip install --force-reinstall optbench) or run it from a source checkout"
    )


def compose(overrides: list[str] | tuple[str, ...] = (), *, config_name: str = "train") -> DictConfig:
    """Compose ``config_name`` with ``overrides`` exactly as the CLI does (outside ``@hydra.main``):
    for compare, validate, the benches and the tests. An old override name is read as the CLI
    reads it: under its new name, with one line on stderr (``optbench.config.renames``).

    Hydra composes in two phases: the defaults list (which presets, chosen by the group overrides)
    is merged into a config, then the overrides of its keys (``train.steps=6``, ``+a.b=1``, ``~a.b``)
    are applied to it, in the order given. The first phase depends only on the group overrides, so
    it is done once per process for each list of them, by Hydra's own loader over files parsed once
    per process (``optbench.config.hydra_loader``); the second runs Hydra's own code on a copy."""
    import copy

    from hydra._internal.config_loader_impl import ConfigLoaderImpl
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from optbench.config.hydra_loader import first_phase

    upgraded, directory = upgrade_and_warn(overrides), str(conf_dir())
    parsed = OverridesParser.create().parse_overrides(upgraded)  # a syntax error is Hydra's, as in one compose
    values = [o for o in parsed if _config_override(o)]
    key = (directory, config_name, tuple(o.input_line for o in parsed if not _config_override(o)))
    if key not in _COMPOSED:
        composed = first_phase(directory, config_name, list(key[2]))
        if len(_COMPOSED) >= 256:
            _COMPOSED.pop(next(iter(_COMPOSED)))
        _COMPOSED[key] = composed
    cfg = copy.deepcopy(_COMPOSED[key])  # the caller's own copy: it may set keys
    ConfigLoaderImpl._apply_overrides_to_config(values, cfg)  # what Hydra does after merging the presets
    return cfg


def _config_override(override: Any) -> bool:
    """An override of a key of the composed config, ``a.b=v``, ``+a.b=v``, ``++a.b=v`` or ``~a.b``
    (Hydra's "config override": a dotted key names no config group here), which never changes which
    presets are merged: Hydra applies these after merging, in the order given, and so does
    ``compose``. Anything else (a group choice, a package, a sweep, ``hydra.*``) goes to Hydra's
    first phase."""
    return (override.package is None and not override.is_sweep_override() and "." in override.key_or_group
            and not override.is_hydra_override())


# the first phase's results in this process, per list of group overrides: a config's files do not
# change under a running process; ``${now:...}`` stays an interpolation until read
_COMPOSED: dict[tuple[str, str, tuple[str, ...]], DictConfig] = {}

__all__ = [
    "AC_MODES",
    "ATTENTION_KERNELS",
    "COMPILE_MODES",
    "DEVICES",
    "ESTIMATE_FORMATS",
    "ESTIMATE_GPUS",
    "FLOAT8_RECIPES",
    "FUSION_KINDS",
    "LOG_LEVELS",
    "MUON_LR_ADJUSTMENTS",
    "PARALLEL_MODES",
    "PRECISIONS",
    "PROFILES",
    "SCHEDULES",
    "SCHEMAS",
    "ACConfig",
    "AttentionConfig",
    "AugmentConfig",
    "CPUOffloadOptimizerConfig",
    "CheckpointConfig",
    "ClimateTaskConfig",
    "ClimateTextTaskConfig",
    "CompileConfig",
    "Config",
    "DataConfig",
    "DataLoaderConfig",
    "EmbeddingsDataConfig",
    "EnergyFlowModelConfig",
    "EnergyFlowTaskConfig",
    "EnergySyntheticDataConfig",
    "EstimateConfig",
    "HFModelConfig",
    "HFSpec",
    "ModuleModelConfig",
    "FusionConfig",
    "LMTaskConfig",
    "LogConfig",
    "LossFreqConfig",
    "MeasureConfig",
    "ModelConfig",
    "MuonOptimizerConfig",
    "NCCLConfig",
    "NetCDFDataConfig",
    "OptimizerConfig",
    "ParallelConfig",
    "PrecisionConfig",
    "ProfileConfig",
    "RunControlConfig",
    "StoppingConfig",
    "SyntheticDataConfig",
    "TaskConfig",
    "TokensDataConfig",
    "TrainConfig",
    "compose",
    "conf_dir",
    "non_negative",
    "one_of",
    "positive",
    "register_configs",
    "to_config",
    "upgrade_config",
    "upgrade_overrides",
]
