"""``optbench generate``'s API: the samples a text is written for (eval samples, or the one of a
time), the texts decoded for each climate (``generate``), the numbers they state beside the
field's (``add_numbers``) and the number score (``score``). ``load.load_run`` rebuilds the model."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch.utils.data import default_collate

from optbench.errors import ConfigError


# ------------------------------------------------------------------------------------- samples
def eval_items(task, args) -> list[dict[str, Any]]:
    from optbench.tasks.text_scores import strided

    _, evaluation = task.build_datasets()
    if args.sample is not None:
        if not 0 <= args.sample < len(evaluation):
            raise ConfigError(f"--sample {args.sample}: the run has eval samples 0 .. {len(evaluation) - 1}")
        chosen = [args.sample]
    else:
        chosen = strided(len(evaluation), args.samples).tolist()
    return [{**item, "label": f"eval sample {i}"} for i, item in zip(chosen, evaluation.__getitems__(chosen),
                                                                       strict=True)]


def time_item(task, when: str, *, seed: int) -> dict[str, Any]:
    """The sample whose text is of time ``when`` (any sample of the data), with the climate of a
    random eval sample as its shuffled one."""
    from optbench.data.captions import time_label
    from optbench.data.paired import _normalize_time

    layout, data = task.data.layout, task.data
    index = {time_label(t): i for i, t in enumerate(layout.times)}
    try:
        step = index.get(_normalize_time(int(when) if when.isdigit() else when))
    except ValueError:
        step = None
    windows = all_windows(task)
    sample = None if step is None else step - task.text_offset
    if sample is None or not 0 <= sample < len(windows):
        raise ConfigError(f"--time {when} is not the time of a sample's text in {', '.join(map(str, task.cfg.data.paths))} "
                          f"(from {time_label(layout.times[task.text_offset])} to "
                          f"{time_label(layout.times[len(windows) - 1 + task.text_offset])})")
    item = windows[sample]
    _, evaluation = task.build_datasets()
    others = [i for i in range(len(evaluation)) if int(evaluation.positions[i]) + data.eval.split.first != sample]
    other = evaluation[int(np.random.default_rng(seed).choice(others))]
    texts = task.table.lookup(torch.tensor([step]))
    return {**item, "tokens": texts["tokens"][0], "length": texts["length"][0], "frames_shuffled": other["frames"],
            "eval_index": torch.tensor(-1), "label": "at --time"}


def all_windows(task) -> Any:
    """Every input window of the data, in time order, normalized as the run's samples are: window
    ``i`` is the sample whose text is of step ``i + task.text_offset`` (either split)."""
    from optbench.data.netcdf import ClimateWindows, Split

    data = task.data
    window = int(data.eval.offsets[-1]) + 1
    return ClimateWindows(data.eval.source, stats=data.stats, split=Split(0, data.layout.num_steps - window + 1),
                          history=task.history, offsets=data.eval.offsets)


def with_train_climates(task, items: list[dict[str, Any]], *, seed: int) -> list[dict[str, Any]]:
    """Each item with ``frames_train``: the input window of a random training sample (seeded; the
    ``train`` climate: the input distribution the model was trained on, at the wrong time)."""
    from optbench.data.netcdf import ClimateWindows

    data = task.data
    windows = ClimateWindows(data.train.source, stats=data.stats, split=data.train.split, history=task.history,
                             offsets=data.eval.offsets)
    picks = np.random.default_rng([seed, 0x7A1]).integers(0, len(windows), size=len(items)).tolist()
    return [{**item, "frames_train": found["frames"]}
            for item, found in zip(items, windows.__getitems__(picks), strict=True)]


# --------------------------------------------------------------------------------------- run
def climate_context(task, batch, climate: str) -> torch.Tensor | None:
    """What the model reads under ``climate``: the sample's own (``true``), another eval sample's
    (``shuffled``), a random training sample's (``train``), none (``base``)."""
    if climate == "base":
        return None
    if climate == "train":
        return batch["frames_train"][:, : task.history].nan_to_num(0.0)
    return task.context(batch) if climate == "true" else task.shuffled_context(batch)


def _forward(task, model, batch, climate: str):
    """The cached decoding step of ``model`` under ``climate`` (its kind's ``ModelSpec.decode_step``)."""
    from optbench.training.kinds import model_spec

    return model_spec(task.cfg).decode_step(model, climate_context(task, batch, climate))


def _max_new(task, args, prompt_len: int) -> int:
    room = task.cfg.train.seq_len - prompt_len + 1
    if room < 1 or (args.max_tokens is not None and args.max_tokens > room):
        raise ConfigError(f"--max-tokens {args.max_tokens} after a prompt of {prompt_len} tokens exceeds the "
                          f"model's train.seq_len={task.cfg.train.seq_len}: at most {max(room, 0)} new tokens")
    return args.max_tokens if args.max_tokens is not None else room


def generate(loaded, items: list[dict[str, Any]], args, chosen: list[str]) -> list[dict[str, Any]]:
    """One record per item and climate (in item order, climates inner)."""
    from optbench.data.captions import time_label
    from optbench.generate.decode import decode, prompt_ids, text_of
    from optbench.generate.score import sample_nll

    task, model, codec = loaded.task, loaded.model, loaded.task.codec
    if "train" in chosen:
        items = with_train_climates(task, items, seed=args.seed)
    prompt = prompt_ids(codec, args.prompt)
    max_new = _max_new(task, args, len(prompt))
    generator = torch.Generator().manual_seed(args.seed)
    records = []
    for lo in range(0, len(items), args.batch_size):
        part = items[lo: lo + args.batch_size]
        batch = default_collate([{k: v for k, v in item.items() if k != "label"} for item in part])
        start = torch.tensor([prompt] * len(part))
        per = {}
        for climate in chosen:
            ids = decode(_forward(task, model, batch, climate), start, max_new=max_new, end=codec.end,
                         temperature=args.temperature, top_k=args.top_k, generator=generator)
            per[climate] = (ids, *sample_nll(task, model, batch, context=climate_context(task, batch, climate),
                                             true=climate == "true"))
        for row, item in enumerate(part):
            step = int(item["sample"]) + task.text_offset
            for climate in chosen:
                ids, nll, count = per[climate]
                records.append({"kind": "sample", "time": time_label(task.data.layout.times[step]), "step": step,
                                "sample": item["label"], "climate": climate, "prompt": args.prompt,
                                "text": args.prompt + text_of(codec, ids[row]), "reference": task.pairs.get(step),
                                "nll": float(nll[row]), "tokens": float(count[row])})
    return records


def add_numbers(records: list[dict[str, Any]], *, loaded, need: bool) -> list[dict[str, Any]] | None:
    """Each record's stated numbers beside the field's (where the captions have a sidecar); the
    facts per record (None without a sidecar: refused when ``need``)."""
    from optbench.generate.score import FieldFacts, stated

    task = loaded.task
    if task.spec is None:
        if need:
            raise ConfigError(f"--score: data.text={task.cfg.data.text} has no sidecar (.json beside it): the number "
                              "score needs captions written by `optbench data captions`, whose facts it recomputes")
        return None
    field = FieldFacts(list(task.cfg.data.paths), spec=task.spec)
    try:
        cache: dict[int, dict] = {}
        for step in sorted({r["step"] for r in records}):
            cache[step] = field.facts(step)
        facts = [cache[r["step"]] for r in records]
    finally:
        field.close()
    for record, fact in zip(records, facts, strict=True):
        record["numbers"] = stated(fact, record["text"])
        record["field"] = {key: f.value for key, f in fact.items()}
    return facts


def score(records: list[dict[str, Any]], facts: list[dict], chosen: list[str]) -> dict[str, Any]:
    """Per climate: the number score and the text loss (per token) of the true texts."""
    from optbench.generate.score import number_score

    out = {}
    for climate in chosen:
        pick = [i for i, r in enumerate(records) if r["climate"] == climate]
        tokens = sum(records[i]["tokens"] for i in pick)
        out[climate] = {"numbers": number_score([records[i] for i in pick], [facts[i] for i in pick]),
                        "loss": sum(records[i]["nll"] for i in pick) / max(tokens, 1.0), "samples": len(pick)}
    return out
