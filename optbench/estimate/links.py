"""The link collectives run over, as the speed prediction uses it (``optbench.estimate.speed.Link``):
stated for a GPU (NVLink per direction, from NVIDIA's datasheets, unless ``estimate.link_gbps``
states another), measured for this machine's CPU ranks (gloo all-reduces between local processes,
cached like the CPU's matmul ceiling).
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from typing import Any

import torch

from optbench.caches import cache_dir, note_reused
from optbench.estimate.speed import Link
from optbench.provenance import cpu_name

GB = 1e9
# NVLink bandwidth per direction per GPU (datasheets: H100/H200 SXM 900 GB/s and A100 SXM 600 GB/s,
# both directions together); NCCL's ring collectives reach a bus bandwidth near it on one node.
NVLINK_BYTES_PER_S = {"H100 SXM": 450 * GB, "H200": 450 * GB, "A100": 300 * GB}
NVLINK_LATENCY_S = 20e-6  # one NCCL collective launch on a node, order of magnitude
GLOO_BYTES = 8 * 2**20  # the message a CPU link is measured with


def gpu_link(key: str, *, stated_gbps: float | None) -> Link:
    if stated_gbps is not None:
        return Link(stated_gbps * GB, NVLINK_LATENCY_S, f"estimate.link_gbps={stated_gbps:g} GB/s per rank (stated)")
    bandwidth = NVLINK_BYTES_PER_S[key]
    return Link(bandwidth, NVLINK_LATENCY_S,
                f"NVLink {bandwidth / GB:.0f} GB/s per direction ({key} datasheet; override with estimate.link_gbps)")


def machine_link(world: int, *, stated_gbps: float | None) -> Link:
    """This machine's CPU ranks: a gloo all-reduce between ``world`` local processes, measured once
    and cached under ~/.cache/optbench."""
    if stated_gbps is not None:
        return Link(stated_gbps * GB, 0.0, f"estimate.link_gbps={stated_gbps:g} GB/s per rank (stated)")
    key = f"{cpu_name()}|world={world}|torch={torch.__version__}|median"  # entries before 2026-11-27: fastest
    cache = cache_dir() / "gloo_link.json"
    try:
        table = json.loads(cache.read_text())
    except (OSError, ValueError):
        table = {}
    if key not in table:
        table[key] = measure_gloo(world)
        try:
            cache.parent.mkdir(parents=True, exist_ok=True)
            cache.write_text(json.dumps(table, indent=2))
        except OSError:
            pass
    else:
        note_reused("gloo_link", f"gloo all-reduce bandwidth between {world} local processes", cache,
                    table[key].get("measured_at"), override="estimate.link_gbps=N to state one")
    entry = table[key]
    return Link(entry["bytes_per_s"], entry["latency_s"],
                f"gloo all-reduce between {world} local processes, measured {entry['measured_at']} "
                f"({entry['bytes_per_s'] / GB:.2f} GB/s bus bandwidth, cached in {cache})")


def group_link() -> Link:
    """The link of the distributed job this process is a rank of: all-reduces on its own default
    group, timed now (every rank must call this together, as every rank of ``optbench train`` does)."""
    import torch.distributed as dist

    seconds = _time_allreduces(dist)
    world = dist.get_world_size()
    bandwidth = 2 * (world - 1) / world * GLOO_BYTES / max(seconds["big"] - seconds["small"], 1e-9)
    return Link(bandwidth, seconds["small"], f"all-reduces on this job's {dist.get_backend()} group of {world} "
                f"ranks, timed before the run ({bandwidth / GB:.2f} GB/s bus bandwidth)")


def _time_allreduces(dist: Any) -> dict[str, float]:
    """The median of 5 all-reduces of one element and of ``GLOO_BYTES``, after one of each."""
    seconds = {}
    for name, numel in (("small", 1), ("big", GLOO_BYTES // 4)):
        tensor = torch.ones(numel)
        dist.all_reduce(tensor)
        took = []
        for _ in range(5):
            dist.barrier()
            start = time.perf_counter()
            dist.all_reduce(tensor)
            took.append(time.perf_counter() - start)
        seconds[name] = statistics.median(took)
    return seconds


def measure_gloo(world: int) -> dict[str, Any]:
    """Bus bandwidth and latency of gloo all-reduces among ``world`` local processes (median of a few)."""
    import torch.multiprocessing as mp

    from optbench.files import timestamp

    with tempfile.TemporaryDirectory(prefix="optbench-gloo-") as tmp:
        store = os.path.join(tmp, "store")
        result = os.path.join(tmp, "result.json")
        mp.spawn(_gloo_rank, args=(world, store, result), nprocs=world, join=True)
        with open(result) as handle:
            seconds = json.load(handle)
    share = 2 * (world - 1) / world
    bandwidth = share * GLOO_BYTES / max(seconds["big"] - seconds["small"], 1e-9)
    return {"bytes_per_s": bandwidth, "latency_s": seconds["small"], "measured_at": timestamp()}


def _gloo_rank(rank: int, world: int, store: str, result: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        seconds = _time_allreduces(dist)
        if rank == 0:
            with open(result, "w") as handle:
                json.dump(seconds, handle)
    finally:
        dist.destroy_process_group()
