"""The tool a user gets from ``pip install``: optbench built as a wheel, installed into a fresh venv,
run from a directory outside the checkout.

What this proves and what it does not: the wheel is built from a copy of the checkout's sources
(``pip wheel --no-deps --no-build-isolation``, with this venv's setuptools: no index needed) and
installed with ``pip install --no-deps`` into a venv created without system site-packages. Its
dependencies are not downloaded again: the venv sees, through one .pth path, a directory of links
to exactly the distributions of the wheel's own ``Requires-Dist`` closure as this machine has them
installed (torch, hydra-core, ... and what they require; not pytest, not the editable optbench).
So the installed package, its packaged configs (``optbench.conf``), its console script and its
declared dependencies are what runs; that pip would resolve the same versions from an index is not
checked here.
"""

from __future__ import annotations

import importlib.metadata as metadata
import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parent.parent
SOURCES = ("pyproject.toml", "README.md", "optbench", "conf")


def _dependency_closure(requirements: list[str]) -> list[metadata.Distribution]:
    """The installed distributions that ``requirements`` need, transitively (markers evaluated,
    extras not followed)."""
    seen: dict[str, metadata.Distribution] = {}
    todo = list(requirements)
    while todo:
        req = Requirement(todo.pop())
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        key = req.name.lower().replace("_", "-")
        if key in seen:
            continue
        try:
            dist = metadata.distribution(req.name)
        except metadata.PackageNotFoundError:
            continue  # an optional platform dependency; the runs below show whether it was needed
        seen[key] = dist
        todo.extend(dist.requires or [])
    return list(seen.values())


def _link_distributions(dists: list[metadata.Distribution], into: Path) -> None:
    """Link every top-level entry (package, module, .libs, .dist-info) the distributions installed."""
    into.mkdir()
    for dist in dists:
        site = Path(dist.locate_file(""))
        tops = {Path(f).parts[0] for f in dist.files or [] if not str(f).startswith("..")}
        for top in tops:
            target = into / top
            if (site / top).exists() and not target.exists():
                target.symlink_to(site / top)


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """A fresh venv with the optbench wheel installed; returns its bin/ directory."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    src.mkdir()
    for name in SOURCES:
        path = ROOT / name
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(path, src / name)
    quiet = {"check": True, "capture_output": True, "text": True, "timeout": 300}
    subprocess.run([sys.executable, "-m", "pip", "wheel", str(src), "--no-deps", "--no-build-isolation",
                    "-w", str(tmp / "dist"), "-q"], **quiet)
    (wheel,) = (tmp / "dist").glob("optbench-*.whl")
    venv = tmp / "venv"
    subprocess.run([sys._base_executable, "-m", "venv", "--without-pip", str(venv)], **quiet)
    python = venv / "bin" / "python"
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index",
                    "-q", str(wheel)], **quiet)
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               **quiet).stdout.strip())
    requires = metadata.distribution("optbench").requires or []  # this checkout's pyproject, as the wheel's
    deps = tmp / "deps"
    _link_distributions(_dependency_closure(requires), deps)
    (site / "optbench-test-deps.pth").write_text(f"{deps}\n")
    assert Path(sysconfig.get_paths()["purelib"]) != site
    return venv / "bin"


def _env(bin_dir: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "HYDRA_FULL_ERROR")}
    env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"
    env["OMP_NUM_THREADS"] = "1"  # nothing here is timed; two spinning OpenMP threads on a loaded CPU cost seconds a step
    return env


def _start(bin_dir: Path, cwd: Path, *args: str) -> subprocess.Popen:
    """``optbench ARGS`` through the venv's console script, in ``cwd`` (outside the checkout)."""
    return subprocess.Popen([str(bin_dir / "optbench"), *args], cwd=cwd, env=_env(bin_dir),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_the_installed_wheel_trains_estimates_and_reports_outside_the_checkout(installed, tmp_path):
    probe = subprocess.run(
        [str(installed / "python"), "-c",
         "import importlib.util as u, optbench, optbench.config as c; "
         "print(optbench.__file__); print(c.conf_dir()); print(u.find_spec('pytest'))"],
        cwd=tmp_path, env=_env(installed), capture_output=True, text=True, check=True,
    )
    package, conf, pytest_spec = probe.stdout.splitlines()
    venv = installed.parent
    assert Path(package).is_relative_to(venv) and Path(conf) == Path(package).parent / "conf"
    assert pytest_spec == "None"  # only the wheel's declared dependencies are visible, not the dev tools

    run_dir = tmp_path / "run"
    estimate = _start(installed, tmp_path, "estimate", "model=tiny", "train.batch_size=2", "train.seq_len=32",
                      "estimate.search=false")
    train = _start(installed, tmp_path, "train", "model=tiny", "train.device=cpu", "train.steps=4",
                   "train.batch_size=2", "train.seq_len=32", "measure.warmup_steps=1", "train.eval_batches=1",
                   "log.progress=log", f"hydra.run.dir={run_dir}")
    train_out, train_err = train.communicate(timeout=300)
    estimate_out, estimate_err = estimate.communicate(timeout=300)
    assert train.returncode == 0, train_err[-2000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["steps"] == 4
    assert estimate.returncode == 0, estimate_err[-2000:]
    assert "parameters" in estimate_out.lower(), estimate_out

    report = subprocess.run([str(installed / "optbench"), "report", str(run_dir)], cwd=tmp_path, env=_env(installed),
                            capture_output=True, text=True, timeout=300)
    assert report.returncode == 0, report.stderr[-2000:]
    assert (run_dir / "report.md").is_file() and "completed" in report.stdout


def test_every_package_of_the_checkout_goes_into_the_wheel():
    """pyproject.toml lists the packages explicitly (conf/ is mapped to optbench.conf): a new
    subpackage left off the list imports in the checkout and is missing from the wheel."""
    import re

    line = re.search(r"^packages = \[(.*?)\]$", (ROOT / "pyproject.toml").read_text(), re.M | re.S)
    listed = set(re.findall(r'"([\w.]+)"', line.group(1)))
    found = {".".join(init.parent.relative_to(ROOT).parts) for init in (ROOT / "optbench").rglob("__init__.py")}
    assert found <= listed, f"add {sorted(found - listed)} to [tool.setuptools] packages in pyproject.toml"
