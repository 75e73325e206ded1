"""``optbench export RUN OUT``: a trained ``task=lm`` model in Hugging Face's ``save_pretrained``
format, loadable with ``AutoModelForCausalLM.from_pretrained(OUT)``: the model of the run's newest
checkpoint (or of the checkpoint ``RUN`` names) as its kind's ``ModelSpec.export`` writes it
(``optbench.model.export``: a ``model=hf`` model as its own transformers class, optbench's own
decoder as ``ArceeForCausalLM``), the tokenizer files beside it when the run had a tokenizer (the
token file's, else the ``model.hf.config`` directory's).

Not exported (refused in one line): climate tasks (no causal LM), fused runs (``fusion=``: the fusion
layers have no transformers counterpart) and kinds without an ``export``. ``OUT`` must be missing or
empty.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from optbench.config import Config
from optbench.errors import ConfigError
from optbench.files import atomic_directory, os_error_message
from optbench.logs import transformers_quiet
from optbench.training.kinds import model_spec

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                   "merges.txt", "tokenizer.model", "generation_config.json")


def export_run(run: str | Path, out: str | Path) -> dict[str, Any]:
    """Write the model of ``run`` into ``out``; what was written (``architecture``, ``step``, ``tokenizer``)."""
    from safetensors import SafetensorError

    from optbench.generate.load import load_model

    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"{out} is not an empty directory; optbench export writes into a new or empty one")
    loaded = load_model(run, task="lm", why="optbench export writes causal language models (task=lm runs)")
    cfg = loaded.cfg
    if cfg.fusion.name != "none":
        raise ConfigError(f"{loaded.checkpoint} is a fused run (fusion={cfg.fusion.name}); its fusion layers have no "
                          "transformers counterpart, so it is not exported; export the task=lm run of its base")
    spec = model_spec(cfg)
    if spec.export is None:
        raise ConfigError(f"model={cfg.model.name} ({spec.kind}) has no transformers counterpart optbench writes "
                          "(a model=module run is your own nn.Module: save it with your own code)")
    model = spec.export(loaded.model, cfg)
    try:
        with atomic_directory(out) as partial:  # a failed write leaves no OUT that looks like a model
            with transformers_quiet():  # the command says what it wrote, or why it could not, in one line
                model.save_pretrained(partial)
            tokenizer = _copy_tokenizer(cfg, partial)
    except (OSError, SafetensorError) as exc:  # a full disk, a size limit: safetensors says it its own way
        if isinstance(exc, OSError):
            raise ConfigError(os_error_message(exc, f"write the export into {out}")) from None
        raise ConfigError(f"cannot write the export into {out}: {str(exc).splitlines()[0]}; free some space "
                          "or choose another OUT") from None
    return {"architecture": type(model).__name__, "step": loaded.step, "checkpoint": str(loaded.checkpoint),
            "tokenizer": tokenizer}


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
    hf = getattr(cfg.model, "hf", None)  # model=hf: the directory its config came from
    if hf is not None and hf.config:
        sources.append(Path(hf.config))
    return [s for s in sources if s.exists()]

