"""A named GPU's time for each op of a traced step: a roofline (the op's FLOPs at the card's dense
peak for the dtype it multiplies in, or its bytes at the card's memory bandwidth, whichever is
longer) scaled by efficiencies measured on that card, and never less than the host's time to
launch it (an eager step issues one kernel per op from Python).

Efficiencies are fitted from measured runs (``bench/fit_efficiency.py`` over the runs in
``bench/RESULTS.md``) and stored here with their source (card, torch, date, runs). A card without
measured efficiencies is costed at its datasheet peaks and says "roofline only": no factor is
invented for it.

A compiled block (``compile=``) runs its elementwise ops fused: the ops whose results Inductor
keeps in registers (``optbench.estimate.compiled_memory``) cost nothing, each remaining one is
costed as the kernel that writes its result (its own reads and writes).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from optbench.config import Config
from optbench.estimate.ops import Cost, OpCall
from optbench.measure import GPU_PEAKS

# HBM bandwidth, datasheets: H100 SXM5 80GB 3.35 TB/s, H200 141GB 4.8 TB/s, A100 SXM4 80GB 2,039 GB/s.
HBM_BYTES_PER_S = {"H100 SXM": 3.35e12, "H200": 4.8e12, "A100": 2.039e12}
# float8 tensor cores (H100/H200 datasheet: 1,979 TFLOP/s dense, twice bf16); the A100 has none.
FLOAT8_PEAK = {"H100 SXM": 1979e12, "H200": 1979e12}


@dataclass(frozen=True)
class Efficiency:
    """Measured fractions of the datasheet peaks, and the host's seconds per launched kernel."""

    matmul: dict[str, float]  # of the dense peak, per peak the matmul runs at (float32, tf32, bfloat16)
    memory: float  # of the HBM bandwidth, for memory-bound ops
    host_s: float  # per kernel launched from Python
    source: str
    matmul_latency_s: float = 0.0  # added to every matmul and attention kernel (small ones reach less of the peak)


def efficiency_for(key: str) -> Efficiency | None:
    """The efficiencies measured on ``key`` (``optbench.estimate.efficiency``, written by
    ``bench/fit_efficiency.py``), or None: a card nobody measured."""
    from optbench.estimate.efficiency import EFFICIENCY

    entry = EFFICIENCY.get(key)
    return None if entry is None else Efficiency(**entry)


class RooflineCosts:
    """Per-op seconds on ``key`` (a GPU_PEAKS card) for ``cfg``'s precision."""

    overlaps_communication = True

    def __init__(self, key: str, *, cfg: Config) -> None:
        self.key = key
        self.tf32 = cfg.precision.tf32
        self.efficiency = efficiency_for(key)
        self.device = f"{key} (projection)"
        self.method = ("roofline per op with efficiencies measured on this card: " + self.efficiency.source
                       if self.efficiency else
                       f"roofline only: datasheet peaks of the {key}, no efficiency measured on this card")

    def peak(self, dtype: torch.dtype | None) -> tuple[str, float]:
        """(the efficiency's key, the dense peak) for a matmul whose operands are ``dtype``: float8
        at the float8 peak with bf16's efficiency (no float8 run was measured eager)."""
        peaks = GPU_PEAKS[self.key]
        if dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            return "bfloat16", FLOAT8_PEAK.get(self.key, peaks["bfloat16"])
        if dtype in (torch.bfloat16, torch.float16):
            return "bfloat16", peaks["bfloat16"]
        name = "tf32" if self.tf32 else "float32"
        return name, peaks[name]

    def seconds(self, call: OpCall, cost: Cost) -> float:
        kind = call.kind
        if kind == "view":
            return 0.0
        eff = self.efficiency
        compute = 0.0
        if kind in ("matmul", "attention"):
            name, peak = self.peak(cost.dtype)
            compute = cost.flops / (peak * (eff.matmul[name] if eff else 1.0)) + (eff.matmul_latency_s if eff else 0.0)
        traffic = cost.bytes / (HBM_BYTES_PER_S[self.key] * (eff.memory if eff else 1.0))
        return max(compute, traffic, eff.host_s if eff else 0.0)

