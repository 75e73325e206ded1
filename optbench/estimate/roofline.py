"""A named GPU's time for each op of a traced step: a roofline (the op's FLOPs at the card's dense
peak for the dtype it multiplies in, or its bytes at the card's memory bandwidth, whichever is
longer) scaled by efficiencies measured on that card, and never less than the host's time to
launch it (an eager step issues one kernel per op from Python).

Efficiencies are fitted from measured runs (``bench/fit_efficiency.py`` over the runs in
``bench/RESULTS.md``) and stored here with their source (card, torch, date, runs). A card without
measured efficiencies is costed at its datasheet peaks and says "roofline only": no factor is
invented for it.

A compiled block (``compile=``) runs its elementwise ops fused: each run of consecutive non-matmul
ops in a block is costed as one kernel reading the first op's inputs and writing the last op's
outputs (Inductor's fusion, approximated without its codegen).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from optbench.config import Config
from optbench.estimate.ops import Cost, OpCall, OpLog
from optbench.measure import GPU_PEAKS

# HBM bandwidth, datasheets: H100 SXM5 80GB 3.35 TB/s, H200 141GB 4.8 TB/s, A100 SXM4 80GB 2,039 GB/s.
HBM_BYTES_PER_S = {"H100 SXM": 3.35e12, "H200": 4.8e12, "A100": 2.039e12}
# float8 tensor cores (H100/H200 datasheet: 1,979 TFLOP/s dense, twice bf16); the A100 has none.
FLOAT8_PEAK = {"H100 SXM": 1979e12, "H200": 1979e12}


@dataclass(frozen=True)
class Efficiency:
    """Measured fractions of the datasheet peaks, and the host's seconds per eager op."""

    matmul: float  # of the dense peak for the matmul's dtype (attention included)
    memory: float  # of the HBM bandwidth, for memory-bound ops
    host_s: float  # per eager op launched from Python
    source: str


# Fitted by bench/fit_efficiency.py; see bench/RESULTS.md for the runs and the fit's residuals.
EFFICIENCY: dict[str, Efficiency] = {}


class RooflineCosts:
    """Per-op seconds on ``key`` (a GPU_PEAKS card) for ``cfg``'s precision."""

    overlaps_communication = True

    def __init__(self, key: str, *, cfg: Config) -> None:
        self.key = key
        self.tf32 = cfg.precision.tf32
        self.efficiency = EFFICIENCY.get(key)
        self.device = f"{key} (projection)"
        self.method = ("roofline per op with efficiencies measured on this card: " + self.efficiency.source
                       if self.efficiency else
                       f"roofline only: datasheet peaks of the {key}, no efficiency measured on this card")

    def peak(self, dtype: torch.dtype | None) -> float:
        peaks = GPU_PEAKS[self.key]
        if dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            return FLOAT8_PEAK.get(self.key, peaks["bfloat16"])
        if dtype in (torch.bfloat16, torch.float16):
            return peaks["bfloat16"]
        return peaks["tf32" if self.tf32 else "float32"]

    def seconds(self, call: OpCall, cost: Cost) -> float:
        kind = call.kind
        if kind == "view":
            return 0.0
        eff = self.efficiency
        matmul, memory, host = (eff.matmul, eff.memory, eff.host_s) if eff else (1.0, 1.0, 0.0)
        compute = cost.flops / (self.peak(cost.dtype) * matmul) if kind in ("matmul", "attention") else 0.0
        traffic = cost.bytes / (HBM_BYTES_PER_S[self.key] * memory)
        return max(compute, traffic, host)

    def fused_seconds(self, nbytes: int) -> float:
        """One fused kernel moving ``nbytes``."""
        eff = self.efficiency
        memory, host = (eff.memory, eff.host_s) if eff else (1.0, 0.0)
        return max(nbytes / (HBM_BYTES_PER_S[self.key] * memory), host)


def fused_regions(log: OpLog) -> list[tuple[str, int]]:
    """(stage, bytes) of each fused kernel a compiled step runs in its blocks: a run of
    consecutive non-matmul, non-attention ops of one block and phase reads the first op's inputs
    and writes the last op's outputs."""
    regions: list[tuple[str, int]] = []
    run: list[OpCall] = []
    key: tuple | None = None

    def close() -> None:
        if run:
            first, last = run[0], run[-1]
            nbytes = sum(t.nbytes for t in first.tensors()) + log.costs[last].bytes \
                - sum(t.nbytes for t in last.tensors())
            regions.append((key[0], max(0, nbytes)))
            run.clear()

    for stage, phase, block, call in log.calls:
        fusable = block is not None and stage.startswith("micro") and call.kind in ("other", "view")
        here = (stage, phase, block)
        if not fusable or here != key:
            close()
        key = here
        if fusable and call.kind == "other":
            run.append(call)
    close()
    return regions
