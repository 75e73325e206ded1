"""Schemas of models optbench does not define: ``model=hf`` (a Hugging Face causal LM from a local
``config.json``, or a preset's fields) and ``model=module`` (the user's own ``nn.Module`` factory).

``model=hf``::

    model.hf.config=DIR            a directory holding config.json (any AutoModelForCausalLM model_type)
    model.hf.model_type=llama      or: no file, the architecture's defaults (what the hf_* presets use)
    model.hf.config_overrides.K=V  fields set on top of either (e.g. num_hidden_layers=2), as
                                   transformers' run_clm.py --config_overrides does
    model.hf.weights=DIR           safetensors to start from (model.safetensors or a sharded index)
    model.hf.layers_path=model.layers   where the decoder blocks are, when the structural search is wrong

Nothing is ever downloaded: a hub id (``meta-llama/...``) is refused with the fix named. The shape
fields every model has (``model.dim``, ``layers``, ``heads``, ``ffn_dim``, ``vocab_size``) are read
from the resolved config, so the rest of optbench (the vocabulary of the data, float8's alignment, the
estimate's closed form) reads them as for its own model; setting one by hand is refused, with the
``config_overrides`` key that changes it.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from optbench.config.model import ModelConfig
from optbench.errors import ConfigError

# "org/name" with no such local path: what users paste from the hub
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
# the shape fields a model=hf config derives, and the transformers attribute that sets each
DERIVED = {"dim": "hidden_size", "layers": "num_hidden_layers", "heads": "num_attention_heads",
           "ffn_dim": "intermediate_size", "vocab_size": "vocab_size", "rope_theta": "rope_theta",
           "norm_eps": "rms_norm_eps", "init_std": "initializer_range"}


@dataclass
class HFSpec:
    """Where a Hugging Face causal LM comes from (see the module docstring)."""

    config: str | None = None
    model_type: str | None = None
    config_overrides: dict[str, Any] = field(default_factory=dict)
    weights: str | None = None
    layers_path: str | None = None


@dataclass
class HFModelConfig(ModelConfig):
    """``model=hf``: the shape fields are derived from the resolved ``transformers`` config."""

    name: str = "hf"
    # 0: read from the config (the schema's types are ModelConfig's, so Hydra merges a preset into
    # the model group's node); any other value must agree with the config
    dim: int = 0
    layers: int = 0
    heads: int = 0
    ffn_dim: int = 0
    vocab_size: int = 0
    rope_theta: float = 0.0
    norm_eps: float = 0.0
    init_std: float = 0.0
    hf: HFSpec = field(default_factory=HFSpec)

    def __post_init__(self) -> None:
        config = load_hf_config(self.hf)
        shape = derived_shape(config)
        for key, value in shape.items():
            given = getattr(self, key)
            if given and given != value:
                raise ConfigError(
                    f"model.{key}={given} but the Hugging Face config says {value}: with model=hf the shape "
                    f"comes from the config; change it with model.hf.config_overrides.{DERIVED[key]}={given}"
                    if key not in ("rope_theta", "norm_eps", "init_std") else
                    f"model.{key}={given} is not read by model=hf; set the architecture's own field "
                    f"through model.hf.config_overrides (the config says {value})")
            setattr(self, key, value)
        self._check_shape(config.get_text_config())

    def _check_shape(self, text: Any) -> None:
        """ConfigError naming the Hugging Face field and where it came from for a shape no model can
        have: a size that is not a positive integer, key/value heads that do not divide the heads."""
        where = (f"{Path(self.hf.config).expanduser() / 'config.json'}" if self.hf.config else
                 f"model.hf.model_type={self.hf.model_type}") + (" with model.hf.config_overrides" if self.hf.config_overrides else "")
        for key in ("dim", "layers", "heads", "ffn_dim", "vocab_size"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ConfigError(f"{where} gives {DERIVED[key]}={value!r}, not a positive integer; fix it there or set "
                                  f"model.hf.config_overrides.{DERIVED[key]}=N")
        kv = getattr(text, "num_key_value_heads", None)
        if kv is not None and (isinstance(kv, bool) or not isinstance(kv, int) or kv <= 0 or self.heads % kv):
            fits = [n for n in range(1, self.heads + 1) if self.heads % n == 0]
            raise ConfigError(f"{where} gives num_key_value_heads={kv!r} for num_attention_heads={self.heads}: the key/value "
                              f"heads must divide the attention heads (one of {', '.join(map(str, fits))}); set "
                              "model.hf.config_overrides.num_key_value_heads=N")

    def block_period(self) -> int:
        """Decoder layers that repeat as a unit (the estimate's stacking copies whole units)."""
        return block_period(load_hf_config(self.hf))

    def vocab_key(self) -> str:
        return "model.hf.config_overrides.vocab_size"

    def own_tokenizer(self) -> str | None:
        """The ``model.hf.config`` directory's tokenizer (a pretrained base reads its own tokens; a
        preset has no directory, so it needs ``data.tokenizer``)."""
        directory = self.hf.config
        if directory is None or not (Path(directory).expanduser() / "tokenizer.json").is_file():
            where = f"model.hf.config={directory} holds no tokenizer.json" if directory is not None else \
                f"model={self.name} is built from its preset, with no directory to take a tokenizer from"
            raise ConfigError(f"task=climate_text with model=hf tokenizes its texts with the base's tokenizer, but "
                              f"{where}; give data.tokenizer=DIR_OR_FILE (the base's tokenizer.json), or "
                              "data.tokenizer=bytes for a base trained from scratch")
        return str(Path(directory).expanduser())

    def with_layers(self, layers: int) -> HFModelConfig:
        """The same model with ``layers`` decoder blocks (the estimate's short copies)."""
        spec = dataclasses.replace(self.hf, config_overrides={**self.hf.config_overrides, "num_hidden_layers": layers})
        return dataclasses.replace(self, hf=spec, layers=0)


@dataclass
class ModuleModelConfig(ModelConfig):
    """``model=module``: ``model.module`` is a Hydra node (``_target_`` plus arguments) whose call
    returns a causal LM ``nn.Module``: ``forward(input_ids) -> logits`` and an ``init_weights()``
    (or per-module ``reset_parameters``); ``model.layers_path`` names its block container when the
    structural search would not find it. The shape fields describe it (the data's vocabulary and
    the estimate read them) and are checked against the built module."""

    name: str = "module"
    module: dict[str, Any] = field(default_factory=dict)
    layers_path: str | None = None

    def __post_init__(self) -> None:
        if "_target_" not in self.module:
            raise ConfigError("model=module needs model.module._target_=your.package.build_model (a function "
                              "returning a causal LM nn.Module), e.g. +model.module._target_=mypkg.lm.build")
        super().__post_init__()


# ------------------------------------------------------------------------------------ resolving
def load_hf_config(spec: HFSpec) -> Any:
    """The ``transformers`` config ``spec`` names (a fresh copy: building a model mutates it)."""
    overrides = json.dumps(spec.config_overrides, sort_keys=True, default=str)
    stamp = _stamp(spec.config) if spec.config is not None else None
    return copy.deepcopy(_load(spec.config, spec.model_type, overrides, stamp))


def _stamp(path: str) -> tuple[float, int] | None:
    directory = Path(path).expanduser()
    if not directory.exists():
        return None  # a hub id: read from the cache each time its snapshot may have moved on
    file = _config_file(directory)
    try:
        stat = file.stat()
    except OSError:
        return None
    return stat.st_mtime, stat.st_size


@functools.lru_cache(maxsize=16)
def _load(path: str | None, model_type: str | None, overrides: str, stamp: Any) -> Any:
    from transformers import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    if (path is None) == (model_type is None):
        raise ConfigError("model=hf needs exactly one of model.hf.config=DIR (a directory with config.json) and "
                          "model.hf.model_type=NAME (the architecture's defaults, e.g. llama)"
                          + ("" if path is None else f"; got both ({path}, {model_type})"))
    data, where = (_read_config_json(path), f"{path}/config.json") if path is not None else ({}, "model.hf")
    kind = data.get("model_type", model_type)
    if kind not in CONFIG_MAPPING:
        raise ConfigError(f"{where}: model_type={kind} is not an architecture transformers knows; fix the "
                          "model_type (e.g. llama, gpt2, qwen2, mistral) or upgrade transformers")
    config_class = CONFIG_MAPPING[kind]
    given = json.loads(overrides)
    fields = {config_class.attribute_map.get(k, k): v for k, v in given.items() if k != "num_hidden_layers"}
    if "num_hidden_layers" in given:  # the generic name wins over the architecture's own (with_layers sets
        # it), and the per-layer lists (layer_types, GPT-Neo's attention types) follow the new depth
        resized = _resized(config_class, {**data, **fields}, given["num_hidden_layers"])
        fields = {**fields, config_class.attribute_map.get("num_hidden_layers", "num_hidden_layers"):
                  given["num_hidden_layers"], **resized}
    try:
        config = config_class.from_dict({**data, **fields})
    except Exception as exc:  # transformers' validation (ValueError, huggingface_hub's strict dataclass errors)
        reason = " ".join(str(exc).split())  # its validation errors span lines
        raise ConfigError(f"{where}: transformers refuses this {config_class.__name__} ({reason}); fix the "
                          "file or model.hf.config_overrides") from exc
    if config_class not in MODEL_FOR_CAUSAL_LM_MAPPING:
        raise ConfigError(f"{where}: model_type={kind} ({config_class.__name__}) is not a causal language model "
                          "(AutoModelForCausalLM has no class for it); use a decoder such as llama, gpt2, qwen2")
    return config


def _resized(config_class: type, fields: dict, layers: int) -> dict:
    """The per-layer fields for ``layers`` layers, from the config ``fields`` describe at its own
    depth; nothing when that config does not build (the fields then stand as they are)."""
    try:
        base = config_class.from_dict(fields)
    except Exception:  # e.g. per-layer lists given for the new depth only: nothing to resize
        return {}
    return per_layer_fields(base, layers)


def _config_file(path: Path) -> Path:
    return path if path.suffix == ".json" else path / "config.json"


def local_model_dir(path: str | Path, *, key: str) -> Path:
    """The directory ``path`` names: itself, or for a Hugging Face hub id (``org/name``) that is not
    a directory here, its snapshot in the local hub cache (huggingface_hub's own lookup,
    ``snapshot_download(local_files_only=True)``: HF_HOME / HF_HUB_CACHE, the ``main`` revision),
    never the network; one line naming ``key`` and the fix when it is not cached."""
    directory = Path(path).expanduser()
    if directory.exists() or not HUB_ID.match(str(path)):
        return directory
    from huggingface_hub import constants, snapshot_download

    try:
        return Path(snapshot_download(str(path), local_files_only=True))
    except Exception as exc:  # LocalEntryNotFoundError and kin: not cached, or cached without a snapshot
        raise ConfigError(
            f"{key}={path} looks like a Hugging Face hub id that is not in the local cache "
            f"({constants.HF_HUB_CACHE}: {type(exc).__name__}), and optbench reads nothing from the network: "
            f"download it first (hf download {path}) or pass a directory") from None


def _read_config_json(path: str) -> dict[str, Any]:
    directory = local_model_dir(path, key="model.hf.config")
    if not directory.exists():
        raise ConfigError(f"model.hf.config={path}: no such directory; pass a directory holding config.json")
    file = _config_file(directory)
    if not file.is_file():
        raise ConfigError(f"model.hf.config={path} holds no config.json; point it at a model directory "
                          "(save_pretrained writes one)")
    try:
        data = json.loads(file.read_text())
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{file} is not valid JSON ({exc.msg} at line {exc.lineno}, column {exc.colno}); "
                          "fix or re-download it") from exc
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read {file} ({exc}); check the file and its permissions") from exc
    if not isinstance(data, dict) or not isinstance(data.get("model_type"), str):
        raise ConfigError(f"{file} has no \"model_type\"; a transformers config.json names its architecture "
                          "(e.g. \"model_type\": \"llama\")")
    return data


def _period(values: list) -> int:
    """The shortest p with values[i] == values[i % p] for every i."""
    return next(p for p in range(1, len(values) + 1) if all(v == values[i % p] for i, v in enumerate(values)))


def _per_layer_lists(config: Any) -> dict[str, list]:
    """The config's fields that hold one entry per decoder layer (``layer_types``, GPT-Neo's
    expanded ``attention_layers``, ...): lists as long as the depth (of two layers or more)."""
    layers = config.num_hidden_layers
    return {name: value for name, value in vars(config).items()
            if isinstance(value, list) and layers > 1 and len(value) == layers and name != "architectures"}


def per_layer_fields(base: Any, layers: int) -> dict[str, Any]:
    """The per-layer fields of ``base`` for ``layers`` layers, their repeating pattern continued
    (nothing when the depth does not change)."""
    if layers == base.num_hidden_layers:
        return {}
    out = {}
    for name, value in _per_layer_lists(base).items():
        period = _period(value)
        out[name] = [value[i % period] for i in range(layers)]
    if isinstance(getattr(base, "attention_types", None), list) and "attention_layers" in out:  # GPT-Neo's form
        pattern = out.pop("attention_layers")[:_period(base.attention_layers)]
        if layers % len(pattern) == 0:
            out["attention_types"] = [[pattern, layers // len(pattern)]]
    return out


def block_period(config: Any) -> int:
    """How many decoder layers repeat as a unit: the least common multiple of the per-layer lists'
    periods (GPT-Neo's global/local: 2; sliding-window patterns; 1 when every layer is alike)."""
    return math.lcm(1, *(_period(v) for v in _per_layer_lists(config.get_text_config()).values()))


def derived_shape(config: Any) -> dict[str, Any]:
    """optbench's shape fields of a ``transformers`` config (its text config for composite models)."""
    text = config.get_text_config()
    dim = text.hidden_size
    ffn = next((getattr(text, k) for k in ("intermediate_size", "n_inner", "ffn_dim") if getattr(text, k, None)), None)
    rope = getattr(text, "rope_parameters", None) or {}
    eps = next((getattr(text, k) for k in ("rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon")
                if getattr(text, k, None) is not None), 1e-5)
    return {
        "dim": dim, "layers": text.num_hidden_layers, "heads": text.num_attention_heads,
        "ffn_dim": ffn or 4 * dim, "vocab_size": text.vocab_size,
        "rope_theta": float(rope.get("rope_theta", getattr(text, "rope_theta", 10000.0)) or 10000.0),
        "norm_eps": float(eps), "init_std": float(getattr(text, "initializer_range", 0.02) or 0.02),
    }
