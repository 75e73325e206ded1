"""Honest measurement: synchronized step timing, robust statistics, the FLOP/s peak behind MFU,
and peak memory.

* Every clock read is preceded by a device synchronize (``synchronize``), so the time of a step is
  the time of its kernels, not of their launches.
* Warm-up steps (compilation, allocator growth, first optimizer-state allocation) are excluded by
  the caller; figures are medians with p10/p90 spread.
* MFU divides achieved FLOP/s by the peak of the dtype the matmuls really ran in. A known GPU uses
  its datasheet peak; a CPU has no datasheet, so its fp32/bf16 matmul ceiling is measured once with
  a few large matmuls and cached per machine; an unknown GPU gets its measured matmul ceiling, named
  as such; ``measure.peak_tflops`` gives the peak instead.
"""

from __future__ import annotations

import json
import logging
import os
import resource
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from optbench.caches import cache_dir, note_reused
from optbench.files import timestamp
from optbench.provenance import cpu_name

log = logging.getLogger(__name__)

# Dense (no sparsity) datasheet peaks in FLOP/s, per dtype the matmuls run in ("float32": the
# non-tensor-core rate; "tf32" where the card has TF32 tensor cores; GeForce cards: FP16/BF16 tensor
# rates with FP32 accumulation, as torch's matmuls accumulate). Where a datasheet gives only the
# sparse rate, half of it. Sources, as published by the vendor:
#   H100 SXM/PCIe/NVL: NVIDIA H100 Tensor Core GPU datasheet; H200: NVIDIA H200 datasheet;
#   A100: NVIDIA A100 datasheet (SXM and PCIe alike); L4: NVIDIA L4 datasheet;
#   B200: NVIDIA HGX B200 / DGX B200 datasheet (8-GPU figures / 8: BF16 18 PF sparse -> 2.25 PF dense);
#   H20: NVIDIA H20 product brief (FP32 44 TF, TF32 74 TF, BF16/FP16 148 TF dense);
#   L40S: NVIDIA L40S datasheet (FP32 91.6 TF, TF32 183 TF, BF16/FP16 362.05 TF dense);
#   L40: NVIDIA L40 datasheet (FP32 90.5 TF, TF32 90.5 TF, BF16/FP16 181.05 TF dense);
#   A10: NVIDIA A10 datasheet (FP32 31.2 TF, TF32 62.5 TF, BF16/FP16 125 TF dense);
#   MI300X / MI325X: AMD Instinct MI300X / MI325X datasheets (FP32 163.4 TF, TF32 653.7 TF,
#   BF16/FP16 1307.4 TF dense); MI250X: AMD Instinct MI250X datasheet (FP32 matrix 95.7 TF, BF16/FP16 383 TF);
#   RTX 5090: NVIDIA RTX Blackwell GPU architecture whitepaper, appendix (FP32 104.8 TF, TF32 104.8 TF,
#   FP16/BF16 with FP32 accumulate 209.5 TF dense);
#   RTX 4090: NVIDIA Ada GPU architecture whitepaper, appendix (FP32 82.6 TF, TF32 82.6 TF,
#   FP16/BF16 with FP32 accumulate 165.2 TF dense).
# A card not here gets a measured matmul ceiling (``measured_gpu_peak``), or measure.peak_tflops.
GPU_PEAKS: dict[str, dict[str, float]] = {
    "H100 SXM": {"bfloat16": 989e12, "float16": 989e12, "tf32": 494.5e12, "float32": 66.9e12},
    "H100 PCIe": {"bfloat16": 756e12, "float16": 756e12, "tf32": 378e12, "float32": 51.2e12},
    "H100 NVL": {"bfloat16": 835e12, "float16": 835e12, "tf32": 417.5e12, "float32": 60e12},
    "H200": {"bfloat16": 989e12, "float16": 989e12, "tf32": 494.5e12, "float32": 66.9e12},
    "A100": {"bfloat16": 312e12, "float16": 312e12, "tf32": 156e12, "float32": 19.5e12},
    "L4": {"bfloat16": 121e12, "float16": 121e12, "tf32": 60e12, "float32": 30.3e12},
    "B200": {"bfloat16": 2250e12, "float16": 2250e12, "tf32": 1100e12, "float32": 75e12},
    "H20": {"bfloat16": 148e12, "float16": 148e12, "tf32": 74e12, "float32": 44e12},
    "L40S": {"bfloat16": 362.05e12, "float16": 362.05e12, "tf32": 183e12, "float32": 91.6e12},
    "L40": {"bfloat16": 181.05e12, "float16": 181.05e12, "tf32": 90.5e12, "float32": 90.5e12},
    "A10": {"bfloat16": 125e12, "float16": 125e12, "tf32": 62.5e12, "float32": 31.2e12},
    "MI300X": {"bfloat16": 1307.4e12, "float16": 1307.4e12, "tf32": 653.7e12, "float32": 163.4e12},
    "MI325X": {"bfloat16": 1307.4e12, "float16": 1307.4e12, "tf32": 653.7e12, "float32": 163.4e12},
    "MI250X": {"bfloat16": 383e12, "float16": 383e12, "tf32": 95.7e12, "float32": 95.7e12},
    "RTX 5090": {"bfloat16": 209.5e12, "float16": 209.5e12, "tf32": 104.8e12, "float32": 104.8e12},
    "RTX 4090": {"bfloat16": 165.2e12, "float16": 165.2e12, "tf32": 82.6e12, "float32": 82.6e12},
}
# (a word of torch.cuda.get_device_name(), the GPU_PEAKS key), checked in this order: a longer
# name first (H200 before H20, A100 before A10, L40S before L40)
GPU_NAMES = (("H200", "H200"), ("B200", "B200"), ("A100", "A100"), ("L40S", "L40S"), ("L40", "L40"),
             ("MI300X", "MI300X"), ("MI325X", "MI325X"), ("MI250X", "MI250X"), ("RTX 5090", "RTX 5090"),
             ("RTX 4090", "RTX 4090"), ("H20", "H20"), ("A10", "A10"), ("L4", "L4"))


def gpu_peak_key(device_name: str) -> str | None:
    """Map torch.cuda.get_device_name() to a GPU_PEAKS key; None when the card is not known."""
    name = device_name.upper()
    words = name.replace("-", " ").split()
    if "H100" in name:
        if "PCIE" in name:
            return "H100 PCIe"
        if "NVL" in name:
            return "H100 NVL"
        return "H100 SXM"  # "NVIDIA H100 80GB HBM3" is the SXM part
    for word, key in GPU_NAMES:
        if " " in word and word in name:
            return key
        if word in words:  # a whole word: "A10" is not "A10G" (another card) nor "A100"
            return key
    return None


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed_matmuls(a: torch.Tensor, b: torch.Tensor, device: torch.device, repeats: int) -> list[float]:
    """Seconds of ``repeats`` timed ``a @ b``, each synchronized on both sides, after one untimed."""
    times = []
    for index in range(repeats + 1):
        synchronize(device)
        start = time.perf_counter()
        torch.mm(a, b)
        synchronize(device)
        if index:
            times.append(time.perf_counter() - start)
    return times


@dataclass
class Peak:
    flops: float | None
    source: str


CEILING_REPEATS = 5  # timed matmuls of a full measurement, after one warm-up; the best one is the ceiling
CEILING_MAX_SIZE = 2048
CEILING_SIZE_S = 0.02  # the size doubles from 256 while one matmul, on ONE thread, takes under this
MIN_SPREAD = 0.05  # a re-check must beat the ceiling by more than max(this, its measured spread) to look off


def ceiling_size(dtype: torch.dtype, *, max_size: int = CEILING_MAX_SIZE) -> int:
    """The matrix size of this dtype's ceiling on this CPU: n doubles from 256 while one n^3 matmul on
    one thread takes under ``CEILING_SIZE_S``, up to ``max_size``. Chosen on one thread, whatever
    the process's thread count, and then kept for every thread count (``cpu_peak``): the ceilings of
    a 1-thread FSDP2 rank and of a 2-thread process are measured the same way, so their MFUs compare.
    A dtype this CPU runs without native kernels (bf16 without AVX512-BF16/AMX) stays small."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        size = 256
        while size < max_size:
            a, b = _operands(size, dtype)
            _matmul_seconds(a, b)  # warm-up
            if _matmul_seconds(a, b) >= CEILING_SIZE_S:
                break
            size *= 2
    finally:
        torch.set_num_threads(threads)
    return size


def measure_cpu_matmul_peak(dtype: torch.dtype, size: int, *, repeats: int = CEILING_REPEATS) -> tuple[float, float]:
    """(FLOP/s of the best of ``repeats`` n^3 matmuls after one warm-up, their spread: the median
    time over the best one, minus 1). The best, not the mean: the ceiling."""
    a, b = _operands(size, dtype)
    _matmul_seconds(a, b)
    times = sorted(_matmul_seconds(a, b) for _ in range(repeats))
    return 2 * size**3 / times[0], statistics.median(times) / times[0] - 1


def _operands(size: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Two random n x n matrices from a generator of their own: measuring the ceiling must not move
    the global RNG a run's data order and augmentation draw from (it did, and only when the ceiling
    was measured in that process, so two runs of one seed could differ)."""
    generator = torch.Generator().manual_seed(0)
    return (torch.randn(size, size, generator=generator).to(dtype),
            torch.randn(size, size, generator=generator).to(dtype))


def _matmul_seconds(a: torch.Tensor, b: torch.Tensor) -> float:
    start = time.perf_counter()
    torch.mm(a, b)
    return time.perf_counter() - start


def recheck_cpu_matmul_peak(dtype: torch.dtype, size: int, *, repeats: int = 2) -> float:
    """Best FLOP/s of ``repeats`` n^3 matmuls at a known n, after one warm-up: the short check each
    run makes of a cached ceiling."""
    a, b = _operands(size, dtype)
    _matmul_seconds(a, b)
    return 2 * size**3 / min(_matmul_seconds(a, b) for _ in range(repeats))


def _family(table: dict[str, Any], dtype: torch.dtype) -> list[dict[str, Any]]:
    """The cached ceilings of this CPU, torch and dtype, at every thread count (entries of the
    current format only: older ones were sized by the load of the moment)."""
    name, version = cpu_name(), torch.__version__
    return [e for e in table.values() if isinstance(e, dict) and e.get("cpu") == name and e.get("torch") == version
            and e.get("dtype") == str(dtype) and isinstance(e.get("threads"), int) and "spread" in e]


def thread_bound(family: list[dict[str, Any]], threads: int, size: int) -> tuple[float, int | None]:
    """The least the ceiling at ``threads`` can be, from the ceilings at other thread counts (same
    size): more threads never multiply slower at their best than fewer, and per thread never faster.
    (bound FLOP/s, the thread count it comes from)."""
    best, source = 0.0, None
    for entry in family:
        other = entry["threads"]
        if entry["size"] != size or other == threads:
            continue
        bound = entry["flops"] if other < threads else entry["flops"] * threads / other
        if bound > best:
            best, source = bound, other
    return best, source


def _new_entry(dtype: torch.dtype, size: int, threads: int, *, best: float = 0.0) -> dict[str, Any]:
    flops, spread = measure_cpu_matmul_peak(dtype, size)
    return {"flops": max(flops, best), "size": size, "repeats": CEILING_REPEATS, "spread": spread,
            "threads": threads, "cpu": cpu_name(), "torch": torch.__version__, "dtype": str(dtype),
            "measured_at": timestamp()}


def _looks_off(entry: dict[str, Any], value: float) -> bool:
    """``value`` (a lower bound on the ceiling) beats the cached ceiling by more than its spread."""
    return value > entry["flops"] * (1 + max(MIN_SPREAD, float(entry["spread"])))


def _checked_entry(entry: dict[str, Any] | None, dtype: torch.dtype, size: int, threads: int,
                   bound: float) -> dict[str, Any]:
    """The cached ceiling re-checked: measured anew (best of 5) when missing, measured another way
    (another size, an older format) or off by more than its spread (a re-check or another thread
    count's ceiling says it must be higher); raised by a faster re-check within its spread."""
    if entry is None or entry.get("size") != size or "spread" not in entry or entry.get("threads") != threads:
        return _new_entry(dtype, size, threads)
    again = recheck_cpu_matmul_peak(dtype, size)
    if _looks_off(entry, again) or _looks_off(entry, bound):
        log.info("CPU %s ceiling %.3g FLOP/s looks off (re-check %.3g, %.3g implied by another thread count): "
                 "measured again", str(dtype).removeprefix("torch."), entry["flops"], again, bound)
        return _new_entry(dtype, size, threads, best=max(entry["flops"], again))
    if again > entry["flops"]:
        log.info("CPU %s matmul ceiling re-measured at %.3g FLOP/s, above the cached %.3g: cache updated",
                 str(dtype).removeprefix("torch."), again, entry["flops"])
        return {**entry, "flops": again, "measured_at": timestamp()}
    return entry


def cpu_peak(dtype_name: str) -> Peak:
    """The measured matmul ceiling of this CPU for the dtype matmuls run in, cached per CPU model,
    thread count and torch version under ~/.cache/optbench (OPTBENCH_CACHE_DIR overrides).

    Measured the same way at every thread count: one matrix size per CPU and dtype
    (``ceiling_size``), the best of ``CEILING_REPEATS`` matmuls. A ceiling is the fastest this CPU
    was ever seen to multiply: every run re-checks the cached one with a few matmuls of its size,
    and a faster result replaces it; one that beats it by more than the measurement's own spread, or
    a ceiling at another thread count that implies a higher one (``thread_bound``), means the cached
    value was measured under load: it is measured again in full. Load can only ever make a re-check
    slower, never raise the ceiling falsely. When the bound from another thread count is still above
    the measurement, the bound is the ceiling (MFU never overstated), and the source says so."""
    dtype = torch.bfloat16 if dtype_name == "bfloat16" else torch.float16 if dtype_name == "float16" else torch.float32
    threads = torch.get_num_threads()
    key = f"{cpu_name()}|threads={threads}|torch={torch.__version__}|{dtype}"
    cache = cache_dir() / "cpu_peak.json"
    try:
        table = json.loads(cache.read_text())
    except (OSError, ValueError):
        table = {}
    family = _family(table, dtype)
    sizes = sorted({e["size"] for e in family})
    size = sizes[-1] if sizes else ceiling_size(dtype)
    bound, bound_threads = thread_bound(family, threads, size)
    entry = _checked_entry(table.get(key), dtype, size, threads, bound)
    if entry is not table.get(key):
        table[key] = entry
        _write_peak_cache(cache, table)
    else:  # the cached ceiling held against this run's re-check
        note_reused("cpu_peak", f"CPU {str(dtype).removeprefix('torch.')} matmul ceiling {entry['flops'] / 1e9:,.1f} "
                    f"GFLOP/s ({threads} thread{'s' if threads != 1 else ''}; re-checked now, not beaten)", cache, entry.get("measured_at"),
                    override="OPTBENCH_CACHE_DIR=another directory")
    flops, note = float(entry["flops"]), ""
    if bound > flops:
        flops = bound
        note = (f"; raised to {bound / 1e9:,.0f} GFLOP/s, the least the {bound_threads}-thread ceiling implies "
                f"(measured {entry['flops'] / 1e9:,.0f} GFLOP/s)")
    source = (
        f"measured CPU matmul ceiling, {str(dtype).removeprefix('torch.')} {size}^3 best of {entry['repeats']}, "
        f"{threads} thread{'s' if threads != 1 else ''} ({entry['measured_at']}, cached in {cache}){note}"
    )
    return Peak(flops=flops, source=source)


def _write_peak_cache(cache: Path, table: dict[str, Any]) -> None:
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(table, indent=2))
        tmp.replace(cache)
    except OSError as exc:  # a read-only home still gets a (re-measured) peak
        log.warning("could not cache the CPU peak in %s: %s", cache, exc)


def peak_flops(device: torch.device, compute_dtype: str, *, given_tflops: float | None = None) -> Peak:
    """The peak FLOP/s MFU is measured against, and where it came from: ``given_tflops``
    (``measure.peak_tflops``), else the datasheet's of a known GPU, else a measured matmul ceiling
    (an unknown GPU, a CPU)."""
    if given_tflops is not None:
        return Peak(given_tflops * 1e12, f"given: measure.peak_tflops={given_tflops:g} ({compute_dtype})")
    if device.type == "cuda":
        return gpu_peak(torch.cuda.get_device_name(device), compute_dtype, device=device)
    if device.type == "cpu":
        if compute_dtype == "tf32":
            compute_dtype = "float32"  # CPUs have no TF32 units; the matmuls run in fp32
        return cpu_peak(compute_dtype)
    return Peak(None, f"no peak known for device type {device.type}")


GPU_CEILING_SIZE = 8192
GPU_CEILING_REPEATS = 10


def gpu_peak(name: str, compute_dtype: str, *, device: torch.device, size: int = GPU_CEILING_SIZE) -> Peak:
    """A GPU's datasheet peak, or on a card GPU_PEAKS does not know, its measured matmul ceiling."""
    key = gpu_peak_key(name)
    if key is not None:
        return Peak(GPU_PEAKS[key][compute_dtype], f"datasheet {key} dense {compute_dtype}")
    return measured_gpu_peak(name, compute_dtype, device=device, size=size)


def measured_gpu_peak(name: str, compute_dtype: str, *, device: torch.device, size: int = GPU_CEILING_SIZE) -> Peak:
    """The best of ``GPU_CEILING_REPEATS`` synchronized n^3 matmuls in the compute dtype (tf32: fp32
    with TF32 allowed), after one warm-up: a floor under the card's real peak, named as such (an MFU
    against it is an upper bound); give the datasheet's with measure.peak_tflops."""
    dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(compute_dtype, torch.float32)
    generator = torch.Generator().manual_seed(0)  # the global RNG untouched
    a = torch.randn(size, size, generator=generator).to(device=device, dtype=dtype)
    b = torch.randn(size, size, generator=generator).to(device=device, dtype=dtype)
    allow = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = compute_dtype == "tf32"
    try:
        times = _timed_matmuls(a, b, device, GPU_CEILING_REPEATS)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = allow
    flops = 2 * size**3 / min(times)
    return Peak(flops, f"measured GPU matmul ceiling of '{name}' (not in optbench's datasheet table), {compute_dtype} "
                       f"{size}^3 best of {GPU_CEILING_REPEATS}: MFU against it is an upper bound; give the datasheet's "
                       "dense peak with measure.peak_tflops=")


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile (q in [0, 100]) of a non-empty list."""
    ordered = sorted(values)
    if len(ordered) == 1:
        return ordered[0]
    pos = (len(ordered) - 1) * q / 100.0
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def spread(values: list[float]) -> dict[str, float | int]:
    return {
        "median": statistics.median(values),
        "p10": percentile(values, 10),
        "p90": percentile(values, 90),
        "mean": statistics.fmean(values),
        "n": len(values),
    }


def minor_faults() -> int:
    """The process's minor page faults so far (all its threads): pages the kernel mapped in on first
    touch, e.g. memory the allocator gave back and the process used again."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def peak_rss_bytes() -> int:
    """The process's peak resident set size (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class StepClock:
    """Times a step with a device sync before each clock read."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.started = 0.0

    def start(self) -> None:
        synchronize(self.device)
        self.started = time.perf_counter()

    def stop(self) -> float:
        synchronize(self.device)
        return time.perf_counter() - self.started


# ------------------------------------------------------------------------------ machine speed
PROBE_SIZES = {"cpu": 512, "cuda": 4096}
PROBE_REPEATS = 9


def machine_speed_probe(device: torch.device) -> dict[str, Any]:
    """A short, fixed measure of how fast this machine multiplies right now: the median FLOP/s of
    ``PROBE_REPEATS`` n^3 matmuls (fp32 n=512 on CPU, about 30 ms; bf16 n=4096 on CUDA, a few ms),
    after one warm-up, synchronized. Unlike the MFU ceiling (the fastest ever seen) it is the
    *typical* speed now, so two probes differ when load, clocks or a neighbour's job changed
    between them. Leaves the global RNG untouched (constant operands)."""
    kind = "cuda" if device.type == "cuda" else "cpu"
    size = PROBE_SIZES[kind]
    dtype = torch.bfloat16 if kind == "cuda" else torch.float32
    a = torch.full((size, size), 1.0 / size, dtype=dtype, device=device)
    b = torch.full((size, size), 0.5, dtype=dtype, device=device)
    times = _timed_matmuls(a, b, device, PROBE_REPEATS)
    flops = 2 * size**3 / statistics.median(times)
    return {"flops": flops, "at": timestamp(),
            "method": f"median of {PROBE_REPEATS} {str(dtype).removeprefix('torch.')} {size}^3 matmuls on {kind}"}


# ------------------------------------------------------------------------------ compiled steps
class ProfiledPeak:
    """The peak bytes a step allocates on a CPU, from the profiler's memory events
    (``torch.profiler``, ``profile_memory=True``): every allocation and free of torch's CPU
    allocator, Inductor's generated kernels' buffers included (MemTracker, a dispatch mode, sees
    only dispatched ops, and torch.compile runs eager while a dispatch mode is active, so it
    measures the eager step instead). The allocator reports only blocks allocated while it
    profiles, so the peak is the bytes already live when the step starts (the model's parameters
    and buffers, their gradients, the optimizer's states: distinct storages) plus the largest
    running sum of the step's allocations and frees. Used as MemTracker is: a context manager
    around the step, ``get_tracker_snapshot("peak")[device]["Total"]``."""

    source = "torch.profiler memory events (profile_memory) on real tensors"

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 device: torch.device = torch.device("cpu")) -> None:
        self.model, self.optimizer, self.device = model, optimizer, device
        self.baseline = 0
        self.peak: int | None = None
        self.profiler: Any = None

    def _live_bytes(self) -> int:
        tensors = [*self.model.parameters(), *self.model.buffers()]
        tensors += [p.grad for p in self.model.parameters() if p.grad is not None]
        tensors += [v for state in self.optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
        tensors = [getattr(t, "_local_tensor", t) for t in tensors]  # FSDP2's DTensors: their shards
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors
                    if t.device.type == self.device.type}
        return sum(storages.values())

    def __enter__(self) -> ProfiledPeak:
        from torch.profiler import ProfilerActivity, profile

        self.baseline = self._live_bytes()
        self.profiler = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        self.profiler.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.profiler.__exit__(*exc)
        events = sorted((e.start_ns(), e.nbytes()) for e in self.profiler.profiler.kineto_results.events()
                        if e.name() == "[memory]" and e.device_type() == torch._C._autograd.DeviceType.CPU)
        running = top = 0
        for _, nbytes in events:
            running += nbytes
            top = max(top, running)
        self.peak = self.baseline + top

    def reset_mod_stats(self) -> None:
        """MemTracker's reset between micro-steps: nothing to reset here."""

    def get_tracker_snapshot(self, kind: str) -> dict[torch.device, dict[str, int]]:
        return {self.device: {"Total": self.peak or 0}}
