"""Pretrained weights from a local directory of safetensors (``model.hf.weights=DIR``).

``DIR`` holds what ``save_pretrained`` writes: one ``model.safetensors`` or shards
(``model-00001-of-0000N.safetensors`` beside their index); every ``*.safetensors`` file in it is
read. Loading goes through ``torch.distributed.checkpoint`` with its Hugging Face storage reader,
into the model's own state dict (``get_model_state_dict``: transformers' parameter names, whatever
activation checkpointing or compile wrapped): DCP plans one read per tensor *this rank holds*, and
the reader reads just that slice of the file (safetensors slices are read in place). Under FSDP2 each
rank therefore reads only its own shards and no rank ever holds a full copy; a single process or a
DDP rank reads every tensor once. The checkpoint's dtype is converted on copy (bf16 files into the
fp32 parameters the precision group starts from).

Before anything is read, the files' headers are checked against the model (``check_weights``): every
parameter present (a tied head may be absent: it is the embedding), every shape equal, no tensor the
model does not have; a mismatch names the tensor, both shapes and the config. An integer or boolean
tensor for a floating-point parameter (``refuse_non_floating``) is refused naming its file, never cast.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

import torch
from torch import nn

from optbench.config.hf import local_model_dir
from optbench.errors import ConfigError

log = logging.getLogger(__name__)

# tensors older checkpoints carry that current transformers models compute instead (as
# transformers' own loader ignores them)
_IGNORABLE = re.compile(r"(rotary_emb\.inv_freq|(^|\.)position_ids|\.attn\.bias|\.attn\.masked_bias|"
                        r"\.attention\.bias|\.attention\.masked_bias)$")


def _headers(directory: Path) -> dict[str, tuple[tuple[int, ...], str, str]]:
    """name -> (shape, dtype, file) of every tensor in the directory's safetensors files."""
    from safetensors import SafetensorError, safe_open

    if not directory.is_dir():
        raise ConfigError(f"model.hf.weights={directory}: no such directory; pass the directory save_pretrained "
                          "wrote (model.safetensors or its shards)")
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise ConfigError(f"model.hf.weights={directory} holds no *.safetensors file (PyTorch .bin weights are "
                          "not read: convert them with save_pretrained(..., safe_serialization=True))")
    found: dict[str, tuple[tuple[int, ...], str, str]] = {}
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as handle:
                for key in handle.keys():
                    piece = handle.get_slice(key)
                    found[key] = (tuple(piece.get_shape()), piece.get_dtype(), file.name)
        except (SafetensorError, OSError) as exc:
            raise ConfigError(f"{file} is not a readable safetensors file ({exc}); re-download or re-save it") from exc
    return found


def _model_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's state dict by transformers' names (wrappers' prefixes removed), parameters and
    persistent buffers, FSDP2 shards as DTensors; without a fused model's climate fusion
    (``model.fusion``, ``optbench.model.hf_fusion``), which the pretrained weights do not hold."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return {k: v for k, v in get_model_state_dict(model).items() if not k.startswith("fusion.")}


def checkpoint_names(model: nn.Module, model_keys: list[str], found: dict[str, Any], *, directory: Path) -> dict[str, str]:
    """checkpoint key -> model key, through transformers' own renamings for the architecture (a
    file written by save_pretrained keeps the hub's historical names, e.g. GPT-NeoX's ``embed_out``
    for ``lm_head``) and its base-model prefix (hub GPT-2 files name ``h.0...`` what the causal LM
    calls ``transformer.h.0...``). Architectures whose loading transforms tensors (merging experts,
    permuting) are refused: their files cannot be read slice by slice."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, rename_source_key

    transforms = get_model_conversion_mapping(model)
    renamings = [t for t in transforms if not isinstance(t, WeightConverter)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    known = dict.fromkeys(model_keys, True)
    names = {}
    for key in found:
        renamed, converted = rename_source_key(key, renamings, converters, getattr(model, "base_model_prefix", None),
                                               known)
        if converted is not None:
            raise ConfigError(f"model.hf.weights={directory}: {key} needs transformers' tensor conversion "
                              f"({converted}) on load, which optbench's sharded reading does not do; use an "
                              "architecture whose safetensors match its parameters")
        names[key] = renamed
    return names


def match_keys(model: nn.Module, state: dict[str, torch.Tensor], found: dict[str, Any], *,
               directory: Path, config: str) -> dict[str, str]:
    """model key -> checkpoint key for every tensor to load; raises ConfigError naming the first
    missing tensor, shape mismatch or unexpected tensor."""
    stored_as = {model_key: key for key, model_key in checkpoint_names(model, list(state), found,
                                                                        directory=directory).items()}
    tied = getattr(model, "all_tied_weights_keys", {}) or {}
    mapping: dict[str, str] = {}
    for key, tensor in state.items():
        stored = stored_as.get(key)
        if stored is None:
            if tied.get(key) in stored_as:  # a tied head: it is the embedding, loaded under its name
                continue
            raise ConfigError(f"model.hf.weights={directory} has no tensor {key} that {config} needs; the weights "
                              "belong to another architecture or size: point model.hf.config at their own config")
        shape = tuple(found[stored][0])
        if shape != tuple(tensor.shape):
            raise ConfigError(f"model.hf.weights={directory}: {stored} is {list(shape)} in {found[stored][2]} but "
                              f"{config} makes it {list(tensor.shape)}; use the config the weights were saved with")
        mapping[key] = stored
    used = set(mapping.values())
    extra = sorted(k for k in found if k not in used and not _IGNORABLE.search(k))
    if extra:
        raise ConfigError(f"model.hf.weights={directory} holds {len(extra)} tensor(s) {config} does not have "
                          f"(e.g. {', '.join(extra[:3])}); use the config the weights were saved with")
    return mapping


def check_weights(model: nn.Module, directory: str | Path, *, config: str) -> dict[str, str]:
    """Check the safetensors headers under ``directory`` against ``model`` (meta or real)."""
    path = local_model_dir(directory, key="model.hf.weights")
    return match_keys(model, _model_tensors(model), _headers(path), directory=path, config=config)


def refuse_non_floating(found: dict[str, tuple[tuple[int, ...], str, str]], targets: dict[str, torch.Tensor], *,
                        directory: Path) -> None:
    """ConfigError naming the file and tensor when a floating-point parameter would be read from an
    integer or boolean tensor (``found``: the headers, ``targets``: checkpoint key -> the model's
    tensor): the copy would cast it silently, and the model train from nonsense."""
    for key, target in targets.items():
        dtype = found[key][1]
        if target.is_floating_point() and not (dtype.startswith("F") or dtype == "BF16"):
            raise ConfigError(f"{directory / found[key][2]}: {key} is {dtype}, not a floating-point type, but the "
                              f"model's {key} is {str(target.dtype).removeprefix('torch.')} (quantized or corrupt "
                              "weights?); save the weights in a floating-point dtype (F32, BF16, F16)")


def load_weights(model: nn.Module, directory: str | Path, *, config: str) -> dict[str, Any]:
    """Load ``directory``'s safetensors into the materialized ``model`` in place (see the module
    docstring). Returns what was loaded, for summary.json."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader
    from torch.distributed.checkpoint.state_dict import set_model_state_dict

    path = local_model_dir(directory, key="model.hf.weights")
    found = _headers(path)
    state = _model_tensors(model)
    mapping = match_keys(model, state, found, directory=path, config=config)
    refuse_non_floating(found, {stored: state[key] for key, stored in mapping.items()}, directory=path)
    to_read = {stored: state[key] for key, stored in mapping.items()}
    dcp.load(to_read, storage_reader=HuggingFaceStorageReader(str(path)))
    set_model_state_dict(model, {key: to_read[stored] for key, stored in mapping.items()},
                         options=_partial())
    files = sorted({found[stored][2] for stored in mapping.values()})
    dtypes = sorted({found[stored][1] for stored in mapping.values()})
    log.info("Loaded %d tensors from %s (%d file(s), %s)", len(mapping), path, len(files), ",".join(dtypes))
    return {"directory": str(path), "tensors": len(mapping), "files": len(files), "dtypes": dtypes}


def _partial() -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(strict=False)  # tied heads are set through the embedding they share
