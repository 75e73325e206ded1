"""The linear probe of ``bench/fusion_matrix.py``: what a linear read-out of a trained fused model's
climate encoder gets, on the same eval samples as its texts.

Per fused run (a seed of a kind, never an all-zero control: its encoder only ever saw zeros), the
run's last checkpoint is loaded as ``optbench generate`` loads it; its encoder (``model.fusion``'s
patch embedding, blocks and norm) encodes the input window of every training step and of every eval
step the texts were written for, windows normalized as the run's own samples are; the encoder's
output tokens, flattened, are the features of the same ridge read-out as the raw-input baseline
(``fusion_stats.Field.read_out``: fitted per fact on the training steps). It is a step after the
runs, reading their checkpoints: runs trained before it was added get it too.

The question it answers: how far is the text from what the encoder it reads holds? The ridge on the
raw input frames says what the input holds; this says what survives the trained encoder.
"""

from __future__ import annotations

import functools
from pathlib import Path

import fusion_stats as fs
import numpy as np
import torch

LABEL = "linear read-out of the trained encoder (ridge, per seed)"
QUESTION = ("how close is the text to what a linear read-out of the encoder it reads gets (the encoder's "
            "output tokens, per seed)?")


def encoder_features(run_dir: Path, steps: list[int], *, data: Path, text: Path) -> np.ndarray:
    """Per step of ``steps``: the run's trained climate encoder's output tokens, flattened, for the
    sample whose text is of that step (the window the run's model reads, from ``data`` and the
    captions ``text``: the run's files wherever they are now)."""
    from optbench.generate.api import all_windows

    loaded = _loaded(Path(run_dir), Path(data), Path(text))
    task, model = loaded.task, loaded.model
    items = all_windows(task).__getitems__([s - task.text_offset for s in steps])
    frames = torch.stack([item["frames"] for item in items])[:, : task.history].nan_to_num(0.0)
    fusion = model.fusion
    cos, sin = (fusion.rope_cos, fusion.rope_sin) if hasattr(fusion, "rope_cos") else (model.rope_cos, model.rope_sin)
    with torch.no_grad():
        encoded = fusion.encode(frames, cos, sin)
    return encoded.flatten(1).double().numpy()


@functools.cache  # the table and the raw lines both ask; a checkpoint is loaded once for it
def gate_openings(run_dir: Path, *, data: Path, text: Path) -> dict[str, dict[str, float]]:
    """A gated run's fused layers (keyed by the index of the decoder layer each precedes) and, for each,
    how open its two gates are at the run's last checkpoint: ``|tanh(alpha)|`` of the cross-attention's
    and the MLP's (0 at initialization: closed, the layer adds nothing; 1: fully open). Where the
    loss gap is ~0, this says whether the climate was shut out at the gates."""
    model = _loaded(Path(run_dir), Path(data), Path(text)).model
    return {index: {"attn": abs(float(layer.attn_gate.alpha.detach().tanh())),
                    "mlp": abs(float(layer.mlp_gate.alpha.detach().tanh()))}
            for index, layer in model.fusion.layers.items()}


@functools.lru_cache(maxsize=2)  # the probe's features and the gates of the run in hand (not every run's model)
def _loaded(run_dir: Path, data: Path, text: Path):
    """The run's last checkpoint loaded as ``optbench generate`` loads it (once per run in a process)."""
    from optbench.generate.load import load_model

    return load_model(run_dir, task="climate_text", why="the encoder probe reads a fused climate_text model",
                      data={"paths": [str(data)], "text": str(text)})


@functools.cache
def _predictions(run_dir: Path, steps: tuple[int, ...], data: Path, text: Path) -> dict[str, np.ndarray]:
    field = _field(data, text)
    train = list(field.train_range())
    x = encoder_features(run_dir, train + list(steps), data=data, text=text)
    return field.read_out(x[: len(train)], x[len(train):], list(steps))


@functools.cache
def _field(data: Path, text: Path) -> fs.Field:
    return fs.Field(data, text)


def probe(run_dir: Path, steps: list[int], *, data: Path, text: Path) -> dict[str, np.ndarray]:
    """Per fact key of ``steps``: the ridge read-out of the run's encoder features (computed once per
    run and steps in a process: the table and the raw lines share it)."""
    return _predictions(Path(run_dir), tuple(steps), Path(data), Path(text))


def probe_errors(runs: list[Path], ref: list[dict], quantity: str, *, data: Path, text: Path) -> np.ndarray:
    """Per eval sample of ``ref`` (the texts' records, in order): the probe's error of ``quantity``,
    averaged over the runs (seeds) as the texts' errors are."""
    steps = [r["step"] for r in ref]
    return np.mean([fs.baseline_errors(probe(r, steps, data=data, text=text), ref, quantity) for r in runs], axis=0)
