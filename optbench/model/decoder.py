"""The ONE block interface every causal LM optbench trains is seen through: optbench's own
``Transformer``, a Hugging Face model (``optbench.model.hf``) and a user's own module alike are
``embed -> layers (a container of alike blocks) -> norm -> head``. Activation checkpointing,
compile, FSDP2, float8, Muon, the FLOP count and the estimate's stacking find the blocks here, so
each has one code path for every model.

``DecoderParts`` holds the dotted paths of the four parts inside the model, plus the attention
width (query heads x head dim) the FLOP count needs. A model carries its own as the attribute
``decoder_parts`` (set by whoever builds it); ``find_parts`` finds them structurally for a model
whose code optbench never saw: the blocks are the container (``ModuleList``/``ModuleDict``) of
identical modules holding the most parameters, the embedding is the largest ``nn.Embedding`` outside
them, the head the ``nn.Linear`` outside them whose outputs match the embedding's rows, the final
norm the first norm-like module registered after the blocks.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from optbench.errors import ConfigError


@dataclass(frozen=True)
class DecoderParts:
    embed: str
    layers: str
    norm: str | None
    head: str | None
    attention_width: int  # query heads x head dim: the width of the attention scores' matmuls


def decoder_parts(model: nn.Module) -> DecoderParts:
    """The parts the model's builder recorded (``model.decoder_parts``)."""
    parts = getattr(model, "decoder_parts", None)
    assert isinstance(parts, DecoderParts), f"{type(model).__name__} was built without decoder_parts"
    return parts


def layers_of(model: nn.Module) -> nn.Module:
    """The container of the model's decoder blocks (a ``ModuleDict`` or ``ModuleList``)."""
    return model.get_submodule(decoder_parts(model).layers)


def blocks_of(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The decoder blocks, by their name in the container ("0", "1", ...)."""
    return list(layers_of(model).named_children())


def is_in_blocks(model: nn.Module, name: str) -> bool:
    """Whether the parameter or module ``name`` (a dotted path in ``model``) lies inside a block."""
    return name.startswith(decoder_parts(model).layers + ".")


# ---------------------------------------------------------------------------------- the search
def find_layers(model: nn.Module) -> str:
    """The dotted path of the container of identical blocks holding the most parameters."""
    best, best_params = None, 0
    for name, module in model.named_modules():
        children = list(module.children())
        if not isinstance(module, (nn.ModuleList, nn.ModuleDict)) or not children:
            continue
        if len({type(c) for c in children}) != 1:
            continue
        params = sum(p.numel() for p in module.parameters())
        if params > best_params:
            best, best_params = name, params
    if best is None:
        raise ConfigError(f"{type(model).__name__} has no ModuleList/ModuleDict of identical blocks; name the "
                          "container of its decoder blocks with model.hf.layers_path (or model.layers_path)")
    return best


def find_parts(model: nn.Module, *, layers_path: str | None, attention_width: int,
               embed: nn.Module | None = None, head: nn.Module | None = None) -> DecoderParts:
    """The parts of ``model`` (``embed``/``head`` when the caller knows them, e.g. transformers'
    ``get_input_embeddings()``), found structurally otherwise; ``layers_path`` overrides the blocks'."""
    layers = layers_path if layers_path is not None else find_layers(model)
    container = _submodule(model, layers)
    if not isinstance(container, (nn.ModuleList, nn.ModuleDict)) or not list(container.children()):
        raise ConfigError(f"layers path {layers} is a {type(container).__name__}, not a ModuleList/ModuleDict of "
                          "decoder blocks; name the container that holds them")
    outside = [(n, m) for n, m in model.named_modules() if n and n != layers and not n.startswith(layers + ".")]
    paths = {id(m): n for n, m in outside}
    embeddings = [m for _, m in outside if isinstance(m, nn.Embedding)]
    if embed is None and not embeddings:
        raise ConfigError(f"{type(model).__name__} has no nn.Embedding outside its blocks ({layers}): optbench "
                          "trains token models whose forward(input_ids) embeds tokens")
    embed = embed if embed is not None else max(embeddings, key=lambda m: m.num_embeddings)
    if head is None:
        vocab = getattr(embed, "num_embeddings", None)
        heads = [m for _, m in outside if isinstance(m, nn.Linear) and m.out_features == vocab]
        head = heads[-1] if heads else None
    return DecoderParts(embed=paths.get(id(embed), ""), layers=layers, norm=_final_norm(model, layers),
                        head=paths.get(id(head)) if head is not None else None, attention_width=attention_width)


def _submodule(model: nn.Module, path: str) -> nn.Module:
    try:
        return model.get_submodule(path)
    except AttributeError as exc:
        names = ", ".join(n for n, m in model.named_modules() if isinstance(m, (nn.ModuleList, nn.ModuleDict)))
        raise ConfigError(f"layers path {path} is not a module of {type(model).__name__}; its containers: "
                          f"{names or 'none'}") from exc


def _final_norm(model: nn.Module, layers: str) -> str | None:
    """The first norm-like module registered after the blocks (outside them), preferring the blocks'
    siblings (``model.norm`` beside ``model.layers``, ``transformer.ln_f`` beside ``transformer.h``)."""
    names = [n for n, _ in model.named_modules()]
    after = names.index(layers)
    norms = [n for i, (n, m) in enumerate(model.named_modules()) if i > after and not n.startswith(layers + ".")
             and "norm" in type(m).__name__.lower() and not any(True for _ in m.children())]
    parent = layers.rpartition(".")[0]
    siblings = [n for n in norms if n.rpartition(".")[0] == parent]
    return (siblings or norms or [None])[0]


# ---------------------------------------------------------------------------------------- counts
def count_params(model: nn.Module) -> int:
    """Every parameter, counted once (tied ones once; works on the meta device)."""
    return sum(p.numel() for p in model.parameters())


def is_matmul(module: nn.Module) -> bool:
    """A module whose weight multiplies activations: ``nn.Linear`` and transformers' ``Conv1D``
    (GPT-2's projections: a Linear with its weight stored transposed)."""
    weight = getattr(module, "weight", None)
    return isinstance(module, nn.Linear) or (type(module).__name__ == "Conv1D" and weight is not None
                                             and weight.ndim == 2)


def count_matmul_params(model: nn.Module) -> int:
    """Parameters that multiply activations in a matmul: every Linear/Conv1D weight (the head
    included, tied to the embedding or not: its matmul runs either way); embeddings, norms and
    biases excluded."""
    return sum(m.weight.numel() for m in model.modules() if is_matmul(m))


def flops_per_token(model: nn.Module, *, seq_len: int) -> int:
    """Training FLOPs per token: 6 * N_matmul + 12 * layers * attention width * seq_len (forward +
    backward; attention scores and values over the full, unmasked sequence, as in PaLM's MFU). With
    grouped-query attention the key/value projections are smaller (N_matmul counts them as they
    are) while the scores still cost the query heads' width. A model that counts its own (the
    energy-flow model: ``optbench.model.energy_kind``) is asked."""
    if callable(own := getattr(model, "flops_per_token", None)):
        return own(seq_len=seq_len)
    parts = decoder_parts(model)
    return 6 * count_matmul_params(model) + 12 * len(blocks_of(model)) * parts.attention_width * seq_len
