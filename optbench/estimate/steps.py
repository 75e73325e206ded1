"""A traced step's figures (``optbench.estimate.memtrace`` traces them): bytes per component at a
moment (``Snapshot``), and a step's peaks before and during the optimizer step (``StepTrace``)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from optbench.estimate.ops import StepOps

# What the estimate reports, per device; the trackers' categories map onto these.
COMPONENTS = (
    "parameters", "gradients", "optimizer_states", "activations", "temporaries", "fsdp_buffers",
    "ddp_buckets", "other", "cuda_workspaces",
)

# FSDP2's CPUOffloadPolicy keeps these in host memory (and steps the optimizer there).
HOST_COMPONENTS = frozenset({"parameters", "gradients", "optimizer_states"})
# ``Snapshot.phase`` of a moment inside the optimizer step (the others: "forward", "backward")
OPTIMIZER_STEP = "optimizer step"


@dataclass
class Snapshot:
    """Bytes per component at one moment, and where in the step that moment was; components in
    ``host`` live in host memory and are not part of the device total."""

    components: dict[str, int]
    phase: str = "forward"
    module: str | None = None
    host: frozenset[str] = frozenset()

    @property
    def total(self) -> int:
        """Device bytes."""
        return sum(v for k, v in self.components.items() if k not in self.host)

    @property
    def host_total(self) -> int:
        return sum(v for k, v in self.components.items() if k in self.host)

    def plus(self, component: str, nbytes: int) -> Snapshot:
        components = dict(self.components)
        components[component] += nbytes
        return dataclasses.replace(self, components=components)


@dataclass
class StepTrace:
    """One traced step: the peak before ``optimizer.step()`` (forward, backward, clipping), the peak
    during it (None when the optimizer lives on the host), and the optimizer-state bytes it left."""

    micro_batch: int
    before_step: Snapshot
    during_step: Snapshot | None
    state_bytes: int
    extra: dict[str, int] = field(default_factory=dict)  # modeled, not traced (DDP buckets)
    method: str = "the whole model traced"
    ops: StepOps | None = None  # every op of the step, when asked for (the speed prediction)
    activation_peak: int = 0  # the most activation bytes held at any moment (the end of the forward)

    def host_peak(self) -> int:
        """Host bytes of the traced components that live there (FSDP2 CPUOffloadPolicy), at their
        largest: in the optimizer step, when the gradient shards, the parameter shards and the
        optimizer states are all there (the snapshots are taken at the device's peaks, which need
        not be the host's, so the largest parameter + gradient bytes are added to the states)."""
        if not self.before_step.host:
            return 0
        snaps = [self.before_step] + ([self.during_step] if self.during_step is not None else [])
        return max(s.components["parameters"] + s.components["gradients"] for s in snaps) + self.state_bytes

    def steady_peak(self) -> Snapshot:
        """The peak of every step after the first (optimizer states allocated)."""
        peak = self.before_step.plus("optimizer_states", self.state_bytes)
        if self.during_step is not None and self.during_step.total > peak.total:
            peak = self.during_step
        for component, nbytes in self.extra.items():
            peak = peak.plus(component, nbytes)
        return peak


def split_step_temporaries(peak: Snapshot, *, state_bytes: int) -> Snapshot:
    """MemTracker files everything the optimizer step allocates under optimizer states; what exceeds
    the states that remain after the step are the step's temporaries (foreach intermediates)."""
    excess = max(0, peak.components["optimizer_states"] - state_bytes)
    return peak.plus("optimizer_states", -excess).plus("temporaries", excess)
