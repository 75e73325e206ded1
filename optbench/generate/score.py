"""Scores of generated text: the numbers it states against the field's, and the text loss of the
true text under each climate.

The **number score** parses every number a caption states out of the generated text
(``optbench.data.facts.Fact.parse``: the same words around it as the captions use) and compares it
with the value computed from the field for that step (``FieldFacts``, from the captions' sidecar:
the same mode, history and training-period climatology): per quantity (area mean, regions,
points, anomaly, trend, ...) the mean absolute error over the samples whose text states it,
how often it is stated, and for signed quantities (anomaly, trend) how often the sign is right.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from optbench.data.facts import Fact


class FieldFacts:
    """The facts of any step of a run's data, as its captions state them (``CaptionSpec``)."""

    def __init__(self, paths: list[str], *, spec) -> None:
        from optbench.data.captions import open_describer

        self.layout, self.source, self.describer = open_describer(paths, spec=spec)
        self.back = spec.history

    def facts(self, step: int) -> dict[str, Fact]:
        first = max(0, step - self.back)
        block = self.source.read(first, step + 1)
        return self.describer.facts(block, step - first, step=step)

    def close(self) -> None:
        self.source.close()


def stated(facts: dict[str, Fact], text: str) -> dict[str, float]:
    """The numbers ``text`` states for the facts' keys (those it does not state are absent)."""
    found = {key: fact.parse(text) for key, fact in facts.items()}
    return {key: value for key, value in found.items() if value is not None}


def number_score(records: list[dict[str, Any]], facts: list[dict[str, Fact]]) -> dict[str, dict[str, Any]]:
    """Per quantity over ``records`` (each with ``numbers``: what its text states) and their
    field ``facts``: MAE over the samples that state it, the share that state it, and for signed
    quantities the share with the right sign (among those that state it)."""
    errors: dict[str, list[float]] = {}
    signs: dict[str, list[bool]] = {}
    asked: dict[str, int] = {}
    for record, field in zip(records, facts, strict=True):
        for key, fact in field.items():
            asked[fact.quantity] = asked.get(fact.quantity, 0) + 1
            if key not in record["numbers"]:
                continue
            said = record["numbers"][key]
            errors.setdefault(fact.quantity, []).append(abs(said - fact.value))
            if fact.signed:
                signs.setdefault(fact.quantity, []).append(bool(np.sign(said) == np.sign(fact.value)))
    return {quantity: {"mae": float(np.mean(errors[quantity])) if quantity in errors else None,
                       "stated": len(errors.get(quantity, [])) / count,
                       "sign_accuracy": float(np.mean(signs[quantity])) if quantity in signs else None,
                       "n": count}
            for quantity, count in asked.items()}


@torch.no_grad()
def sample_nll(task, model, batch: dict[str, torch.Tensor], *, context: torch.Tensor | None,
               true: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Per sample of ``batch``: the summed NLL of its true text given ``context`` (None: the decoder
    alone; ``true``: the task's own forward, as the eval computes it) and its number of target
    tokens (teacher-forced)."""
    inputs = task.inputs(batch)
    if true:
        outputs = task.forward(model, batch)
    elif context is not None:
        outputs = model(inputs, context=context)
    else:
        outputs = model(inputs)
    nll, count = task._sample_nll(outputs, task._targets(batch))
    return nll.cpu().numpy(), count.cpu().numpy()
