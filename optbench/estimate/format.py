"""What ``optbench estimate`` prints: an estimate (``optbench.estimate.api.estimate``) as a table, a
markdown row (one per job of a sweep) or JSON."""

from __future__ import annotations

import json
from typing import Any

from optbench.estimate.api import GIB
from optbench.estimate.memtrace import COMPONENTS
from optbench.estimate.predict import speed_lines

LABELS = {
    "parameters": "parameters", "gradients": "gradients", "optimizer_states": "optimizer states",
    "activations": "activations", "temporaries": "temporaries", "fsdp_buffers": "FSDP gathered/comm",
    "ddp_buckets": "DDP grad buckets", "other": "inputs, buffers", "cuda_workspaces": "cuBLAS workspaces",
}


def gib(nbytes: int | float | None) -> str:
    """Bytes in GiB, or MiB below one GiB."""
    if nbytes is None:
        return "-"
    if abs(nbytes) < GIB:
        return f"{nbytes / 2**20:.1f} MiB"
    return f"{nbytes / GIB:.2f} GiB"


def format_table(result: dict[str, Any]) -> str:
    c, model, mem = result["config"], result["model"], result["memory"]
    where = mem["peak_phase"] + (f" ({mem['peak_module']})" if mem["peak_module"] else "")
    lines = [
        f"optbench estimate: {c['model']} precision={c['precision']} parallel={_parallel(c)} x {c['world_size']} "
        f"ac={c['ac']} optimizer={c['optimizer']}, micro-batch {c['micro_batch']} "
        f"x {c['seq_len']} tokens",
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
        bound = "" if search["exact"] else f" to {search['upper_bound']} (search stopped)"
        slope = "" if search["bytes_per_sample"] is None else (
            f"+{gib(search['bytes_per_sample'])} per sample at the activation peak, "
            f"+{gib(search['peak_bytes_per_sample'])} at the step's peak; ")
        lines.append(f"  micro-batch  largest that fits: {search['max_micro_batch']}{bound} "
                     f"({slope}traced at {', '.join(search['traced_peaks'])})")
    for row in result.get("fits_on") or []:
        lines.append(f"  on {row['gpus']} GPU{'s' if row['gpus'] > 1 else ' '}    {row['parallel']}: "
                     f"{gib(row['peak_bytes'])} per GPU, {row['verdict']} ({row['used_fraction']:.0%})")
    tp = result["throughput"]
    if result.get("speed"):
        lines += speed_lines(result["speed"], world_size=c["world_size"])
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
