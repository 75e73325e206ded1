"""`make install`'s recipe as it runs from nothing, with stand-in interpreters that record what they
are asked to do (no package is installed): which venv is made, which pip installs torch and uv, and
the arguments pip receives."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import ROOT

# A stand-in for python (the one .venv is made from, and .venv's own once made) and for uv. It logs
# its arguments as one JSON line to $FAKE_LOG and answers as the real ones would on a machine where
# the base interpreter has a pip that can install into another environment ($FAKE_BASE_PIP=1).
FAKE = r'''#!{python}
import json, os, shutil, sys
from pathlib import Path
me, args = Path(sys.argv[0]), sys.argv[1:]
with open(os.environ["FAKE_LOG"], "a") as log:
    log.write(json.dumps([me.name if me.parent.name != "bin" else str(me), *args]) + "\n")
venv = me.parent.parent if me.parent.name == "bin" else None
if me.name == "uv":
    if args == ["--version"]:
        print("uv 0.13.9")
    raise SystemExit(0)
if args[:2] == ["-m", "venv"]:
    target = Path(args[-1])
    (target / "bin").mkdir(parents=True)
    shutil.copy(me, target / "bin" / "python")
    if "--without-pip" not in args:
        (target / "has-pip").touch()
    raise SystemExit(0)
if args[:2] == ["-m", "pip"]:
    rest = args[2:]
    if rest[:1] == ["--python"]:
        if venv is not None or os.environ.get("FAKE_BASE_PIP") != "1":
            raise SystemExit(2)  # no such option: an old pip, or no pip
        venv, rest = Path(rest[1]).parent.parent, rest[2:]
    elif venv is None or not (venv / "has-pip").exists():
        raise SystemExit(1)  # No module named pip
    if rest[:1] == ["install"]:
        if "torch" in " ".join(rest):
            (venv / "torch").touch()
        if any(a.startswith("uv") for a in rest):
            shutil.copy(me, venv / "bin" / "uv")
    raise SystemExit(0)
if args[:2] == ["-c", "import torch"]:
    raise SystemExit(0 if venv is not None and (venv / "torch").exists() else 1)
raise SystemExit(0)
'''


def _install(tmp_path: Path, *, base_pip: bool, **variables: str) -> list[list[str]]:
    """``make install`` into ``tmp_path/venv`` from the stand-in interpreter; every call it made."""
    base = tmp_path / "python3.11"
    base.write_text(FAKE.format(python=sys.executable))
    base.chmod(0o755)
    log = tmp_path / "calls.jsonl"
    env = {**os.environ, "FAKE_LOG": str(log), "FAKE_BASE_PIP": "1" if base_pip else "0"}
    done = subprocess.run(["make", "-s", "-C", str(ROOT), "install", f"PYTHON={base}", f"VENV={tmp_path / 'venv'}",
                           *(f"{k}={v}" for k, v in variables.items())], env=env, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "venv" / ".installed").is_file()
    return [json.loads(line) for line in log.read_text().splitlines()]


def test_a_new_venv_is_made_without_pip_where_the_base_interpreters_pip_installs_into_it(tmp_path):
    calls = _install(tmp_path, base_pip=True)
    venv = tmp_path / "venv"
    assert ["python3.11", "-m", "venv", "--without-pip", str(venv)] in calls
    into = ["python3.11", "-m", "pip", "--python", str(venv / "bin" / "python"), "install", "--no-compile"]
    assert [*into, "torch==2.13.0", "-c", "constraints.txt"] in calls
    assert [*into, "uv==0.13.9"] in calls
    uv = [c for c in calls if c[0] == str(venv / "bin" / "uv") and c[1:3] == ["pip", "install"]]
    assert len(uv) == 1 and "pip==26.3" in uv[0] and "-e" in uv[0]  # .venv gets its own pip with the rest


def test_without_a_pip_beside_the_base_interpreter_venv_brings_its_own(tmp_path):
    calls = _install(tmp_path, base_pip=False)
    venv = tmp_path / "venv"
    assert ["python3.11", "-m", "venv", str(venv)] in calls
    own = [str(venv / "bin" / "python"), "-m", "pip", "install", "--no-compile"]
    assert [*own, "torch==2.13.0", "-c", "constraints.txt"] in calls
    assert [*own, "uv==0.13.9"] in calls


@pytest.mark.parametrize("base_pip", [True, False], ids=["base-pip", "venv-pip"])
def test_a_torch_spec_with_pips_options_reaches_pip_as_separate_arguments(tmp_path, base_pip):
    """The GPU install the Makefile and docs/training.md give: pip gets the index as an option (one
    quoted argument was read as a path, "torch --index-url ...")."""
    url = "https://download.pytorch.org/whl/cu128"
    calls = _install(tmp_path, base_pip=base_pip, TORCH_SPEC=f"torch --index-url {url}", CONSTRAINTS="")
    torch = [c for c in calls if "install" in c and "torch" in c]
    assert len(torch) == 1 and torch[0][-3:] == ["torch", "--index-url", url]


def test_a_second_install_reinstalls_nothing_it_has(tmp_path):
    _install(tmp_path, base_pip=True)
    (tmp_path / "calls.jsonl").unlink()
    (tmp_path / "venv" / ".installed").unlink()  # as after pyproject.toml changed
    calls = _install(tmp_path, base_pip=True)
    assert not [c for c in calls if c[0] == "python3.11" or c[1:3] == ["-m", "pip"]]  # .venv, torch and uv are there
    assert [c[1:3] for c in calls if c[0].endswith("/uv")] == [["--version"], ["pip", "install"]]
