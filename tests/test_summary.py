"""summary.json through its record (``optbench.summary``): a summary written before schema versions
reads (the report pools it with today's runs), one the record cannot hold is refused with one line."""

from __future__ import annotations

import json
import shutil

import pytest

from optbench.report.runs import load_run
from optbench.summary import SCHEMA_VERSION, RunSummary, SummaryError, read_run_summary
from tests.helpers import ROOT

BEFORE_RENAMES = ROOT / "tests" / "report" / "runs_before_renames" / "1_checkpointing=full"


def test_a_summary_written_before_schema_versions_reads_as_todays():
    written = json.loads((BEFORE_RENAMES / "summary.json").read_text())
    assert "schema_version" not in written and written["stopping"]["time_budget"]["max_minutes"] == 30.0
    record = read_run_summary(BEFORE_RENAMES)
    assert record.schema_version == SCHEMA_VERSION and record.status == "completed"
    assert record.stopping.time_budget.time_limit_s == 1800.0  # minutes then, seconds now
    assert record.throughput.step_time_s.median == written["throughput"]["step_time_s"]["median"]
    assert record.throughput.page_faults_per_step is None and record.predicted is None  # added since
    assert record.versions == written["versions"]  # as that run recorded them, not this process's
    assert record.checkpoint.saved == ["step-00000005"] and record.checkpoint.save_every == 5
    assert record.machine_speed.probed_flops() == [written["machine_speed"]["before"]["flops"],
                                                   written["machine_speed"]["after"]["flops"]]


def test_a_summary_missing_what_later_versions_added_reads_those_as_null(tmp_path):
    (tmp_path / "summary.json").write_text(json.dumps({"status": "failed", "error": "x", "memory": {}}))
    record = read_run_summary(tmp_path)
    assert record.memory.peak_bytes is None and record.started_at is None and record.versions is None
    assert record.steps == 0 and record.world_size == 1 and record.checkpoint is None


@pytest.mark.parametrize("change, words", [
    (lambda d: d["memory"].update(swap_bytes=1), "memory.swap_bytes is no field of summary.json"),
    (lambda d: d.update(schema_version=SCHEMA_VERSION + 1), f"schema_version {SCHEMA_VERSION + 1}, which this optbench"),
    (lambda d: d["applied"]["checkpoint"].update(every=5), "applied.checkpoint.every is no field"),
    (lambda d: d.update(model=5), "model is 5, not an object"),
    (lambda d: d.update(memory=None), "memory is null, not an object"),  # a section every summary has
    (lambda d: d.update(loss=None), "loss is null, not an object"),
    (lambda d: d.pop("status"), "is not an optbench summary (it has no status)"),
])
def test_a_summary_the_record_cannot_hold_is_refused_with_one_line(tmp_path, change, words):
    """Refused, not read in part: a newer optbench's field dropped without a word would be a silent
    fallback, and its runs would pool with runs whose numbers may mean something else."""
    run = tmp_path / "run"
    shutil.copytree(BEFORE_RENAMES, run)
    data = json.loads((run / "summary.json").read_text())
    change(data)
    (run / "summary.json").write_text(json.dumps(data))
    with pytest.raises(SummaryError) as caught:
        read_run_summary(run)
    message = str(caught.value)
    assert words in message and str(run / "summary.json") in message and "\n" not in message
    assert "leave its directory out" in message  # and the fix
    listed = load_run(run)  # the report lists it, with why
    assert listed.status == "unreadable" and listed.error == message


@pytest.mark.parametrize("content, words", [(None, "cannot read"), ('{"status": "comp', "is not valid JSON")])
def test_a_missing_or_torn_summary_is_one_line(tmp_path, content, words):
    if content is not None:
        (tmp_path / "summary.json").write_text(content)
    with pytest.raises(SummaryError, match=words) as caught:
        read_run_summary(tmp_path)
    assert "\n" not in str(caught.value) and str(tmp_path / "summary.json") in str(caught.value)


def test_what_a_record_writes_it_reads_back_whole():
    record = RunSummary(overrides=["model=tiny"], status="completed")
    assert RunSummary.from_dict(json.loads(json.dumps(record.to_dict()))) == record
