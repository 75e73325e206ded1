"""What ``optbench estimate`` prints: an estimate (``optbench.estimate.api.estimate``) as a table, a
markdown row (one per job of a sweep) or JSON."""

from __future__ import annotations

import json
from typing import Any

from optbench.config.estimate import EstimateConfig
from optbench.estimate.api import GIB, GPUS
from optbench.estimate.memtrace import COMPONENTS
from optbench.estimate.predict import speed_lines

LABELS = {
    "parameters": "parameters", "gradients": "gradients", "optimizer_states": "optimizer states",
    "activations": "activations", "temporaries": "temporaries", "fsdp_buffers": "FSDP gathered/comm",
    "ddp_buckets": "DDP grad buckets", "other": "inputs, buffers", "cuda_workspaces": "cuBLAS workspaces",
}


BREAKDOWN_NAMES = ("other ops = elementwise ops, norms, loss, embedding and casts; optimizer = clipping and the "
                   "step; communication = what the device does not overlap; data = the wait for the next batch, "
                   "measured on this machine")


def gib(nbytes: int | float | None) -> str:
    """Bytes in GiB, or MiB below one GiB."""
    if nbytes is None:
        return "-"
    if abs(nbytes) < GIB:
        return f"{nbytes / 2**20:.1f} MiB"
    return f"{nbytes / GIB:.2f} GiB"


def this_machine() -> str:
    """What this machine computes on, in words: its first GPU's name, else its CPU."""
    import torch

    return f"this machine's {torch.cuda.get_device_name(0)}" if torch.cuda.is_available() else \
        "this machine, a CPU without a GPU"


def target_line(result: dict[str, Any]) -> str:
    """Which device the estimate is for, why, and how to choose another: an estimate is for the card
    a run will train on (``estimate.gpu``, an H100 unless told), whatever machine it is made on."""
    device = result["device"]
    if device is None:
        return (f"for no named GPU (estimate.gpu=none): memory not judged against a device; speed predicted on "
                f"{this_machine()} (estimate.gpu=h100|a100|h200 for a card, estimate.device_gb=N for a memory)")
    key = next((k for k, (name, _) in GPUS.items() if name == device["name"]), None)
    given = device["capacity_bytes"] / GIB
    if key is None:
        return f"for a device of {given:.4g} GiB (estimate.gpu=none estimate.device_gb={given:g})"
    why = "the default" if key == EstimateConfig.gpu else "as given"
    memory = "" if device["capacity_bytes"] == int(GPUS[key][1] * GIB) else f", with estimate.device_gb={given:g}"
    others = "|".join(k for k in GPUS if k != key)
    return (f"for an {device['name']} of {given:.4g} GiB (estimate.gpu={key}, {why}{memory}; not "
            f"{this_machine()}: choose estimate.gpu={others}, or none to predict on this machine)")


def format_table(result: dict[str, Any]) -> str:
    c, model, mem = result["config"], result["model"], result["memory"]
    where = mem["peak_phase"] + (f" ({mem['peak_module']})" if mem["peak_module"] else "")
    lines = [
        f"optbench estimate {target_line(result)}: {c['model']} precision={c['precision']} "
        f"parallel={_parallel(c)} x {c['world_size']} ac={c['ac']} optimizer={c['optimizer']}, micro-batch "
        f"{c['micro_batch']} x {c['seq_len']} tokens",
        f"  parameters   {model['params']:,} ({model['params_per_device']:,} per device); "
        f"matmul {model['matmul_params']:,}" + (
            f"; trainable {model['trainable_params']:,}, frozen {model['frozen_params']:,} "
            f"({model['frozen_params'] / model['params']:.1%}: no gradients, no optimizer states)"
            if model["frozen_params"] else ""),
        f"  FLOPs/token  {model['flops_per_token']:,} ({model['flops_source']})",
        "  memory per device          traced    closed form",
    ]
    traced, closed = mem["traced"], mem["closed_form"]
    for key in COMPONENTS:
        if traced[key] or closed[key]:
            lines.append(f"    {LABELS[key]:<21}{gib(traced[key]):>12}{gib(closed[key]):>14}")
    diff = mem["closed_form_vs_traced"]
    lines.append(f"    {'peak':<21}{gib(traced['total']):>12}{gib(closed['total']):>14}"
                 + ("" if diff is None else f"   closed form {abs(diff):.0%} {'above' if diff > 0 else 'below'}"))
    lines.append(f"  peak in      {where}")
    if mem["host_bytes"]:
        lines.append(f"  host memory  {gib(mem['host_bytes'])} per rank ({mem['host_source']}; closed form "
                     f"{gib(result['memory']['closed_form_host'])})")
    device = result["device"]
    if device is not None:
        lines.append(
            f"  device       {device['name']} {device['capacity_bytes'] / GIB:.0f} GiB "
            f"({device['headroom']:.0%} headroom): {device['verdict']}, peak is "
            f"{device['used_fraction']:.0%} of the device"
        )
    search = result["micro_batch_search"]
    if search is not None:
        lines.append(search_line(search))
    for row in result.get("fits_on") or []:
        lines.append(f"  on {row['gpus']} GPU{'s' if row['gpus'] > 1 else ' '}    {row['parallel']}: "
                     f"{gib(row['peak_bytes'])} per GPU, {row['verdict']} ({row['used_fraction']:.0%})")
    tp = result["throughput"]
    if result.get("speed"):
        speed = speed_lines(result["speed"], world_size=c["world_size"])
        if "breakdown_s" in result["speed"]:  # what the breakdown's names hold (optbench.estimate.speed)
            speed.insert(2, f"{'':15}(of the step: {BREAKDOWN_NAMES})")
        lines += speed
    elif tp is not None:
        lines.append(
            f"  throughput   {tp['tokens_per_s_per_gpu']:,.0f} tokens/s per GPU at {tp['mfu']:.0%} MFU of "
            f"{tp['peak_flops'] / 1e12:,.1f} TFLOP/s ({tp['peak_source']}); {tp['tokens_per_s_job']:,.0f} "
            f"tokens/s for {c['world_size']} GPU(s), {tp['step_time_s']:.2f} s per optimizer step"
        )
    lines += [f"  refused      at launch on {c['world_size']} GPU(s): {reason}" for reason in result["launch_blockers"]]
    lines += [f"  note         {note}" for note in result["notes"]]
    lines.append(f"  traced in {result['elapsed_s']:.1f} s ({mem['method']})")
    return "\n".join(lines)


def search_line(search: dict[str, Any]) -> str:
    """The largest micro-batch that fits; when the search ran out of traces before its bounds met
    (``optbench.estimate.fit``), both bounds and what they mean."""
    slope = "" if search["bytes_per_sample"] is None else (
        f"+{gib(search['bytes_per_sample'])} per sample at the activation peak, "
        f"+{gib(search['peak_bytes_per_sample'])} at the step's peak; ")
    traced = f"({slope}traced at {', '.join(search['traced_peaks'])})"
    if search["exact"]:
        return f"  micro-batch  largest that fits: {search['max_micro_batch']} {traced}"
    low, high = search["max_micro_batch"], search["upper_bound"]
    most = "no upper bound: the traced peaks did not grow" if high is None else \
        f"{high} is the most the traced peaks allow"
    return (f"  micro-batch  largest that fits: {low} to {'?' if high is None else high} (search stopped: {low} "
            f"surely fits, {most}; the search stops after {len(search['traced_peaks'])} traces, so the answer "
            f"lies between) {traced}")


MARKDOWN_HEADER = (
    "| model | parallel | ac | optimizer | micro-batch | params/device | traced peak | closed form "
    "| host | verdict | largest micro-batch |\n| --- | --- | --- | --- | --- | ---: | ---: | ---: | ---: | --- | ---: |"
)


def format_markdown_row(result: dict[str, Any]) -> str:
    c, mem, device = result["config"], result["memory"], result["device"]
    search = result["micro_batch_search"]
    cells = [
        c["model"], f"{_parallel(c)} x {c['world_size']}", c["ac"], c["optimizer"],
        f"{c['micro_batch']} x {c['seq_len']}", _count(result["model"]["params_per_device"]),
        gib(mem["traced"]["total"]), gib(mem["closed_form"]["total"]),
        gib(mem["host_bytes"]) if mem["host_bytes"] else "-",
        "refused at launch" if result["launch_blockers"] else
        "-" if device is None else f"{device['verdict'].split(':')[0]} ({device['name']})",
        "-" if search is None else str(search["max_micro_batch"]),
    ]
    return "| " + " | ".join(cells) + " |"


def _parallel(config_line: dict[str, Any]) -> str:
    return config_line["parallel"] + (" +cpu_offload" if config_line["parallel_cpu_offload"] else "")


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"


def render(result: dict[str, Any], *, fmt: str, header: bool = True) -> str:
    if fmt == "json":
        return json.dumps(result, indent=2)
    if fmt == "markdown":
        row = format_markdown_row(result)
        return f"{MARKDOWN_HEADER}\n{row}" if header else row
    return format_table(result)
