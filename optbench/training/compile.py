"""torch.compile per transformer block, and how long compiling took.

Each block is compiled in place (``nn.Module.compile``), so parameter names and the module tree do
not change. Blocks share one compiled graph: Dynamo treats a block's parameters as inputs, so the
first block compiles and the others reuse it (recompiling only where shapes or guards differ).

Compilation is lazy: it happens in the first forward (and, for the backward graph, the first
backward), i.e. inside the run's warm-up steps, which are excluded from every step-time figure.
``compile_seconds`` reads Dynamo's own timers so the summary can say how long it took.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

log = logging.getLogger(__name__)

# Dynamo's timers (torch._dynamo.utils.compilation_time_metrics) that together cover one compile:
# tracing plus AOTAutograd plus Inductor's forward codegen happen inside ``_compile.compile_inner``;
# the backward graph is compiled lazily, at the first backward, inside ``bw_compiler``.
_COMPILE_TIMERS = ("_compile.compile_inner", "compile_fx.<locals>.bw_compiler")


def apply_compile(layers: nn.ModuleDict, *, mode: str, fullgraph: bool) -> list[str]:
    """Compile every block of ``layers`` in place with ``torch.compile(mode=mode, fullgraph=...)``.

    Preconditions: activation checkpointing (if any) is already applied, so the checkpoint wrapper
    is compiled with the block; data-parallel wrapping is not yet applied. ``mode="none"`` does
    nothing. Dynamo's caches are reset first, so a sweep that runs several jobs in one process
    compiles each job from scratch (honest compile times, and no job inherits another's
    recompilation budget). Returns the names of the compiled blocks.
    """
    if mode == "none":
        return []
    torch._dynamo.reset()
    compiled = []
    for name, block in layers.named_children():
        block.compile(mode=mode, fullgraph=fullgraph)
        compiled.append(name)
    log.info("Applied torch.compile (mode=%s, fullgraph=%s) to blocks %s", mode, fullgraph, ",".join(compiled))
    return compiled


def compile_seconds() -> float:
    """Seconds spent compiling in this process so far, from Dynamo's own timers (forward frames
    including Inductor codegen, plus lazily compiled backward graphs). Take differences."""
    from torch._dynamo.utils import compilation_time_metrics

    return float(sum(sum(compilation_time_metrics.get(key, ())) for key in _COMPILE_TIMERS))


def compiled_graphs() -> int:
    """Graphs Dynamo has compiled in this process since its last reset."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


class CompileTimer:
    """This run's compile seconds from Dynamo's timers, and how many of them fell inside timed
    steps (a recompilation there would inflate the step-time figures, so it is reported)."""

    def __init__(self, *, enabled: bool) -> None:
        self.enabled = enabled
        self._start = compile_seconds() if enabled else 0.0
        self._graphs_start = compiled_graphs() if enabled else 0
        self._skips_start = cudagraph_skips() if enabled else 0
        self.in_timed_steps = 0.0

    def step(self, timed: bool):
        """Context manager around one training step."""
        return _StepWindow(self, timed)

    def total(self) -> float:
        return compile_seconds() - self._start if self.enabled else 0.0

    def graphs(self) -> int:
        return compiled_graphs() - self._graphs_start if self.enabled else 0

    def describe(self, device: torch.device) -> dict[str, Any]:
        """What compiling really did in this run, for ``applied.compile`` after the last step: graphs
        compiled, compile seconds inside timed steps, and CUDA graphs read back from Inductor
        (``cudagraphs`` is true only when at least one was recorded; "unknown" where unreadable)."""
        recorded = cudagraphs_recorded(device) if self.enabled else 0
        return {
            "graphs": self.graphs(),
            "compile_s_in_timed_steps": self.in_timed_steps,
            "cudagraphs": recorded if recorded == "unknown" else recorded > 0,
            "cudagraphs_recorded": recorded,
            "cudagraph_skips": cudagraph_skips() - self._skips_start if self.enabled else 0,
        }


class _StepWindow:
    def __init__(self, timer: CompileTimer, timed: bool) -> None:
        self.timer, self.timed = timer, timed

    def __enter__(self) -> None:
        self.before = compile_seconds() if self.timer.enabled and self.timed else 0.0

    def __exit__(self, *exc: object) -> None:
        if self.timer.enabled and self.timed:
            spent = compile_seconds() - self.before
            if spent > 0:
                self.timer.in_timed_steps += spent
                log.warning("%.2f s of compilation inside a timed step: its step time includes it", spent)


def cudagraphs_recorded(device: torch.device) -> int | str:
    """CUDA graphs Inductor's cudagraph trees have recorded on ``device`` since Dynamo's last reset
    (``apply_compile`` resets it): the graph nodes of that device's tree manager, counted. 0 on a
    device without CUDA graphs or where no tree manager was created; "unknown" where this torch's
    cudagraph trees cannot be read (a private structure, ``torch._inductor.cudagraph_trees``)."""
    if device.type != "cuda":
        return 0
    try:
        from torch._inductor import cudagraph_trees

        index = device.index if device.index is not None else torch.cuda.current_device()
        manager = cudagraph_trees.get_manager(index, create_if_none_exists=False)
        if manager is None:
            return 0
        nodes, count = [node for roots in manager.roots.values() for node in roots], 0
        while nodes:
            node = nodes.pop()
            count += 1
            nodes.extend(child for children in node.children.values() for child in children)
        return count
    except Exception as exc:  # any change of the private structure reads as "unknown"
        log.warning("cannot read Inductor's cudagraph trees (%s): applied.compile.cudagraphs is unknown", exc)
        return "unknown"


def cudagraph_skips() -> int:
    """Graphs Inductor compiled without CUDA graphs although the mode asked for them (its own
    counter ``counters["inductor"]["cudagraph_skips"]``, which Dynamo's reset keeps: take differences)."""
    from torch._dynamo.utils import counters

    return int(counters["inductor"]["cudagraph_skips"])
