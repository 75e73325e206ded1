"""Schemas of the energy-flow pipeline (plan 003; ``optbench.model.energy_flow``,
``optbench.tasks.energy_flow``): the model's lattice and carrier (``model=energy_*``), the task's
forms of the plan's optimizations (``task=energy_flow`` and the ``flows``/``flow_stop``/``bridge``
groups that set its keys), and its data (``data=embeddings``, ``data=energy_synthetic``).
docs/energy-flow.md says how each vague passage of the plan is read."""

from __future__ import annotations

import math
from dataclasses import dataclass

from omegaconf import MISSING

from optbench.config.checks import finite, one_of, positive
from optbench.config.data import DataConfig
from optbench.config.model import ModelConfig
from optbench.config.tasks import TaskConfig
from optbench.errors import ConfigError

FLOW_FORMS = ("vectorized", "loop")
STOP_FORMS = ("fixed", "adaptive")
BRIDGE_FORMS = ("batched", "per_sample", "none")
LOAD_FORMS = ("device", "memmap")


@dataclass
class EnergyFlowModelConfig(ModelConfig):
    """The plan's ``EnergyConfig``: a ``lattice_width`` x ``lattice_height`` x ``lattice_depth``
    lattice; ``max_active_flows`` flows in the lattice at once for a micro-batch of
    ``train.batch_size`` samples (so ``max_active_flows // train.batch_size`` per sample, each
    starting at its own surface cell); a GRU energy carrier of ``carrier_num_layers`` layers of
    ``carrier_hidden_size``; at most ``max_steps`` steps. ``embed_dim``: the teacher embeddings'
    width (768 in the plan). ``cell_dim``: each cell's learned state; ``energy_dim``: a flow's
    energy vector; ``neuron_dim``: the simple neuron's output (the carrier's input).

    The transformer's shape fields (``dim``, ``layers``, ...) are derived (the carrier's width, one
    block: the flow processor) so the rest of optbench reads them as for any model; setting one
    by hand is refused."""

    name: str = "energy_flow"
    dim: int = 0
    layers: int = 0
    heads: int = 0
    ffn_dim: int = 0
    vocab_size: int = 0
    lattice_width: int = 50
    lattice_height: int = 50
    lattice_depth: int = 20
    max_active_flows: int = 5000
    carrier_hidden_size: int = 512
    carrier_num_layers: int = 2
    max_steps: int = 50
    embed_dim: int = 768
    cell_dim: int = 16
    energy_dim: int = 8
    neuron_dim: int = 64

    def __post_init__(self) -> None:
        positive(**{f"model.{key}": getattr(self, key) for key in (
            "lattice_width", "lattice_height", "lattice_depth", "max_active_flows", "carrier_hidden_size",
            "carrier_num_layers", "max_steps", "embed_dim", "cell_dim", "energy_dim", "neuron_dim")})
        finite(**{"model.init_std": self.init_std})
        derived = {"dim": self.carrier_hidden_size, "layers": 1, "heads": 1, "ffn_dim": self.neuron_dim,
                   "vocab_size": 1}
        for key, value in derived.items():
            given = getattr(self, key)
            if given and given != value:
                raise ConfigError(f"model.{key}={given} is not an energy-flow model's key (it is derived: {value}); "
                                  "set model.carrier_hidden_size, model.neuron_dim or the lattice keys instead")
            setattr(self, key, value)

    @property
    def surface_cells(self) -> int:
        return self.lattice_width * self.lattice_height

    def flows_per_sample(self, batch_size: int) -> int:
        return self.max_active_flows // batch_size

    def block_period(self) -> int:
        return 1

    def with_layers(self, layers: int) -> EnergyFlowModelConfig:
        return self  # one block: the flow processor (nothing to stack)


@dataclass
class EnergyFlowTaskConfig(TaskConfig):
    """Teacher embedding in, teacher embedding of the target out (MSE; eval: the loss, the cosine
    similarity and the text bridge's accuracy). The plan's optimizations as forms, each a group that
    sets its key: ``flows`` (``flows=loop|vectorized``: a Python loop over the flows, or all at
    once), ``stop`` (``flow_stop=fixed|adaptive``: ``model.max_steps`` steps, or stop once the
    share of settled flows has stayed at least ``threshold`` for ``patience`` steps), ``bridge``
    (``bridge=per_sample|batched|none``: the text bridge re-runs the flow forward once per sample,
    as the plan's code does, or decodes the surface already computed)."""

    name: str = "energy_flow"
    flows: str = "vectorized"
    stop: str = "fixed"
    threshold: float = 0.95
    patience: int = 3
    bridge: str = "batched"

    def __post_init__(self) -> None:
        one_of("task.flows", self.flows, FLOW_FORMS)
        one_of("task.stop", self.stop, STOP_FORMS)
        one_of("task.bridge", self.bridge, BRIDGE_FORMS)
        if not (math.isfinite(self.threshold) and 0.0 < self.threshold <= 1.0):
            raise ConfigError(f"task.threshold must be a finite share in (0, 1], got {self.threshold}; "
                              "the plan uses task.threshold=0.95")
        positive(**{"task.patience": self.patience})


@dataclass
class EmbeddingsDataConfig(DataConfig):
    """Teacher embeddings ``optbench data embed PAIRS.jsonl OUT --encoder DIR`` wrote (``OUT``: a
    float32 memory-mapped file of (count, 2, width), input and target; ``OUT.json``: its sidecar).
    ``load``: ``device`` reads the whole file onto the training device first (the plan's
    ``torch.load(map_location='cuda')``), ``memmap`` streams samples from the mapped file; null: as
    the dataloader group says (``dataloader=baseline``: device; any other: memmap)."""

    name: str = "embeddings"
    path: str = MISSING
    eval_fraction: float = 0.1
    load: str | None = None

    def __post_init__(self) -> None:
        if not 0.0 < self.eval_fraction < 1.0:
            raise ConfigError(f"data.eval_fraction must be in (0, 1), got {self.eval_fraction}")
        if self.load is not None:
            one_of("data.load", self.load, LOAD_FORMS)


@dataclass
class EnergySyntheticDataConfig(DataConfig):
    """Seeded pairs for ``task=energy_flow`` without an encoder: inputs drawn from a normal
    distribution, targets a fixed random nonlinear map of them (learnable), texts ``input i`` /
    ``target i``. ``load`` as for ``data=embeddings``."""

    name: str = "energy_synthetic"
    num_samples: int = 512
    eval_fraction: float = 0.1
    load: str | None = None

    def __post_init__(self) -> None:
        positive(**{"data.num_samples": self.num_samples})
        if not 0.0 < self.eval_fraction < 1.0:
            raise ConfigError(f"data.eval_fraction must be in (0, 1), got {self.eval_fraction}")
        if self.load is not None:
            one_of("data.load", self.load, LOAD_FORMS)
