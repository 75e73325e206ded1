"""What a run leaves in its directory: ``metrics.jsonl``, TensorBoard event files, ``train.log`` and
``summary.json``.

``summary.json`` is a contract read by ``optbench report`` and later features: the typed record
``optbench.summary.RunSummary`` is its one definition (every field present, ``null`` where not
measured) and ``write_run_summary`` the one writer. It is written atomically (temp file + rename) so
a crash never leaves half a summary behind.

Nothing measured is lost: a run holds a lock on its directory (``optbench.files.DirLock``) from
``RunOutputs`` to ``close()``, so a second run there is refused with one line naming the holder;
a run that stops before it starts training (``open_streams``) never replaces a summary that records
trained steps (re-running a finished run in its directory is refused and leaves it as it was); a
torn last line of ``metrics.jsonl`` (a kill or a full disk mid-write) is skipped by readers and cut
off when the run is resumed.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
import re
import shutil
import textwrap
import threading
from pathlib import Path
from typing import Any

from optbench.errors import ConfigError
from optbench.files import (
    DirLock,
    LockedError,
    OutputError,
    open_private,
    os_error_message,
    parse_jsonl,
    refuse_link,
    release_all,
    write_atomic,
)
from optbench.summary import RunSummary, recorded_steps, unreadable_summary

log = logging.getLogger(__name__)


def config_hash(resolved: dict[str, Any]) -> str:
    """Short, stable hash of the resolved config (key order does not matter)."""
    blob = json.dumps(resolved, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:12]


def _jsonable(value: Any) -> Any:
    """NaN/inf are not JSON: write them as strings so readers see what happened."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value


def write_json_atomic(path: Path, data: Any) -> None:
    write_atomic(path, json.dumps(_jsonable(data), indent=2, sort_keys=False) + "\n")


def write_run_summary(run_dir: str | Path, record: RunSummary) -> None:
    """``run_dir``/summary.json from ``record``, atomically (the only writer of summary.json)."""
    write_json_atomic(Path(run_dir) / "summary.json", record.to_dict())


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """The records of a run's metrics.jsonl; a torn last line is skipped."""
    return parse_jsonl(Path(run_dir) / "metrics.jsonl")[0]


def file_stamp(path: Path) -> tuple[int, int] | None:
    """(inode, mtime) of ``path``, None when it cannot be read: whether a file was rewritten."""
    try:
        stat = path.stat()
    except OSError:
        return None
    return stat.st_ino, stat.st_mtime_ns


def _fresh_metrics(path: Path, kept: list[dict[str, Any]]) -> Any:
    """metrics.jsonl holding ``kept``, open for appending: written beside it (``open_private``: no
    link followed) and renamed over it, so a failed write leaves the old one whole."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    handle = None
    try:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()  # a leftover of a killed run (never a link's target: unlink removes the link)
        handle = open_private(tmp)
        handle.writelines(json.dumps(r) + "\n" for r in kept)
        handle.flush()
        os.fsync(handle.fileno())
        os.replace(tmp, path)
        return handle
    except OSError as exc:
        if handle is not None:
            handle.close()
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise OutputError(os_error_message(exc, "write the run's metrics")) from None


class RunOutputs:
    """Writers for one run directory. ``enabled=False`` (non-zero ranks) writes nothing."""

    def __init__(self, run_dir: str | Path, *, enabled: bool = True) -> None:
        self.run_dir = Path(run_dir)
        self.enabled = enabled
        self._metrics = None
        self._tb = None
        self._log_handler: logging.Handler | None = None
        self._lock: DirLock | None = None
        self.refusal: ConfigError | None = None  # why this run may not write here (raised by open_streams)
        self.started = False  # open_streams ran: the run trains, and its summary replaces any before it
        self.summary_error: str | None = None  # why summary.json could not be written
        self._protected = recorded_steps(self.run_dir) if enabled else 0
        # read again only where no trained steps were found: steps it records protect it already
        self._unreadable = enabled and not self._protected and unreadable_summary(self.run_dir) is not None
        self._summary_stamp = file_stamp(self.run_dir / "summary.json")
        if enabled:
            try:
                self.run_dir.mkdir(parents=True, exist_ok=True)
                self._lock = DirLock.acquire(self.run_dir, what="training")
            except (LockedError, OutputError) as exc:  # another run, or a planted link (UnsafePathError)
                self.refusal = exc
                return
            except OSError as exc:
                self.refusal = OutputError(os_error_message(exc, "use the run directory"))
                return
            self._attach_log_file()

    def _attach_log_file(self) -> None:
        """Under Hydra, job logging already writes ``train.log`` here; elsewhere (tests, scripts)
        attach a handler so every run has its log."""
        target = str((self.run_dir / "train.log").resolve())
        for handler in logging.getLogger().handlers:
            if isinstance(handler, logging.FileHandler) and handler.baseFilename == target:
                return
        handler = logging.FileHandler(target)
        handler.setFormatter(logging.Formatter("[%(asctime)s][%(name)s][%(levelname)s] - %(message)s"))
        logging.getLogger().addHandler(handler)
        if logging.getLogger().level > logging.INFO or logging.getLogger().level == logging.NOTSET:
            logging.getLogger().setLevel(logging.INFO)
        self._log_handler = handler

    def reopen_log(self) -> None:
        """Write ``train.log`` anew (the one open was moved away with an earlier run's files)."""
        if self._log_handler is not None:
            logging.getLogger().removeHandler(self._log_handler)
            self._log_handler.close()
            self._log_handler = None
            self._attach_log_file()

    def raise_if_refused(self) -> None:
        """The refusal (another run holds the directory, or it cannot be used), if any."""
        if self.refusal is not None:
            raise self.refusal

    def open_streams(self, *, resume_step: int = 0, tensorboard: bool = True) -> None:
        """Open metrics.jsonl and (``tensorboard``) the TensorBoard writer, fresh; a run resumed after ``resume_step``
        steps keeps the records of the steps before it and drops later ones (written after its
        checkpoint by the interrupted run), and TensorBoard purges them likewise."""
        if self.refusal is not None:
            raise self.refusal
        if not self.enabled:
            return
        path = self.run_dir / "metrics.jsonl"
        refuse_link(path, what="the run's metrics")
        kept: list[dict[str, Any]] = []
        if resume_step and path.is_file():
            records, torn = parse_jsonl(path)
            if torn:
                log.warning("%s; cut off before resuming", torn)
            kept = [r for r in records if isinstance(r.get("step"), int) and r["step"] < resume_step]
        self._metrics = _fresh_metrics(path, kept)
        self.started = True  # from here on this run's summary replaces the one before
        if not tensorboard:  # log.trackers without tensorboard
            return
        from torch.utils.tensorboard import SummaryWriter

        _tensorboard_thread_errors_in_one_line(self.run_dir / "tensorboard")
        self._tb = SummaryWriter(log_dir=str(self.run_dir / "tensorboard"), purge_step=resume_step or None)

    def log_metrics(self, record: dict[str, Any]) -> None:
        if not self.enabled or self._metrics is None:
            return
        try:
            self._metrics.write(json.dumps(_jsonable(record)) + "\n")
            self._metrics.flush()
        except OSError as exc:
            if exc.filename is None:
                exc.filename = str(self.run_dir / "metrics.jsonl")
            raise OutputError(os_error_message(exc, "append to the run's metrics")) from None

    def log_scalars(self, step: int, scalars: dict[str, float | None]) -> None:
        if not self.enabled or self._tb is None:
            return
        for tag, value in scalars.items():
            if value is not None and math.isfinite(value):
                self._tb.add_scalar(tag, value, step)

    def log_hparams(self, hparams: dict[str, Any], results: dict[str, float | None]) -> None:
        """The run's hyperparameters and final results for TensorBoard's HPARAMS tab."""
        if not self.enabled or self._tb is None:
            return
        clean = {k: v if isinstance(v, (int, float, str, bool)) else str(v) for k, v in hparams.items()}
        metrics = {k: v for k, v in results.items() if v is not None and math.isfinite(v)}
        try:
            self._tb.add_hparams(clean, metrics, run_name=".")
        except OSError as exc:  # a full disk or a file-size limit: the summary is still to be written
            log.error("%s", os_error_message(exc, "write TensorBoard's hyperparameters"))

    def write_summary(self, summary: RunSummary) -> bool:
        """Write summary.json; False (and a log line saying why) when it is not written: another
        run holds the directory, or this run never trained and the summary there records trained
        steps (a finished run re-run in its directory), or the file cannot be written."""
        if not self.enabled:
            return False
        path = self.run_dir / "summary.json"
        if self.refusal is not None:
            return False
        if not self.started and (self._protected or self._unreadable) and file_stamp(path) == self._summary_stamp:
            log.warning("%s (%s) left as it was: this run stopped before training (%s)", path,
                        f"{self._protected} trained steps" if self._protected else "unreadable", summary.status)
            return False
        try:
            write_run_summary(self.run_dir, summary)
        except OSError as exc:
            if exc.filename is None or Path(exc.filename).name.startswith(f".{path.name}."):
                exc.filename = str(path)  # not its temporary's name, or none (a write past ulimit -f)
            self.summary_error = os_error_message(exc, "write the summary")
            log.error("summary not written: %s", self.summary_error)
            return False
        return True

    def check_in_the_way(self, *, checkpoints: Path) -> None:
        """OutputError when something stands where this run writes an output (a file where its
        ``tensorboard`` or ``checkpoints`` directory goes, a directory where its summary or metrics
        go): found before anything is trained, not steps later."""
        if not self.enabled:
            return
        wanted = [(self.run_dir / "tensorboard", True, "writes its tensorboard directory"),
                  (checkpoints, True, "keeps its checkpoints"),
                  (self.run_dir / "summary.json", False, "writes its summary"),
                  (self.run_dir / "metrics.jsonl", False, "writes its metrics")]
        for path, is_dir, what in wanted:
            if path.exists() and path.is_dir() != is_dir:
                kind = "a directory" if path.is_dir() else "a file"
                raise OutputError(f"{path} is {kind} where this run {what}; move it away, or use another "
                                  "hydra.run.dir" + (" / checkpoint.dir" if path == checkpoints else ""))

    def close(self) -> None:
        try:
            if self._metrics is not None:
                self._metrics.close()
            if self._tb is not None:
                self._tb.close()
        except OSError as exc:  # a full disk: what was flushed before stays
            log.error("%s", os_error_message(exc, "finish writing the run's metrics"))
        finally:
            self._metrics = None
            self._tb = None
            self._lock = None
            release_all()  # the run directory's lock and a checkpoint.dir's
        if self._log_handler is not None:
            logging.getLogger().removeHandler(self._log_handler)
            self._log_handler.close()
            self._log_handler = None


_tensorboard_dir: list[Path] = []  # the TensorBoard directory of the run that last opened one


def _tensorboard_thread_errors_in_one_line(directory: Path) -> None:
    """TensorBoard writes its events from a thread of its own; a write that fails there (a full disk,
    a file-size limit) ended that thread with a traceback on stderr, beside the run's own one line
    (its writer raises the same error in the run only at its next write or flush, never at close).
    It is one line of the run's log instead, naming the directory and the fix; any other thread's
    exception goes to the hook that was there before."""
    _tensorboard_dir[:] = [directory]
    previous = threading.excepthook
    if getattr(previous, "tensorboard_errors_in_one_line", False):
        return

    def hook(args: Any) -> None:
        thread = args.thread
        if (type(thread).__module__.startswith("tensorboard.") and isinstance(args.exc_value, OSError)
                and _tensorboard_dir):
            exc = args.exc_value
            if exc.filename is None:
                exc.filename = str(_tensorboard_dir[0])
            log.error("%s", os_error_message(exc, "write TensorBoard's events"))
            return
        previous(args)

    hook.tensorboard_errors_in_one_line = True  # type: ignore[attr-defined]
    threading.excepthook = hook


def human_bytes(n: float | None, *, missing: str = "n/a") -> str:
    """Bytes in binary units (B, KiB, MiB, GiB, TiB); ``missing`` for None."""
    if n is None:
        return missing
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:,.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    raise AssertionError("unreachable")


def _applied_line(applied: dict[str, Any]) -> str:
    parts = []
    for key, value in applied.items():
        if value is None:  # an optimization this run does not use (e.g. float8): nothing to show
            continue
        if isinstance(value, dict):
            value = value.get("name") or value.get("mode") or ",".join(f"{k}={v}" for k, v in value.items())
        parts.append(f"{key}={value}")
    return " ".join(parts)


# a forecast's scores per lead and channel (optbench.tasks.climate): wRMSE and ACC beside their baselines
FORECAST_COLUMNS = (("wrmse", "wRMSE"), ("wrmse_persistence", "pers"), ("wrmse_climatology", "clim"),
                    ("acc", "ACC"), ("acc_persistence", "pers"))
FORECAST_CELL = 9  # characters a score's cell takes, its leading space included
FORECAST_LEADS = 4  # leads printed at most (the first, the last, evenly between); summary.json has all


def _forecast_scores(metrics: dict[str, Any] | None) -> dict[str, float]:
    """A forecast's ``metric/lead/channel`` scores (``wrmse/6h/temperature@500``, ...)."""
    kinds = {key for key, _ in FORECAST_COLUMNS}
    return {key: float(value) for key, value in (metrics or {}).items() if isinstance(value, (int, float))
            and key.count("/") == 2 and key.split("/", 1)[0] in kinds}


def _eval_metric_lines(metrics: dict[str, Any] | None, width: int) -> list[str]:
    """Eval metrics named ``group/name`` (e.g. ``nrmse/temperature``), one line per group wrapped to
    ``width`` (a forecast's scores per lead are ``_forecast_table``'s)."""
    groups: dict[str, list[str]] = {}
    forecast = _forecast_scores(metrics)
    for key, value in (metrics or {}).items():
        if isinstance(value, (int, float)) and key not in forecast:
            group, _, name = key.rpartition("/")
            groups.setdefault(group or "eval", []).append(f"{name} {value:.4g}")
    return [textwrap.fill(", ".join(items), width, initial_indent=f"  {group:<11} ", subsequent_indent=" " * 14,
                          break_long_words=False) for group, items in groups.items()] + _fusion_verdict(metrics or {}, width)


def _fusion_verdict(m: dict[str, Any], width: int) -> list[str]:
    """task=climate_text: what its loss gap (shuffled - true climate) says, in words."""
    if "fusion/loss_gap_low" not in m:
        return []
    low, high = m["fusion/loss_gap_low"], m["fusion/loss_gap_high"]
    said = ("reads the climate it is given" if low > 0 else "does worse with its own climate than another's"
            if high < 0 else "shows no use of its climate")
    text = (f"the model {said}: with another sample's climate its eval text costs {m['fusion/loss_gap']:+.4g} "
            f"nats/token more than with its own (95% interval {low:+.3g} .. {high:+.3g}; one run: seeds vary more, "
            "see make fusion-matrix)")
    return [textwrap.fill(text, width, initial_indent=f"  {'verdict':<11} ", subsequent_indent=" " * 14,
                          break_long_words=False)]


def _score(kind: str, value: float | None) -> str:
    if value is None or value != value:
        return "-"
    if kind.startswith("acc"):
        return f"{value:.3f}"
    return next((text for text in (f"{value:.{digits}g}" for digits in (4, 3, 2)) if len(text) < FORECAST_CELL),
                f"{value:.1e}")


def _forecast_table(scores: dict[str, float], width: int) -> list[str]:
    """Channels down, leads across (as many leads side by side as ``width`` holds, the rest below),
    each lead's wRMSE and ACC beside persistence's and climatology's; none without scores."""
    if not scores:
        return []
    every = list(dict.fromkeys(key.split("/")[1] for key in scores))
    leads = every if len(every) <= FORECAST_LEADS else [
        every[round(i * (len(every) - 1) / (FORECAST_LEADS - 1))] for i in range(FORECAST_LEADS)]
    channels = list(dict.fromkeys(key.split("/", 2)[2] for key in scores))
    name = max(len("channel"), *(len(c) for c in channels))
    span = FORECAST_CELL * len(FORECAST_COLUMNS) + 2
    per_block = max(1, (width - 2 - name) // span)
    lines = [textwrap.fill(
        "per channel and lead: wRMSE (cos(latitude)-weighted RMSE, in the channel's units) and ACC (anomaly "
        "correlation), each beside persistence's (pers) and climatology's (clim)"
        + ("" if leads == every else f"; leads {', '.join(leads)} of {len(every)}")
        + "; every value in summary.json loss.eval_metrics", width, initial_indent="  forecast    ", subsequent_indent=" " * 14)]
    for start in range(0, len(leads), per_block):
        block = leads[start:start + per_block]
        lines.append("  " + " " * name + "".join(f"  {'lead ' + lead:<{span - 2}}" for lead in block).rstrip())
        lines.append("  " + f"{'channel':<{name}}" + "".join(
            "  " + "".join(f"{head:>{FORECAST_CELL}}" for _, head in FORECAST_COLUMNS) for _ in block))
        for channel in channels:
            lines.append("  " + f"{channel:<{name}}" + "".join(
                "  " + "".join(f"{_score(kind, scores.get(f'{kind}/{lead}/{channel}')):>{FORECAST_CELL}}"
                               for kind, _ in FORECAST_COLUMNS) for lead in block))
    return lines


def format_summary(summary: RunSummary, run_dir: str | Path, *, width: int | None = None) -> str:
    """The few lines printed at the end of a single run, at most ``width`` columns wide where they
    can be (the terminal's by default; a path or a name is never broken)."""
    width = width or max(60, shutil.get_terminal_size((120, 24)).columns)
    lines = [f"optbench run {summary.status} in {summary.wall_s or 0:.1f} s -> {run_dir}"]
    if summary.error:
        lines.append(f"  error       {summary.error}")
    model, tp, mem, loss = summary.model, summary.throughput, summary.memory, summary.loss
    if model.params is not None:
        frozen = model.frozen_params or 0
        share = f" ({model.trainable_params:,} trainable, {frozen / model.params:.1%} frozen)" if frozen else ""
        lines.append(f"  model       {model.name}: {model.params:,} params{share}, "
                     f"{model.flops_per_token / 1e6:,.2f} MFLOPs/token")
    if summary.device is not None:
        lines.append(f"  device      {summary.device} x {summary.world_size}")
    if summary.applied:
        lines.append(f"  applied     {_applied_line(summary.applied)}")
    if loss.first is not None:
        eval_part = f" (eval {loss.eval:.4f})" if loss.eval is not None else ""
        lines.append(f"  loss        {loss.first:.4f} -> {loss.final:.4f}{eval_part}")
    lines += _eval_metric_lines(loss.eval_metrics, width)
    if tp.tokens_per_s is not None:
        st = tp.step_time_s
        lines.append(f"  step time   {st.median:.4f} s median [p10 {st.p10:.4f} - p90 {st.p90:.4f}] "
                     f"over {tp.timed_steps} timed steps ({tp.warmup_steps} warm-up excluded)")
        mfu = f"MFU {tp.mfu:.1%} of {_gflops(tp.peak_flops)} GFLOP/s" if tp.mfu is not None else "MFU n/a"
        task = summary.task_record  # task=energy_flow: a sample is a token (its throughput_unit says so)
        unit = "samples/s" if task is not None and task.throughput_unit else "tokens/s"
        lines.append(f"  throughput  {tp.tokens_per_s:,.0f} {unit}; {mfu} ({tp.peak_source})")
    source = mem.peak_source or "the run stopped before"
    peak = (f"peak {human_bytes(mem.peak_bytes)} ({source})" if mem.peak_bytes is not None
            else "peak " + (source if source.startswith("not measured") else f"not measured ({source})"))
    faults = tp.page_faults_per_step
    faults_part = "" if faults is None else f"; {faults:,.0f} page faults a timed step"
    lines.append(f"  memory      {peak}; process RSS peak {human_bytes(mem.peak_rss_bytes)}{faults_part}")
    lines += _run_control_lines(summary)
    lines += _forecast_table(_forecast_scores(loss.eval_metrics), width)  # last: the longest part
    return "\n".join(lines)


def _run_control_lines(summary: RunSummary) -> list[str]:
    """The profiler's and the stopping rules' lines (optbench.run.loop.profiler, .stopping)."""
    lines = []
    profile = summary.profile
    if profile:
        steps, warmup = profile.steps, profile.warmup_steps or []
        top = profile.top_ops[0] if profile.top_ops else None
        lines.append(f"  profile     recorded {_span(steps)}, profiler warm-up {_span(warmup)} (left out of the timing) "
                     f"-> {profile.dir}"
                     + (f"; top op {top['name']} ({top['self_us'] / 1e3:.2f} ms self)" if top else ""))
    early, spikes = (summary.stopping.early, summary.stopping.spikes) if summary.stopping else (None, None)
    if early and early.best is not None:
        lines.append(f"  stopping    best {early.metric} {early.best:.4g} at step {early.best_step} "
                     f"(patience {early.patience})")
    if spikes and spikes.events:
        lines.append(f"  spikes      {len(spikes.events)} loss spikes, updates skipped at steps {spikes.skipped_steps}")
    return lines


def _span(steps: list[int]) -> str:
    return "none" if not steps else f"step {steps[0]}" if len(steps) == 1 else f"steps {steps[0]}-{steps[-1]}"


def reason_gist(reason: str) -> str:
    """The blocking options of a reason, without their explanations (a plot's row; the whole
    reason is in report.md): "incompatible: optimizer=cpu_offload needs CUDA: torchao's ..." ->
    "incompatible: optimizer=cpu_offload needs CUDA"."""
    status, sep, rest = reason.partition(": ")
    if status != "incompatible" or not sep:
        return reason if len(reason) <= 150 else reason[:149] + "…"
    if re.match(r"\d+ options block this run: \(1\)", rest):
        clauses = re.split(r"; \((?=\d+\) )", rest.partition(": ")[2])
        gist = "; ".join(("" if c.startswith("(") else "(") + re.split(r": |; ", c, maxsplit=1)[0] for c in clauses)
    else:
        gist = re.split(r": |; ", rest, maxsplit=1)[0]
    return f"{status}: {gist}"


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    """A nested config dict as dotted keys (``{"train": {"lr": 1}}`` -> ``{"train.lr": 1}``)."""
    if not isinstance(tree, dict):
        return {prefix: tree}
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        flat.update(flatten(value, f"{prefix}.{key}" if prefix else str(key)))
    return flat


def _gflops(flops: float) -> str:
    """GFLOP/s to three significant figures at least (a CPU's bf16 ceiling can be under 1)."""
    gflops = flops / 1e9
    return f"{gflops:,.0f}" if gflops >= 100 else f"{gflops:.3g}"
