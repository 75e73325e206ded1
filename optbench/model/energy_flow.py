"""The energy-flow pipeline of plan 003 as a module: teacher embedding -> ``EmbeddingMapper`` (the
lattice's surface, one value per cell) -> ``FlowProcessor`` (flows carry energy from the surface
through a width x height x depth lattice) -> the output surface -> ``readout`` (back to the
embedding width).

A flow starts at its own surface cell with energy ``surface value x inject``. Each step, for every
flow not yet arrived: the ``SimpleNeuron`` reads the state of the cell the flow is in (a learned
vector per cell) and the flow's energy; the ``EnergyCarrier`` (the GRU equations, one step, several
layers) updates the flow's hidden state and emits its new energy (``tanh(energy + delta)``), a
lateral move (stay, +x, -x, +y, -y; the largest logit) and whether it advances one cell in depth (a
positive logit). A flow that reaches the depth has arrived and is frozen. After the last step each
flow deposits ``energy . emit`` on the output surface at its (x, y).

The plan's optimizations are forms of the same computation (``FlowProcessor(flows=, stop=)``):
``flows="loop"`` runs the step on each flow in a Python loop (the plan's ``for flow in
active_flows``), ``"vectorized"`` on all flows at once; both give the same outputs and gradients.
``stop="fixed"`` runs ``max_steps`` steps; ``"adaptive"`` stops once the share of settled flows
(arrived, or whose energy turned by less than the threshold: cosine(new, old) >= threshold) has
been at least ``threshold`` for ``patience`` steps in a row: a host read each step, as the plan's
``check_convergence``. On FakeTensors (the estimate) there is nothing to read: the trace runs the
``max_steps`` bound. docs/energy-flow.md gives each reading of the plan.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

FLOPS_SOURCE = "3 x 2 x (mapper + readout + (neuron + carrier) x flows per sample x max_steps) matmul params"

# lateral moves: stay, +x, -x, +y, -y
MOVES = ((0, 0), (1, 0), (-1, 0), (0, 1), (0, -1))


class EmbeddingMapper(nn.Module):
    """768 -> one value per surface cell, in (-1, 1)."""

    def __init__(self, embed_dim: int, cells: int) -> None:
        super().__init__()
        self.proj = nn.Linear(embed_dim, cells)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.proj(x))


class SimpleNeuron(nn.Module):
    """The flow's cell state and energy -> the carrier's input."""

    def __init__(self, cell_dim: int, energy_dim: int, out_dim: int) -> None:
        super().__init__()
        self.linear = nn.Linear(cell_dim + energy_dim, out_dim)

    def forward(self, cell: torch.Tensor, energy: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.linear(torch.cat([cell, energy], dim=-1)))


class EnergyCarrier(nn.Module):
    """A GRU of ``layers`` layers run one step (torch.nn.GRU's equations, written with Linear
    layers so that compile, FSDP2 and the FLOP count see plain matmuls), then a linear head: the
    energy's change, the move logits and the advance logit."""

    def __init__(self, in_dim: int, hidden: int, layers: int, energy_dim: int) -> None:
        super().__init__()
        self.inputs = nn.ModuleList(nn.Linear(in_dim if i == 0 else hidden, 3 * hidden) for i in range(layers))
        self.hiddens = nn.ModuleList(nn.Linear(hidden, 3 * hidden) for _ in range(layers))
        self.head = nn.Linear(hidden, energy_dim + len(MOVES) + 1)

    def forward(self, x: torch.Tensor, hidden: list[torch.Tensor]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        new = []
        for w_in, w_h, h in zip(self.inputs, self.hiddens, hidden, strict=True):
            xr, xz, xn = w_in(x).chunk(3, dim=-1)
            hr, hz, hn = w_h(h).chunk(3, dim=-1)
            r, z = torch.sigmoid(xr + hr), torch.sigmoid(xz + hz)
            n = torch.tanh(xn + r * hn)
            x = (1 - z) * n + z * h
            new.append(x)
        return self.head(x), new


class FlowProcessor(nn.Module):
    """The lattice and its flows (see the module docstring): ``forward(surface) -> (output surface,
    steps used)``."""

    def __init__(self, *, width: int, height: int, depth: int, flows_per_sample: int, cell_dim: int,
                 energy_dim: int, neuron_dim: int, hidden: int, layers: int, max_steps: int, flows: str = "vectorized",
                 stop: str = "fixed", threshold: float = 0.95, patience: int = 3) -> None:
        super().__init__()
        self.width, self.height, self.depth = width, height, depth
        self.flows_per_sample, self.max_steps = flows_per_sample, max_steps
        self.flows, self.stop, self.threshold, self.patience = flows, stop, threshold, patience
        self.hidden_size, self.layers, self.energy_dim = hidden, layers, energy_dim
        self.cells = nn.Parameter(torch.empty(depth, width * height, cell_dim))
        self.inject = nn.Parameter(torch.empty(energy_dim))
        self.emit = nn.Parameter(torch.empty(energy_dim))
        self.neuron = SimpleNeuron(cell_dim, energy_dim, neuron_dim)
        self.carrier = EnergyCarrier(neuron_dim, hidden, layers, energy_dim)

    def reset_parameters(self) -> None:
        nn.init.normal_(self.cells)
        nn.init.normal_(self.inject)
        nn.init.normal_(self.emit, std=1 / math.sqrt(self.energy_dim))

    def starts(self, device: torch.device) -> torch.Tensor:
        """Each sample's flows start at these surface cells, spread evenly over the surface."""
        cells = self.width * self.height
        return torch.linspace(0, cells - 1, self.flows_per_sample, device=device).round().long()

    def step(self, energy: torch.Tensor, hidden: list[torch.Tensor], xy: torch.Tensor,
             z: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor, torch.Tensor]:
        """One step of the flows given (any number of them: all, or one in the loop form)."""
        cell = self.cells[z.clamp(max=self.depth - 1), xy]
        out, hidden = self.carrier(self.neuron(cell, energy), hidden)
        delta, moves, advance = out.split([self.energy_dim, len(MOVES), 1], dim=-1)
        table = torch.tensor(MOVES, device=xy.device)[moves.argmax(dim=-1)]
        x = (xy % self.width + table[:, 0]).clamp(0, self.width - 1)
        y = (xy // self.width + table[:, 1]).clamp(0, self.height - 1)
        return torch.tanh(energy + delta), hidden, y * self.width + x, z + (advance[:, 0] > 0).long()

    def _step_all(self, energy, hidden, xy, z):  # noqa: ANN001, ANN202 - as step
        if self.flows == "vectorized":
            return self.step(energy, hidden, xy, z)
        parts = [self.step(energy[i:i + 1], [h[i:i + 1] for h in hidden], xy[i:i + 1], z[i:i + 1])
                 for i in range(energy.shape[0])]  # the plan's `for flow in active_flows`
        return (torch.cat([p[0] for p in parts]), [torch.cat([p[1][k] for p in parts]) for k in range(self.layers)],
                torch.cat([p[2] for p in parts]), torch.cat([p[3] for p in parts]))

    def forward(self, surface: torch.Tensor) -> tuple[torch.Tensor, int]:
        batch, cells = surface.shape
        starts = self.starts(surface.device)
        flows = batch * self.flows_per_sample
        energy = surface[:, starts].reshape(flows, 1) * self.inject
        hidden = [surface.new_zeros(flows, self.hidden_size) for _ in range(self.layers)]
        xy, z = starts.repeat(batch), torch.zeros(flows, dtype=torch.long, device=surface.device)
        settled_for, used = 0, 0
        for used in range(1, self.max_steps + 1):  # noqa: B007 - ``used`` is read after the loop
            alive = z < self.depth
            new_energy, new_hidden, new_xy, new_z = self._step_all(energy, hidden, xy, z)
            keep = alive[:, None]
            turned = F.cosine_similarity(new_energy, energy, dim=-1) < self.threshold
            energy = torch.where(keep, new_energy, energy)
            hidden = [torch.where(keep, new, old) for new, old in zip(new_hidden, hidden, strict=True)]
            xy, z = torch.where(alive, new_xy, xy), torch.where(alive, new_z, z)
            if self.stop == "adaptive" and not _is_fake(surface):
                settled = ((z >= self.depth) | ~turned).float().mean()
                settled_for = settled_for + 1 if float(settled) >= self.threshold else 0  # the host read
                if settled_for >= self.patience:
                    break
        deposit = energy @ self.emit.to(energy.dtype)
        index = torch.arange(batch, device=surface.device).repeat_interleave(self.flows_per_sample) * cells + xy
        out = deposit.new_zeros(batch * cells).index_add(0, index, deposit)
        return out.view(batch, cells), used


def _is_fake(tensor: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import is_fake

    return is_fake(tensor)


class PerSampleForwards(nn.Module):
    """The plan's text bridge's forwards: the whole model run again on each sample alone. A module
    of the model (no parameters) so that memory trackers see the repeated forwards inside it, as
    nested calls, not as a second training iteration."""

    def forward(self, model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([model(x[i:i + 1]) for i in range(x.shape[0])])


class EnergyFlowModel(nn.Module):
    """mapper -> blocks[0] (the flow processor) -> readout. ``blocks`` is the container every optimization group
    wraps (activation checkpointing, compile, FSDP2), as a transformer's layers. ``last_steps``:
    the flow steps the last forward used."""

    def __init__(self, *, embed_dim: int, processor: FlowProcessor) -> None:
        super().__init__()
        cells = processor.width * processor.height
        self.mapper = EmbeddingMapper(embed_dim, cells)
        self.blocks = nn.ModuleList([processor])
        self.readout = nn.Linear(cells, embed_dim)
        self.bridge = PerSampleForwards()
        self.last_steps = 0

    def surface(self, x: torch.Tensor) -> torch.Tensor:
        """The output surface of ``x``'s flows."""
        out, self.last_steps = self.blocks[0](self.mapper(x))
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.readout(self.surface(x))

    def init_weights(self) -> None:
        for module in self.modules():
            if isinstance(module, (nn.Linear, FlowProcessor)):
                module.reset_parameters()

    def flops_per_token(self, *, seq_len: int = 1) -> int:
        """Training FLOPs per sample (a "token" of this model is a sample; ``seq_len`` is 1): 3x the
        forward's matmuls, the mapper and the readout once and the neuron and carrier once per flow
        and step, at the ``max_steps`` bound (adaptive stopping runs fewer: the bound is what MFU is
        counted against). The cell lookups, the moves and the deposit are not matmuls (not counted)."""
        processor = _unwrapped(self.blocks[0])
        per_step = sum(m.weight.numel() for part in (processor.neuron, processor.carrier)
                       for m in part.modules() if isinstance(m, nn.Linear))
        outside = self.mapper.proj.weight.numel() + self.readout.weight.numel()
        return 3 * 2 * (outside + per_step * processor.flows_per_sample * processor.max_steps) * seq_len


def _unwrapped(module: nn.Module) -> nn.Module:
    """The module inside activation checkpointing's or compile's wrapper."""
    while True:
        inner = module._modules.get("_checkpoint_wrapped_module") or module._modules.get("_orig_mod")
        if inner is None:
            return module
        module = inner


def flow_processor(model: nn.Module) -> FlowProcessor:
    """The ``FlowProcessor`` of ``model`` (an ``EnergyFlowModel``, wrapped by DDP or not)."""
    model = getattr(model, "module", model)
    processor = _unwrapped(model.blocks[0])
    assert isinstance(processor, FlowProcessor), f"{type(processor).__name__} is no FlowProcessor"
    return processor
