"""The documentation cannot rot: README.md and docs/*.md.

Every ```bash block carries a marker on the line before it: ``<!-- runnable -->`` or
``<!-- template: why it is not run -->`` (placeholders such as ``SWEEP`` or ``...``, a cluster, a
GPU, minutes of CPU). Output is fenced as ``text`` or ``console`` and never run.

* The commands of runnable blocks run in order, one document per temporary directory, as a user
  types them (through ``optbench.cli.main``, the function the entry point ``optbench`` calls, one
  after the other in the test's process; tests/test_wheel.py runs the real entry point), with
  tiny sizes appended (a later Hydra override wins): ``optbench train`` gets the
  tiny model and three steps without the step's prediction before the loop (its per-op benchmark
  costs seconds per run; tests/estimate/test_predict.py tests it), ``optbench estimate`` the tiny
  model, ``optbench data synth`` a small grid. ``make TARGET`` is checked with ``make -n`` (the target exists and expands): ``make test``
  would run this suite again, and ``make run`` is ``optbench train``, which the README runs itself.
* Every config an ``optbench train|estimate|compare|validate`` line of any block composes (templates
  too; lines with a placeholder excepted) is composed with Hydra and typed, each value of a sweep at
  least once, so a renamed group or key cannot survive in the docs.
* An old name still runs, under its new one with a one-line notice (``optbench.config.renames``), so
  composing alone would let it pass: a runnable command that prints a rename notice fails, every
  documented line (placeholders too) must use today's names on every side, and so must every name
  the pages mention in backticks, except on docs/renames.md, the table of old names.
* Every relative link and its ``#anchor``, every repository path and every ``optbench.`` name the
  pages mention in backticks exists; nothing points outside the repository.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import itertools
import re
import shlex
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.helpers import ROOT

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MARKER = re.compile(r"^<!--\s*(runnable|template)\s*(?::\s*(.+?))?\s*-->$")
RENAMES = ROOT / "docs" / "renames.md"  # the one page that names the old names
RENAMED = re.compile(r"^optbench: warning: .+ is now .+; ran with .+$", re.M)  # optbench.config.renames' notice
PLACEHOLDER = re.compile(r"\.\.\.|<[A-Za-z_ ]+>|\b(SWEEP|DIR|PATH|NAME|KEY|VALUE|PHASE|A_OVERRIDES|B_OVERRIDES)\b")

TINY = {
    "train": ["model=tiny", "train.device=cpu", "train.steps=3", "train.batch_size=2", "train.seq_len=16",
              "measure.warmup_steps=1", "train.eval_batches=1", "measure.track_memory=false", "log.progress=log",
              "estimate.predict=false", "estimate.in_run=false"],
    "estimate": ["model=tiny", "train.batch_size=1", "train.seq_len=16", "estimate.search=false"],
    "synth": ["--days", "12", "--nlat", "8", "--nlon", "16", "--levels", "1000", "500"],
    "generate": ["--samples", "2", "--max-tokens", "8"],
}


@dataclass
class Block:
    doc: Path
    line: int  # of the opening fence, 1-based
    lang: str
    marker: str | None  # runnable | template | None
    text: str

    @property
    def where(self) -> str:
        return f"{self.doc.relative_to(ROOT)}:{self.line}"


def blocks(doc: Path) -> list[Block]:
    found, lines, opened = [], doc.read_text().split("\n"), None
    for number, line in enumerate(lines, 1):
        if not line.startswith("```"):
            continue
        if opened is None:
            before = next((lines[i].strip() for i in range(number - 2, -1, -1) if lines[i].strip()), "")
            marker = MARKER.match(before)
            opened = (number, line[3:].strip(), marker.group(1) if marker else None)
        else:
            start, lang, marker = opened
            found.append(Block(doc, start, lang, marker, "\n".join(lines[start:number - 1])))
            opened = None
    assert opened is None, f"{doc.relative_to(ROOT)}:{opened[0]}: a fence that is never closed"
    return found


def commands(block: Block) -> list[list[str]]:
    """The block's command lines (continuations joined), as argv lists without comments."""
    joined = block.text.replace("\\\n", " ")
    return [argv for line in joined.split("\n") if (argv := shlex.split(line, comments=True))]


def prose(doc: Path) -> str:
    """The page without its fenced blocks."""
    return re.sub(r"^```.*?^```", "", doc.read_text(), flags=re.S | re.M)


# ------------------------------------------------------------------------------- the markers
@pytest.mark.parametrize("doc", DOCS, ids=lambda d: d.name)
def test_every_command_block_is_marked_and_every_fence_names_its_language(doc):
    for block in blocks(doc):
        assert block.lang, f"{block.where}: name the fence's language (bash for commands, text for output)"
        if block.lang == "bash":
            assert block.marker, f"{block.where}: mark the block <!-- runnable --> or <!-- template: why -->"
            if block.marker == "runnable":
                for argv in commands(block):
                    assert not PLACEHOLDER.search(shlex.join(argv)), (
                        f"{block.where}: `{shlex.join(argv)}` holds a placeholder; mark the block template")
        else:
            assert block.marker is None, f"{block.where}: only bash blocks are run"


def test_the_readme_is_a_page_with_the_two_command_quick_start():
    readme = ROOT / "README.md"
    assert len(readme.read_text().splitlines()) <= 200
    quick = [shlex.join(argv) for block in blocks(readme) if block.marker == "runnable"
             for argv in commands(block)]
    assert "make run" in quick and "make test" in quick


# ------------------------------------------------------------------------ runnable commands
def _tiny(argv: list[str], where: str) -> list[str]:
    """The command as it runs here: ``make -n`` for make, optbench's arguments with tiny sizes appended."""
    if argv[0] == "make":
        return ["make", "-n", "-C", str(ROOT), *argv[1:]]
    assert argv[0] == "optbench", f"{where}: `{shlex.join(argv)}` is not an optbench or make command"
    command, rest = argv[1], argv[2:]
    if command in ("train", "estimate"):
        extra = TINY[command]
    elif command == "data" and rest[0] == "synth":
        extra = TINY["synth"]
    elif command == "generate":
        extra = TINY["generate"]
    elif command == "report" or command == "data":
        extra = []
    else:
        raise AssertionError(f"{where}: `optbench {command}` has no tiny size here; mark its block template")
    return [command, *rest, *extra]


# one document's optbench commands, in order, in this process (the test's own temporary directory):
# each through optbench.cli.main by tests.helpers.run_cli_here (Hydra's state, the signal handlers and
# logging put back between commands); a crash is exit 1 and its traceback on stderr, as the command's
# own process would end. A fresh process per document added seconds of imports and nothing the
# commands check; tests/test_wheel.py runs the installed entry point in its own processes.
def _run_optbench(commands: list[list[str]]) -> list[tuple[int, str, str]]:
    import traceback

    from tests.helpers import Captured, run_cli_here

    results = []
    for argv in commands:
        captured = Captured()
        with captured.captured():
            try:
                done = run_cli_here(*argv, capsys=captured)
                results.append((done.returncode, done.stdout, done.stderr))
            except Exception:  # noqa: BLE001 -- a crash is the command's exit 1, then the next command
                out, err = captured.readouterr()
                results.append((1, out, err + traceback.format_exc()))
    return results


RUNNABLE = [doc for doc in DOCS if any(b.marker == "runnable" for b in blocks(doc))]


@pytest.mark.parametrize("doc", RUNNABLE, ids=lambda d: d.name)
def test_runnable_commands_run_at_tiny_sizes(doc, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # one document per temporary directory, its commands run there in order
    lines = [(block.where, argv, _tiny(argv, block.where)) for block in blocks(doc) if block.marker == "runnable"
             for argv in commands(block)]
    ran = iter(_run_optbench([run for _, _, run in lines if run[0] != "make"]))
    for where, argv, run in lines:
        if run[0] == "make":
            made = subprocess.run(run, capture_output=True, text=True, timeout=60)
            code, out, err = made.returncode, made.stdout, made.stderr
        else:
            code, out, err = next(ran)
            run = ["optbench", *run]
        assert code == 0 and "Traceback" not in err, (
            f"{where}: `{shlex.join(argv)}` (run as `{shlex.join(run)}`) exited {code}:\n{out[-2000:]}\n{err[-3000:]}")
        assert not (old := RENAMED.findall(err)), f"{where}: `{shlex.join(argv)}` uses an old name (docs/renames.md): {old}"


# ------------------------------------------------------------------------- composed overrides
def _hydra_overrides(args: list[str]) -> list[str]:
    """The overrides of a train/estimate line: flags (``-m``, ``--cfg job``) and ``hydra.*`` dropped."""
    overrides, skip = [], False
    for arg in args:
        if skip:
            skip = False
        elif arg == "--cfg":
            skip = True
        elif not arg.startswith("-") and not arg.lstrip("+").startswith(("hydra.", "hydra/")):
            overrides.append(arg)
    return overrides


def _sides(argv: list[str]) -> list[tuple[str, list[str]]]:
    """(config name, overrides) of every config an optbench line composes: train and estimate (also
    under torchrun); compare's A and B; validate's baseline and, when given, its candidate."""
    if "optbench" not in argv or argv.index("optbench") + 1 >= len(argv):
        return []
    at = argv.index("optbench")
    command, args = argv[at + 1], argv[at + 2:]
    if command in ("train", "estimate"):
        return [(command, _hydra_overrides(args))]
    if command == "compare":
        from optbench.report.command import compare_parser, split_argv

        _, side_a, side_b = split_argv(args, compare_parser())
        return [("train", side_a), ("train", side_b)]
    if command == "validate":
        from optbench.validate.command import build_parser
        from optbench.validate.setup import Side, phase_names, side_overrides, split_overrides

        common, baseline, candidate = split_overrides(build_parser().parse_args(args).overrides)
        base = side_overrides(baseline, what="baseline", phases=phase_names(), default_phase="0_baseline")
        sides = [base]
        if candidate:
            sides.append(side_overrides(candidate, what="candidate", phases=phase_names(),
                                        default_phase=Side("A", "baseline", base).phase))
        return [("train", [*side, *common]) for side in sides]
    return []


def _sides_and_renames(argv: list[str]) -> tuple[list[tuple[str, list[str]]], list[str]]:
    """``_sides(argv)`` and the rename notices of its overrides: validate reads an old name (a phase
    too) under its new one while it splits the sides, so its notices are caught on stderr."""
    from optbench.config.renames import upgrade_overrides

    with contextlib.redirect_stderr(io.StringIO()) as said:
        sides = _sides(argv)
    notices = [line.removeprefix("optbench: warning: ") for line in said.getvalue().splitlines() if RENAMED.match(line)]
    return sides, notices + [n for _, overrides in sides for n in upgrade_overrides(overrides)[1]]


def _jobs(overrides: list[str]) -> list[list[str]]:
    """A sweep's jobs, enough that each value of each swept key is composed at least once."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.override_parser.types import ValueType

    from optbench.config import conf_dir

    choices = []
    for override in OverridesParser.create().parse_overrides(overrides):
        text = override.input_line
        if not override.is_sweep_override():
            choices.append([text])
            continue
        key = override.get_key_element()
        if override.value_type == ValueType.GLOB_CHOICE_SWEEP:
            group = conf_dir() / override.key_or_group
            names = sorted(p.stem for p in group.glob("*.yaml"))
            values = override.value().filter(names)
        else:
            values = list(override.sweep_string_iterator())
        choices.append([f"{key}={value}" for value in values])
    longest = max((len(c) for c in choices), default=1)
    return [[c[i % len(c)] for c in choices] for i in range(longest)]


def _documented_jobs() -> list[tuple[str, str, list[str]]]:
    found = {}
    for doc in DOCS:
        for block in blocks(doc):
            if block.lang != "bash":
                continue
            for argv in commands(block):
                if PLACEHOLDER.search(shlex.join(argv)):
                    continue
                for name, overrides in _sides(argv):
                    for job in _jobs(overrides):
                        found.setdefault((name, tuple(job)), block.where)
    return [(where, name, list(job)) for (name, job), where in found.items()]


def test_documented_commands_use_todays_names():
    stale = []
    for doc in DOCS:
        for block in (b for b in blocks(doc) if b.lang == "bash"):
            for argv in commands(block):
                stale += [f"{block.where}: `{shlex.join(argv)}`: {n}" for n in _sides_and_renames(argv)[1]]
    assert not stale, "old names in documented commands (write them as docs/renames.md says):\n" + "\n".join(stale)


def test_an_old_name_in_a_documented_command_is_caught():
    for line in ("optbench train checkpointing=full", "optbench estimate train.max_minutes=2",
                 "optbench compare -- compile=off", "optbench validate candidate=2_checkpointing",
                 "optbench validate model=base"):
        assert _sides_and_renames(shlex.split(line))[1], line
    assert not _sides_and_renames(shlex.split("optbench validate candidate=2_ac model=tiny"))[1]


@pytest.mark.parametrize("doc", [d for d in DOCS if d != RENAMES], ids=lambda d: d.name)
def test_the_pages_name_no_old_name(doc):
    """Outside docs/renames.md an old name is named only in a paragraph that links to it."""
    from optbench.config.renames import upgrade_override

    paragraphs = [p for p in re.split(r"\n\s*\n", prose(doc)) if not re.search(r"\]\((docs/)?renames\.md", p)]
    spans = set(itertools.chain.from_iterable(
        re.split(r"\s+", span) for span in re.findall(r"`([^`\n]+)`", "\n\n".join(paragraphs))))
    old = sorted(span for span in spans if upgrade_override(span.strip(",.;:()"))[1])
    assert not old, f"{doc.relative_to(ROOT)} names old names (docs/renames.md has the new ones): {old}"


# a schema that reads the user's own directory at composition (model.hf.config=DIR) says it is missing
READERS_PATH = re.compile(r"=(path/to/|DIR\b)\S*: no such (directory|file)")


# ~90 lines, 65 lists of presets (a composition of ~0.3 s each, which optbench.config.compose makes
# once per process and list): in shards, so pytest-xdist's workers share them
SHARDS = 3


@pytest.mark.parametrize("shard", range(SHARDS))
def test_documented_overrides_compose_and_type_check(shard):
    from optbench.config import compose, to_config

    jobs = _documented_jobs()
    assert len(jobs) > 20, "the docs' optbench train/estimate lines were not found"
    failures = []
    ordered = sorted(jobs, key=lambda job: (job[1], job[2]))  # a shard's lines share presets
    size = -(-len(ordered) // SHARDS)
    for where, name, overrides in ordered[shard * size:(shard + 1) * size]:
        try:
            to_config(compose(overrides, config_name=name))
        except Exception as exc:  # noqa: BLE001 -- every failure is listed, then the test fails
            if READERS_PATH.search(str(exc)):  # the composed config is fine; the directory is the reader's
                continue
            failures.append(f"{where}: optbench {name} {shlex.join(overrides)}: {type(exc).__name__}: {exc}")
    assert not failures, "\n".join(failures)


# --------------------------------------------------------------------- links, paths and names
def slug(heading: str) -> str:
    """GitHub's anchor of a heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(doc: Path) -> set[str]:
    seen: dict[str, int] = {}
    for line in prose(doc).split("\n"):
        if match := re.match(r"^#{1,6} (.+)$", line):
            base = slug(match.group(1))
            count = seen.get(base, 0)
            seen[base] = count + 1
            seen.setdefault(f"{base}-{count}" if count else base, 1)
    return set(seen)


@pytest.mark.parametrize("doc", DOCS, ids=lambda d: d.name)
def test_links_and_their_anchors_exist_inside_the_repository(doc):
    text = prose(doc)
    assert "../shared" not in doc.read_text() and not re.search(r"\bissues? #?\d+", text, re.I), (
        f"{doc.relative_to(ROOT)}: name the documents and issues outside the repository by what they are")
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+://|mailto:", target):
            continue
        path, _, anchor = target.partition("#")
        resolved = (doc.parent / path).resolve() if path else doc
        assert resolved.is_relative_to(ROOT), f"{doc.relative_to(ROOT)}: {target} points outside the repository"
        assert resolved.exists(), f"{doc.relative_to(ROOT)}: link {target}: {path} does not exist"
        if anchor:
            assert anchor in anchors(resolved), f"{doc.relative_to(ROOT)}: link {target}: no heading #{anchor}"


REPO_PATH = re.compile(r"^(optbench|tests|bench|conf|docs)/[\w.*/-]*(:\w+)?$|^(Makefile|pyproject\.toml|README\.md)$")
DOTTED = re.compile(r"^optbench(\.[A-Za-z_]\w*)+$(?<!\.json)")


def _exists(name: str) -> bool:
    path, _, symbol = name.partition(":")
    matches = list(ROOT.glob(path.rstrip("/"))) if "*" in path else [ROOT / path]
    if not all(m.exists() for m in matches) or not matches:
        return False
    if symbol:  # file.py:NAME: NAME is defined there
        return re.search(rf"^(def |class )?{symbol}\b", matches[0].read_text(), re.M) is not None
    return True


def _resolves(dotted: str) -> bool:
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            target = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attribute in parts[cut:]:
            if not hasattr(target, attribute):
                return False
            target = getattr(target, attribute)
        return True
    return False


def named(doc: Path) -> tuple[list[str], list[str]]:
    """The repository paths and the ``optbench.`` names a page mentions in backticks."""
    names = set(itertools.chain.from_iterable(
        re.split(r"[\s,]+", span) for span in re.findall(r"`([^`\n]+)`", prose(doc))))
    paths = [n for n in names if REPO_PATH.match(n) and "<" not in n]
    return paths, [n.rstrip("()") for n in names if DOTTED.match(n.rstrip("()"))]


def test_the_patterns_find_what_the_pages_name():
    paths, dotted = (sum(found, []) for found in zip(*(named(doc) for doc in DOCS), strict=True))
    assert len(paths) > 50 and len(dotted) > 10 and "optbench/training/preflight.py" in paths


@pytest.mark.parametrize("doc", DOCS, ids=lambda d: d.name)
def test_every_path_and_module_the_pages_name_exists(doc):
    paths, dotted = named(doc)
    missing = [n for n in sorted(paths) if not _exists(n)] + [n for n in sorted(dotted) if not _resolves(n)]
    assert not missing, f"{doc.relative_to(ROOT)} names what does not exist: {missing}"


def _package_rows() -> dict[str, str]:
    """docs/design.md's package table: each row's first cell -> the rest of the row."""
    section = (ROOT / "docs" / "design.md").read_text().split("## The packages", 1)[1].split("\n## ", 1)[0]
    rows = [line.strip("|").split(" | ", 1) for line in section.splitlines() if line.startswith("| `")]
    return {first.strip(): rest for first, rest in rows}


def _table_gaps(rows: dict[str, str], package: Path) -> tuple[list[str], list[str]]:
    """The modules under ``package`` the table does not name where they belong (a top-level module in
    a first cell, a package as `optbench/pkg/` with each module as `name.py` in its row), and the
    `name.py` a package's row names that its package does not hold."""
    firsts = {name for cell in rows for name in re.findall(r"`([^`]+)`", cell)}
    missing, stale = [], []
    for path in sorted(package.rglob("*.py")):
        where = path.parent.relative_to(ROOT).as_posix()
        if where == package.name:
            if path.relative_to(ROOT).as_posix() not in firsts:
                missing.append(path.relative_to(ROOT).as_posix())
        elif f"`{where}/`" not in rows:
            missing.append(f"{where}/ (no row)")
        elif path.name != "__init__.py" and f"`{path.name}`" not in rows[f"`{where}/`"]:
            missing.append(path.relative_to(ROOT).as_posix())
    for cell, rest in rows.items():
        folder = cell.strip("`")
        if folder.endswith("/"):
            named = re.findall(r"`(\w+\.py)`", rest)
            stale += [f"{folder}{name}" for name in named if not (ROOT / folder / name).is_file()]
    return missing, stale


def test_the_design_table_names_every_package_and_module():
    missing, stale = _table_gaps(_package_rows(), ROOT / "optbench")
    assert not missing, f"docs/design.md's package table does not name: {', '.join(missing)}"
    assert not stale, f"docs/design.md's package table names modules that do not exist: {', '.join(stale)}"


def test_the_design_table_check_finds_a_missing_and_a_stale_module(tmp_path, monkeypatch):
    import tests.test_docs as this

    package = tmp_path / "optbench"
    (package / "run").mkdir(parents=True)
    for name in ("cli.py", "run/__init__.py", "run/train.py", "run/new.py"):
        (package / name).write_text("")
    monkeypatch.setattr(this, "ROOT", tmp_path)
    rows = {"`optbench/cli.py`": "dispatch", "`optbench/run/`": "`train.py`, `gone.py`"}
    assert _table_gaps(rows, package) == (["optbench/run/new.py"], ["optbench/run/gone.py"])


# ----------------------------------------------------------------------- documented sample outputs
# A documented sample output has the shape of what its command prints today: the same leading
# labels in the same order. (document, how the sample's first line starts, the command at a tiny size)
SAMPLES = [
    ("docs/estimate.md", "optbench estimate ", ["estimate", "model=tiny", "train.batch_size=1", "train.seq_len=16"]),
    ("README.md", "optbench run completed", ["train", *TINY["train"]]),
]


def output_labels(text: str) -> list[str]:
    """Each line's leading label: the command's first two words, then every line at two spaces' indent
    up to its first figure, bracket or wide gap (``  micro-batch  largest ...`` -> ``micro-batch``,
    ``  traced in 8.2 s`` -> ``traced in``); deeper lines (a table's rows, continued lines) and repeats
    of the label above are left out."""
    labels: list[str] = []
    for line in text.splitlines():
        indent = len(line) - len(line.lstrip())
        if not line.strip() or indent > 2:
            continue
        if indent == 0:
            label = " ".join(line.split()[:2])
        else:
            words = re.split(r"\s{2,}", line.strip())[0].split(" ")
            label = " ".join(itertools.takewhile(lambda w: not re.match(r"[\d(+\-]", w), words))
        if not labels or labels[-1] != label:
            labels.append(label)
    return labels


def test_the_label_reading_finds_each_lines_label():
    text = ("optbench estimate for an H100: tiny\n  parameters   1,049,728\n  memory per device          traced\n"
            "    peak      1 MiB\n  micro-batch  largest that fits: 3\n               continued\n  note         a\n"
            "  note         b\n  traced in 8.2 s (one step)\n")
    assert output_labels(text) == ["optbench estimate", "parameters", "memory per device", "micro-batch", "note",
                                   "traced in"]


@pytest.mark.parametrize(("doc", "start", "argv"), SAMPLES, ids=[s[0] for s in SAMPLES])
def test_documented_sample_outputs_have_the_shape_the_command_prints(doc, start, argv, tmp_path, monkeypatch, capsys):
    from tests.helpers import run_cli_here

    monkeypatch.chdir(tmp_path)
    sample = next((b.text for b in blocks(ROOT / doc) if b.lang == "text" and b.text.startswith(start)), None)
    assert sample is not None, f"{doc}: no sample output starting with `{start}`"
    done = run_cli_here(*argv, *(["hydra.run.dir=run"] if argv[0] == "train" else []), capsys=capsys)
    assert done.returncode == 0, done.stderr[-2000:]
    printed = done.stdout[done.stdout.index(start):]
    assert output_labels(sample) == output_labels(printed), (
        f"{doc}: its sample output of `optbench {argv[0]}` has other lines than the command prints today; "
        f"paste what it prints:\n{printed}")
