"""bash bench/gpu_check.sh predict, run on this CPU at tiny size: each run records its prediction
and memory estimate before its loop, and the table puts them beside what it measured."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_predict_mode_tabulates_predicted_beside_measured(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path / "out"), "W": str(tmp_path / "runs"), "MODEL": "tiny", "MB": "2",
           "SEQ": "32", "STEPS": "7", "PRECISIONS": "bf16", "COMPILE": "off", "PYTHONPATH": str(ROOT),
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}  # python3: this interpreter
    done = subprocess.run(["bash", "bench/gpu_check.sh", "predict"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    table = (tmp_path / "out" / "predict.md").read_text().splitlines()
    row = next(line for line in table if line.startswith("| predict_bf16 |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    predicted, measured, error = cells[1:4]
    assert float(predicted.replace(",", "")) > 0 and float(measured.replace(",", "")) > 0 and error.endswith("%")
    assert "per-op benchmark" in cells[7] and "MemTracker" in cells[7]
