"""``optbench export RUN OUT``: a trained ``task=lm`` model in Hugging Face's ``save_pretrained``
format, loadable with ``AutoModelForCausalLM.from_pretrained(OUT)``.

* ``model=hf`` (and the ``hf_*`` presets): the transformers model itself, its weights from the run's
  newest checkpoint (or the checkpoint ``RUN`` names); the tokenizer files beside it when the run had
  a tokenizer (the token file's, else the ``model.hf.config`` directory's).
* optbench's own decoder (``tiny``, ``small``, ``134m``, ...): as transformers' ``ArceeForCausalLM``,
  the architecture that computes exactly what it computes: pre-norm RMSNorm blocks, rotary
  positions, a non-gated MLP (``hidden_act=gelu``: the exact erf GELU), no biases, an untied head.
  optbench rotates channel pairs (2i, 2i+1), transformers rotates (i, i + head_dim/2): the rows of
  each head's query and key projections are reordered, which leaves every q.k product, hence the
  logits, as they were (``tests/generate/test_export.py`` compares them).

Not exported (refused in one line): climate tasks (no causal LM) and fused runs (``fusion=``: the
fusion layers have no transformers counterpart). ``OUT`` must be missing or empty.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch
from torch import nn

from optbench.config import Config, HFModelConfig
from optbench.errors import ConfigError

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                   "merges.txt", "tokenizer.model", "generation_config.json")


def export_run(run: str | Path, out: str | Path) -> dict[str, Any]:
    """Write the model of ``run`` into ``out``; what was written (``architecture``, ``step``, ``tokenizer``)."""
    from optbench.generate.load import load_model

    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"{out} is not an empty directory; optbench export writes into a new or empty one")
    loaded = load_model(run, task="lm", why="optbench export writes causal language models (task=lm runs)")
    cfg = loaded.cfg
    if cfg.fusion.name != "none":
        raise ConfigError(f"{loaded.checkpoint} is a fused run (fusion={cfg.fusion.name}); its fusion layers have no "
                          "transformers counterpart, so it is not exported; export the task=lm run of its base")
    if isinstance(cfg.model, HFModelConfig):
        model = _unadapted(loaded.model)
    elif cfg.model.name == "module":
        raise ConfigError("a model=module run is your own nn.Module: save it with your own code")
    else:
        model = as_arcee(loaded.model, cfg)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer = _copy_tokenizer(cfg, out)
    return {"architecture": type(model).__name__, "step": loaded.step, "checkpoint": str(loaded.checkpoint),
            "tokenizer": tokenizer}


def _unadapted(model: nn.Module) -> nn.Module:
    """The transformers class under optbench's ``LogitsAdapter`` (``optbench.model.hf``)."""
    from optbench.model.hf import LogitsAdapter

    model.__class__ = next(c for c in type(model).__mro__[1:] if not issubclass(c, LogitsAdapter))
    return model


def rope_order(head_dim: int) -> torch.Tensor:
    """optbench's channel index of each of transformers' channels within a head: the pairs (2i, 2i+1)
    become (i, i + head_dim/2)."""
    return torch.cat([torch.arange(0, head_dim, 2), torch.arange(1, head_dim, 2)])


def as_arcee(model: nn.Module, cfg: Config) -> nn.Module:
    """optbench's decoder as an ``ArceeForCausalLM`` with the same weights (see the module docstring)."""
    from transformers import ArceeConfig, ArceeForCausalLM

    m = cfg.model
    config = ArceeConfig(vocab_size=m.vocab_size, hidden_size=m.dim, intermediate_size=m.ffn_dim,
                         num_hidden_layers=m.layers, num_attention_heads=m.heads, num_key_value_heads=m.heads,
                         head_dim=m.head_dim, hidden_act="gelu", max_position_embeddings=cfg.train.seq_len,
                         rms_norm_eps=m.norm_eps, rope_parameters={"rope_type": "default", "rope_theta": m.rope_theta},
                         tie_word_embeddings=False, attention_bias=False, mlp_bias=False,
                         bos_token_id=None, eos_token_id=None, pad_token_id=None)
    state = model.state_dict()
    order = torch.cat([h * m.head_dim + rope_order(m.head_dim) for h in range(m.heads)])
    mapped = {"model.embed_tokens.weight": state["embed.weight"], "model.norm.weight": state["norm.weight"],
              "lm_head.weight": state["head.weight"]}
    for i in range(m.layers):
        src, dst = f"layers.{i}.", f"model.layers.{i}."
        mapped.update({
            f"{dst}input_layernorm.weight": state[f"{src}attn_norm.weight"],
            f"{dst}self_attn.q_proj.weight": state[f"{src}attn.wq.weight"][order],
            f"{dst}self_attn.k_proj.weight": state[f"{src}attn.wk.weight"][order],
            f"{dst}self_attn.v_proj.weight": state[f"{src}attn.wv.weight"],
            f"{dst}self_attn.o_proj.weight": state[f"{src}attn.wo.weight"],
            f"{dst}post_attention_layernorm.weight": state[f"{src}mlp_norm.weight"],
            f"{dst}mlp.up_proj.weight": state[f"{src}mlp.w1.weight"],
            f"{dst}mlp.down_proj.weight": state[f"{src}mlp.w2.weight"],
        })
    arcee = ArceeForCausalLM(config)
    arcee.load_state_dict({k: v.detach().clone().contiguous() for k, v in mapped.items()}, strict=True)
    return arcee.eval()


def _copy_tokenizer(cfg: Config, out: Path) -> str | None:
    """The run's tokenizer files into ``out``: the token file's tokenizer (its sidecar names it),
    else the ``model.hf.config`` directory's; None when the run had none (synthetic or byte tokens)."""
    for source in _tokenizer_sources(cfg):
        directory = source if source.is_dir() else source.parent
        files = [directory / name for name in TOKENIZER_FILES if (directory / name).is_file()]
        if source.is_file() and source.name != "tokenizer.json":
            continue
        if any(f.name == "tokenizer.json" for f in files):
            for f in files:
                if not (out / f.name).exists():  # save_pretrained's generation_config.json stays
                    shutil.copy2(f, out / f.name)
            return str(directory)
    return None


def _tokenizer_sources(cfg: Config) -> list[Path]:
    sources = []
    if cfg.data.name == "tokens":
        from optbench.data.tokens import read_sidecar

        named = (read_sidecar(Path(cfg.data.path)) or {}).get("tokenizer")
        if named and named != "bytes":
            sources.append(Path(named))
    if isinstance(cfg.model, HFModelConfig) and cfg.model.hf.config:
        sources.append(Path(cfg.model.hf.config))
    return [s for s in sources if s.exists()]

