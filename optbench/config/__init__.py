"""Typed config schemas, registered in Hydra's ConfigStore.

Every YAML preset under ``conf/<group>/`` starts with ``defaults: [base_<group>, _self_]`` so Hydra
checks it against the dataclass here (a typo or a wrong type fails with Hydra's own message).
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
    ClimateTaskConfig,
    ClimateTextTaskConfig,
    DataConfig,
    LMTaskConfig,
    NetCDFDataConfig,
    SyntheticDataConfig,
    TaskConfig,
    TokensDataConfig,
)
from optbench.config.hf import HFModelConfig, HFSpec, ModuleModelConfig
from optbench.config.model import (
    PRECISIONS,
    ModelConfig,
    PrecisionConfig,
)
from optbench.config.optim import (
    ATTENTION_KERNELS,
    CHECKPOINTING_MODES,
    COMPILE_MODES,
    FUSION_KINDS,
    MUON_LR_ADJUSTMENTS,
    PARALLEL_MODES,
    AttentionConfig,
    CheckpointingConfig,
    CompileConfig,
    CPUOffloadOptimizerConfig,
    DataLoaderConfig,
    FusionConfig,
    LossFreqConfig,
    MuonOptimizerConfig,
    NCCLConfig,
    OptimizerConfig,
    ParallelConfig,
)
from optbench.config.run import (
    DEVICES,
    ESTIMATE_FORMATS,
    ESTIMATE_GPUS,
    LOG_LEVELS,
    SCHEDULES,
    EstimateConfig,
    ProfileConfig,
    StoppingConfig,
    TrainConfig,
)
from optbench.errors import ConfigError


# ------------------------------------------------------------------------------------------ top
@dataclass
class Config:
    model: ModelConfig = MISSING
    precision: PrecisionConfig = MISSING
    task: TaskConfig = MISSING
    data: DataConfig = MISSING
    optimizer: OptimizerConfig = MISSING
    dataloader: DataLoaderConfig = MISSING
    loss_freq: LossFreqConfig = MISSING
    compile: CompileConfig = MISSING
    checkpointing: CheckpointingConfig = MISSING
    attention: AttentionConfig = MISSING
    parallel: ParallelConfig = MISSING
    nccl: NCCLConfig = MISSING
    fusion: FusionConfig = field(default_factory=FusionConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    stopping: StoppingConfig = field(default_factory=StoppingConfig)
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    estimate: EstimateConfig = field(default_factory=EstimateConfig)


def register_configs() -> None:
    """Register the schemas as ``base_<group>`` nodes (idempotent)."""
    cs = ConfigStore.instance()
    cs.store(name="base_config", node=Config)
    cs.store(group="model", name="base_model", node=ModelConfig)
    cs.store(group="model", name="base_hf_model", node=HFModelConfig)
    cs.store(group="model", name="base_module_model", node=ModuleModelConfig)
    cs.store(group="precision", name="base_precision", node=PrecisionConfig)
    cs.store(group="task", name="base_lm", node=LMTaskConfig)
    cs.store(group="task", name="base_climate", node=ClimateTaskConfig)
    cs.store(group="task", name="base_climate_text", node=ClimateTextTaskConfig)
    cs.store(group="fusion", name="base_fusion", node=FusionConfig)
    cs.store(group="data", name="base_synthetic", node=SyntheticDataConfig)
    cs.store(group="data", name="base_tokens", node=TokensDataConfig)
    cs.store(group="data", name="base_netcdf", node=NetCDFDataConfig)
    cs.store(group="optimizer", name="base_optimizer", node=OptimizerConfig)
    cs.store(group="optimizer", name="base_cpu_offload", node=CPUOffloadOptimizerConfig)
    cs.store(group="optimizer", name="base_muon", node=MuonOptimizerConfig)
    cs.store(group="dataloader", name="base_dataloader", node=DataLoaderConfig)
    cs.store(group="loss_freq", name="base_loss_freq", node=LossFreqConfig)
    cs.store(group="compile", name="base_compile", node=CompileConfig)
    cs.store(group="checkpointing", name="base_checkpointing", node=CheckpointingConfig)
    cs.store(group="attention", name="base_attention", node=AttentionConfig)
    cs.store(group="parallel", name="base_parallel", node=ParallelConfig)
    cs.store(group="nccl", name="base_nccl", node=NCCLConfig)
    cs.store(group="stopping", name="base_stopping", node=StoppingConfig)
    cs.store(group="profile", name="base_profile", node=ProfileConfig)


def to_config(cfg: DictConfig | Config) -> Config:
    """Turn a composed DictConfig into typed dataclasses; the schemas' checks run here."""
    if isinstance(cfg, Config):
        return cfg
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


register_configs()


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
    for compare, validate, the benches and the tests."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    with initialize_config_dir(version_base="1.3", config_dir=str(conf_dir())):
        return hydra_compose(config_name=config_name, overrides=list(overrides))

__all__ = [
    "ATTENTION_KERNELS",
    "AttentionConfig",
    "AugmentConfig",
    "CHECKPOINTING_MODES",
    "COMPILE_MODES",
    "CPUOffloadOptimizerConfig",
    "CheckpointingConfig",
    "ClimateTaskConfig",
    "ClimateTextTaskConfig",
    "CompileConfig",
    "DEVICES",
    "DataConfig",
    "DataLoaderConfig",
    "ESTIMATE_FORMATS",
    "ESTIMATE_GPUS",
    "EstimateConfig",
    "FUSION_KINDS",
    "HFModelConfig",
    "HFSpec",
    "ModuleModelConfig",
    "FusionConfig",
    "LMTaskConfig",
    "LOG_LEVELS",
    "LossFreqConfig",
    "MUON_LR_ADJUSTMENTS",
    "ModelConfig",
    "MuonOptimizerConfig",
    "NCCLConfig",
    "NetCDFDataConfig",
    "OptimizerConfig",
    "PARALLEL_MODES",
    "PRECISIONS",
    "ParallelConfig",
    "PrecisionConfig",
    "ProfileConfig",
    "SCHEDULES",
    "StoppingConfig",
    "SyntheticDataConfig",
    "TaskConfig",
    "TokensDataConfig",
    "TrainConfig",
    "non_negative",
    "one_of",
    "positive",
    "Config",
    "compose",
    "conf_dir",
    "register_configs",
    "to_config",
]
