"""What a person sees (issue 27): console tables within the terminal's width with reasons said
once, plots whose texts stay inside their axes and whose numbers are the sweep's job numbers, MFU
that agrees with the tokens/s beside it, gates that judge what ran and print no withheld ratio,
runs of other schedules kept apart."""

from __future__ import annotations

import json
import shlex

import numpy as np
import pytest
from matplotlib.backends.backend_agg import FigureCanvasAgg

from optbench.outputs import write_json_atomic
from optbench.report.analysis import Gates, build_report
from optbench.report.command import compare_parser, split_argv
from optbench.report.format import render
from optbench.report.plots import identical_curves, losses_figure, memory_figure, throughput_figure
from optbench.report.tables import phase_header, text_table
from tests.report.test_report import fake_run, noisy, report_cli

LONG_REASON = ("2 options block this run: (1) optimizer=cpu_offload needs CUDA: torchao's CPUOffloadOptimizer moves "
               "optimizer state from the GPU to the CPU and supports only CUDA and XPU; on CPU use optimizer=adamw; "
               "(2) attention=flex needs CUDA to train: FlexAttention does not support backward on CPU")


def edit_summary(run_dir, **changes) -> None:
    path = run_dir / "summary.json"
    summary = json.loads(path.read_text())
    for dotted, value in changes.items():
        node = summary
        *parents, last = dotted.split("__")
        for key in parents:
            node = node.setdefault(key, {})
        node[last] = value
    write_json_atomic(path, summary)


def probes(before: float, after: float) -> dict:
    return {"before": {"flops": before}, "after": {"flops": after}}


@pytest.fixture
def phase_sweep(tmp_path):
    """A CPU phase sweep as Hydra lays it out (job dirs 0_..., 1_...): phases 0-4 ran while the
    machine's speed moved 2x (no speed verdict), phases 5-8 are incompatible with long reasons."""
    root = tmp_path / "sweep"
    medians = (0.10, 0.30, 0.25, 0.27, 0.26)
    for job, (phase, median) in enumerate(zip(("0_baseline", "1_compile", "2_ckpt", "3_loss", "4_loader"), medians,
                                              strict=True)):
        run = fake_run(root / f"{job}_model=tiny,phase={phase}", overrides=[f"phase={phase}", "model=tiny"],
                       step_times=noisy(median, seed=job), started=f"{job:02d}",
                       tokens_per_step=128 if job < 2 else 256)
        edit_summary(run, machine_speed=probes(10e9, 4e9 if job else 10e9))
    for job, phase in enumerate(("5_offload", "6_bf16", "7_fsdp2", "8_flex"), start=5):
        fake_run(root / f"{job}_model=tiny,phase={phase}", overrides=[f"phase={phase}", "model=tiny"],
                 status="incompatible", error=LONG_REASON if job != 6 else "optimizer=cpu_offload needs CUDA",
                 started=f"{job:02d}")
    return root


# --------------------------------------------------------------------------------- the console
@pytest.mark.parametrize("width", [80, 100, 140])
def test_console_tables_fit_the_terminal_and_say_each_reason_once(phase_sweep, width):
    text = render(build_report([phase_sweep]), "table", width=width)
    assert max(len(line) for line in text.splitlines()) <= width
    words = " ".join(text.split())
    assert words.count("FlexAttention does not support backward on CPU") == 1  # jobs 5, 7, 8: one note
    assert words.count("a machine that got busier half-way") == 1  # the drift guard's why, once
    assert "no verdict: speed moved 150%" in words  # each row: its own number, in a few words
    for job in range(9):
        assert f"#{job}" in text  # the sweep's job numbers


@pytest.mark.parametrize("width", [60, 80, 100])
def test_a_phase_name_is_never_broken_across_lines(width):
    """Issue 47 item 3: a sweep's phase table printed `7_fsdp2_cpu_offload_poli` / `cy`."""
    names = ["0_baseline", "1_bf16", "6_fsdp2", "7_fsdp2_cpu_offload_policy", "8_float8"]
    rows = [[f"#{job}", phase, "incompatible [2]" if job == 3 else "completed", "12,345", "1.02x [0.98-1.07]",
             "(0.95x [0.90-1.01])", "no verdict: speed moved 84% [1]", "1.2 GiB", "1.00x", "+0.0012"]
            for job, phase in enumerate(names)]
    text = text_table(phase_header(), rows, width=width)
    assert max(len(line) for line in text.splitlines()) <= width
    for phase in names:
        assert any(phase in line.split() for line in text.splitlines()), phase


def test_a_withheld_verdict_says_what_would_give_one_and_prints_the_command(phase_sweep):
    """Issue 47 item 6: on a CPU every verdict was withheld and nothing said what to do next."""
    text = render(build_report([phase_sweep]), "table", width=80)
    words = " ".join(text.split())
    assert "No speed verdict for 4 variant(s): the machine's own speed" in words and "moved up to 150%" in words
    assert "on a quieter machine" in words and "--repeats pools the noise between runs" in words
    command = "optbench compare phase=0_baseline model=tiny -- phase=4_loader model=tiny --repeats 3"
    lines = text[text.index("    optbench compare"):].split("\n\n")[0]
    assert " ".join(lines.replace(" \\\n", " ").split()) == command  # lines continued with a backslash, to copy
    args, a, b = split_argv(shlex.split(command)[2:], compare_parser())  # and compare reads it as meant
    assert (a, b, args.repeats) == (["phase=0_baseline", "model=tiny"], ["phase=4_loader", "model=tiny"], 3)
    assert f"`{command}`" in render(build_report([phase_sweep]), "markdown")


def test_tags_name_one_variant_each_even_over_two_compares(tmp_path):
    for out in ("c1", "c2"):
        for i, side in enumerate("AB"):
            fake_run(tmp_path / out / f"{i}_{side}", overrides=[f"x={out}{side}"], started=f"{out}{i}")
        write_json_atomic(tmp_path / out / "compare.json", {"runs": [{"dir": "0_A", "side": "A"},
                                                                      {"dir": "1_B", "side": "B"}]})
    assert [v.tag for v in build_report([tmp_path / "c1"]).groups[0].variants] == ["A", "B"]
    tags = [v.tag for v in build_report([tmp_path]).groups[0].variants]
    assert len(set(tags)) == 4 and all(t.startswith("#") for t in tags)


def test_a_long_label_is_shortened_on_the_console_only(tmp_path, monkeypatch, capsys):
    many = [f"train.option_{i}=value_{i}" for i in range(12)]
    fake_run(tmp_path / "a", overrides=["x=a", *many], started="01")
    fake_run(tmp_path / "b", overrides=["x=b", *[o.replace("value", "other") for o in many]],
             step_times=noisy(0.05), started="02")
    monkeypatch.setenv("COLUMNS", "90")
    code, out, _ = report_cli(capsys, str(tmp_path), "--no-plots")
    assert code == 0 and max(len(line) for line in out.splitlines()) <= 90
    label = json.loads((tmp_path / "report.json").read_text())["groups"][0]["variants"][1]["label"]
    assert len(label) > 250 and label not in out and "…" in out  # shortened; whole in report.json and .md
    assert label in (tmp_path / "report.md").read_text()


# ------------------------------------------------------------------------------------- plots
def _outside(fig) -> list[str]:
    """The texts of a figure's axes that reach outside those axes."""
    FigureCanvasAgg(fig)
    renderer = fig.canvas.get_renderer()
    found = []
    for ax in fig.axes:
        box = ax.get_window_extent(renderer)
        for text in ax.texts:
            if not text.get_text() or not text.get_visible():
                continue
            ext = text.get_window_extent(renderer)
            if ext.x0 < box.x0 - 1 or ext.x1 > box.x1 + 1 or ext.y0 < box.y0 - 1 or ext.y1 > box.y1 + 1:
                found.append(text.get_text())
    return found


def test_every_plot_text_stays_inside_its_axes(phase_sweep):
    report = build_report([phase_sweep])
    for figure in (throughput_figure, memory_figure, losses_figure):
        assert _outside(figure(report)) == [], figure.__name__


def test_throughput_says_why_a_phase_did_not_run_and_withholds_a_drifting_ratio(phase_sweep):
    fig = throughput_figure(build_report([phase_sweep]))
    texts = [t.get_text().replace("\n", " ") for t in fig.axes[0].texts]
    blocked = [t for t in texts if t.startswith("incompatible")]
    assert len(blocked) == 4  # every incompatible row says why, in a few words
    assert "incompatible: (1) optimizer=cpu_offload needs CUDA; (2) attention=flex needs CUDA to train" in blocked
    assert any(t.startswith("(0.3") and "no verdict: speed moved 150%" in t for t in texts)
    labels = [t.get_text() for t in fig.axes[0].get_yticklabels()]
    assert labels[0].startswith("#0 ") and labels[8].startswith("#8 ")


def test_memory_points_carry_the_job_numbers_of_the_sweep(phase_sweep):
    fig = memory_figure(build_report([phase_sweep]))
    assert sorted(t.get_text() for t in fig.axes[0].texts) == ["#0", "#1", "#2", "#3", "#4"]
    legend = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert legend[0] == "#0 phase=0_baseline" and legend[4] == "#4 phase=4_loader"


def test_curves_closer_than_the_panel_shows_are_drawn_once_and_said_to_be(tmp_path):
    a = [(s, 7.0 - 0.1 * s) for s in range(10)]
    close = [(s, v + 1e-6) for s, v in a]  # compile's rounding: hidden under the other line
    far = [(s, v - 0.05) for s, v in a]
    assert identical_curves([("a", a), ("c", close), ("f", far)]) == [[0], [1], [2]]
    assert identical_curves([("a", a), ("c", close), ("f", far)], tolerance=1e-3) == [[0, 1], [2]]
    for job, shift in enumerate((0.0, 1e-6, 0.05)):
        fake_run(tmp_path / f"{job}_x", overrides=[f"x={job}"], loss_final=5.0 + shift, started=f"{job:02d}")
    legend = [t.get_text() for t in losses_figure(build_report([tmp_path])).axes[0].get_legend().get_texts()]
    assert len(legend) == 2 and legend[0].startswith("2 curves within 1e-06 of each other (drawn as one):")
    assert "= #0 x=0" in legend[0] and "= #1 x=1" in legend[0]


# ----------------------------------------------------------------------------- figures agree
def test_mfu_is_the_pooled_tokens_per_s_in_every_table(tmp_path):
    """Repeats of unequal speed: the mean of the runs' MFUs disagrees with the pooled tokens/s; the
    report's MFU x peak / FLOPs per token is the tokens/s it prints beside it."""
    for i, median in enumerate((0.10, 0.20, 0.10)):
        for side, scale in (("A", 1.0), ("B", 0.75)):
            run = fake_run(tmp_path / f"{2 * i + (side == 'B')}_{side}", overrides=[f"x={side}"],
                           step_times=noisy(median * scale, seed=i), started=f"{2 * i + (side == 'B'):02d}")
            tps = json.loads((run / "summary.json").read_text())["throughput"]["tokens_per_s"]
            edit_summary(run, throughput__mfu=tps * 6 * 1_049_728 / 2e11)  # as the run computes its own
    report = build_report([tmp_path])
    for variant in json.loads(render(report, "json"))["groups"][0]["variants"]:
        assert variant["mfu"] * variant["peak_flops"] * variant["world_size"] / variant["flops_per_token"] == \
            pytest.approx(variant["tokens_per_s"], rel=1e-9)
        runs = [json.loads((tmp_path / r / "summary.json").read_text())["throughput"]["mfu"] for r in variant["runs"]]
        assert abs(np.mean(runs) - variant["mfu"]) > 0.01 * variant["mfu"]  # the mean of runs was another figure
    text = " ".join(render(report, "table", width=200).split())
    for variant in report.groups[0].variants:
        assert f"{variant.throughput.tokens_per_s:,.0f}" in text and f"{variant.mfu():.1%}" in text


def test_a_ceiling_raised_during_a_sweep_is_every_phases_peak(tmp_path):
    """The CPU ceiling only rises: a phase that ran at a quieter moment measured a higher one. Every
    MFU of the group is against the highest measured the same way, so their ratios are the tokens/s
    ratios (they were against 92 and 162 GFLOP/s in one sweep); another way of measuring is apart."""
    source = "measured CPU matmul ceiling, float32 512^3 best of 5, 2 threads (2026-11-26T1{}:00:00+0000, cached in x)"
    for job, (peak, hour) in enumerate(((92e9, 7), (162e9, 8), (200e9, 9))):
        run = fake_run(tmp_path / f"{job}_x", overrides=[f"x={job}"], step_times=noisy(0.1 / (job + 1), seed=job),
                       started=f"{job:02d}")
        text = source.format(hour) if job < 2 else source.format(hour).replace("2 threads", "1 thread")
        edit_summary(run, throughput__peak_flops=peak, throughput__peak_source=text)
    variants = build_report([tmp_path]).groups[0].variants
    assert [v.peak()[0] for v in variants] == [162e9, 162e9, 200e9]
    assert variants[1].mfu() / variants[0].mfu() == pytest.approx(
        variants[1].throughput.tokens_per_s / variants[0].throughput.tokens_per_s)
    text = " ".join(render(build_report([tmp_path]), "table", width=120).split())
    assert text.count("MFU against 162 GFLOP/s: measured CPU matmul ceiling, float32 512^3 best of 5, 2 threads; the "
                      "highest of this group's runs, measured the same way") == 1


# ------------------------------------------------------------------------------------- gates
def test_the_gates_judge_the_furthest_phase_that_ran_and_say_so(phase_sweep, capsys):
    report = build_report([phase_sweep], gates=Gates(max_memory_ratio=2.0))
    assert [r.candidate for r in report.gate_results] == ["phase=4_loader"]
    assert report.exit_code == 0
    assert "the gates judge phase=4_loader, the furthest phase that ran here: 5_offload, 6_bf16, 7_fsdp2, 8_flex " \
           "are incompatible" in " ".join(render(report, "table").split())
    edit_summary(next(phase_sweep.glob("8_*")), status="failed", error="RuntimeError: boom")
    report = build_report([phase_sweep], gates=Gates(max_memory_ratio=2.0))  # a phase that failed is judged
    assert [r.candidate for r in report.gate_results] == ["phase=8_flex"] and report.exit_code == 1


def test_a_gate_prints_no_ratio_the_drift_guard_withholds(phase_sweep, capsys):
    code, _, err = report_cli(capsys, str(phase_sweep), "--min-speedup", "3", "--no-plots")
    failed = [line for line in err.splitlines() if line.startswith("optbench: gate failed:")]
    assert code == 1 and len(failed) == 1
    assert "min-speedup 3: phase=4_loader vs phase=0_baseline: no speed verdict (speed moved 150%), needs the 95% " \
           "interval >= 3x" in failed[0]
    assert "speedup 0." not in failed[0] and "x [" not in failed[0]
    gate = json.loads((phase_sweep / "report.json").read_text())["gates"][0]
    assert gate["value"] is None and not gate["ok"]


# --------------------------------------------------------------------------------- schedules
def test_runs_of_another_length_are_reported_apart(tmp_path):
    """`optbench report outputs/` over a 14-step and a 30-step run of one config: two groups, no
    loss delta of -1 between them."""
    fake_run(tmp_path / "short", overrides=["model=tiny"], loss_eval=5.6, started="01")
    fake_run(tmp_path / "long", overrides=["model=tiny"], loss_eval=4.6, started="02")
    edit_summary(tmp_path / "short", config__train={"steps": 14, "seq_len": 256, "seed": 0})
    edit_summary(tmp_path / "long", config__train={"steps": 30, "seq_len": 256, "seed": 0})
    report = build_report([tmp_path])
    assert [g.label for g in report.groups] == ["model=tiny task=lm, 14 steps x seq 256",
                                                "model=tiny task=lm, 30 steps x seq 256"]
    assert all(v.is_baseline for g in report.groups for v in g.variants)  # nothing compared across
    assert "reported apart, never compared" in render(report, "table")


def test_a_loss_delta_over_another_batch_says_so(tmp_path):
    fake_run(tmp_path / "a", overrides=["phase=0_baseline"], started="01")
    fake_run(tmp_path / "b", overrides=["phase=2_ckpt"], tokens_per_step=256, started="02")
    comparison = build_report([tmp_path]).groups[0].comparisons
    notes = [c.loss_note for c in comparison.values()]
    assert "another batch: 256 vs 128 tokens per optimizer step" in notes
