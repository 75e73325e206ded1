"""Efficiencies of GPUs measured by optbench, fitted by ``bench/fit_efficiency.py`` from the runs
it names (``bench/RESULTS.md``): per card, the fraction of the datasheet dense peak its matmuls
reached (per peak: float32, tf32, bfloat16), of its HBM bandwidth its memory-bound ops reached, and
the host's seconds per launched kernel; with the source (card, torch, date, runs). A card not here
is projected at its datasheet peaks and says "roofline only". Regenerate with
``python bench/fit_efficiency.py --write``; do not edit by hand."""

EFFICIENCY: dict[str, dict] = {
    'H200': {'matmul': {'float32': 0.824, 'tf32': 0.347, 'bfloat16': 0.6972}, 'memory': 1.0, 'host_s': 2.439e-05, 'matmul_latency_s': 0.0, 'source': 'H200 141GB, torch 2.11.0+cu130, 2026-11-26 (bench/RESULTS.md), fitted by bench/fit_efficiency.py; fitted on its 7 runs marked fit'},
}
