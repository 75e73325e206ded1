"""Writing files so that nothing measured is lost: atomic writes, one-line OS errors, directory locks.

* ``write_atomic(path, data)``: a temporary file beside ``path``, flushed and fsynced, then renamed
  over it. A crash, a full disk or a file-size limit leaves the old file (or none), never half of
  one, and the temporary is removed when the write fails.
* ``os_error_message(exc, what)``: one line naming the file, what went wrong and the fix.
* ``open_private(path)``: a file optbench creates in a run directory, opened without following a
  link (``O_NOFOLLOW``) and created only if absent (``O_EXCL``): in a shared directory another user
  could otherwise plant a link that aims optbench's write at one of your files. A link is refused
  with one line (``UnsafePathError``).
* ``DirLock``: an advisory lock (``flock``) on a directory for the life of a run. The kernel drops
  it when its process dies, however it dies, so a lock left by a killed run is stale by
  construction: the next run takes it over (and says whose it was). The lock file holds the
  holder's pid, host and start time, which a refused run prints. Child processes of the holder (the
  local workers of ``parallel=ddp|fsdp2``) share the holder's lock through ``LOCK_TOKEN_ENV``.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import logging
import os
import shutil
import socket
import stat
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from optbench.errors import ConfigError, Interrupted


def timestamp(seconds: float | None = None) -> str:
    """The one timestamp format of optbench's files: local ISO 8601 with the UTC offset."""
    return time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(seconds))

log = logging.getLogger(__name__)

LOCK_FILE = ".optbench.lock"
LOCK_TOKEN_ENV = "OPTBENCH_LOCK_TOKEN"


class OutputError(ConfigError):
    """A file optbench must write cannot be written (full disk, file-size limit, read-only, too long
    a path): one line naming it and the fix, exit status 2; the run's summary records it."""


# ------------------------------------------------------------------------------------- writing
class UnsafePathError(OutputError):
    """A file optbench writes in a run directory is a link (or not a plain file): one line, exit 2."""


def refuse_link(path: Path, *, what: str) -> None:
    """UnsafePathError when ``path`` is a symbolic link (``what``: the file, e.g. "the run's metrics")."""
    if path.is_symlink():
        raise UnsafePathError(
            f"{path} ({what}) is a symbolic link to {os.readlink(path)}; optbench does not write through links in "
            "a run directory (another user could aim one at your files): remove it, or use another directory")


def open_private(path: str | Path, mode: str = "w") -> Any:
    """A new file at ``path``, created here (``O_EXCL``) without following a link (``O_NOFOLLOW``);
    OSError (EEXIST) when something is already there."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    return os.fdopen(os.open(path, flags, 0o644), mode)


def write_atomic(path: str | Path, data: str | bytes) -> None:
    """Write ``data`` to ``path`` atomically (temp file + fsync + rename); on failure nothing is
    left but what ``path`` held before, and the OSError is raised. The temporary is created with
    ``open_private``; the rename replaces a link at ``path``, never writes through it."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:6]}.tmp")
    try:
        with open_private(tmp, "wb") as handle:
            handle.write(data.encode() if isinstance(data, str) else data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


@contextlib.contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """A temporary path beside ``path`` for a writer that needs a file name (h5netcdf, numpy);
    renamed to ``path`` when the block succeeds, removed when it fails."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:6]}.tmp")
    try:
        yield tmp
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


@contextlib.contextmanager
def atomic_directory(path: str | Path) -> Iterator[Path]:
    """A hidden directory beside ``path`` (which must be absent or empty) for a writer of a
    directory that is one thing (an exported model: weights, config, tokenizer): renamed to ``path``
    when the block succeeds, so a failed write (a full disk) leaves no ``path`` that looks whole, and
    no directory that refuses the next try; removed when it fails."""
    path = Path(path)
    partial = path.parent / f".{path.name}.partial-{os.getpid()}"
    try:
        partial.mkdir(parents=True)
        yield partial
        if path.exists():
            path.rmdir()  # empty, or the rename below would fail on a non-empty one
        partial.rename(path)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise


@contextlib.contextmanager
def files_together(directory: str | Path, label: str) -> Iterator[Path]:
    """A hidden directory in ``directory`` for a writer of several files (a report, a validation):
    when the block succeeds each file in it is renamed into ``directory``, so a write that fails (a
    full disk) leaves the files there before as they were, never a mix of two sets. Removed after."""
    directory = Path(directory)
    partial = directory / f".{label}-partial-{os.getpid()}"
    try:
        partial.mkdir(parents=True, exist_ok=True)
        yield partial
        for path in sorted(partial.iterdir()):
            os.replace(path, directory / path.name)
    finally:
        shutil.rmtree(partial, ignore_errors=True)


@contextlib.contextmanager
def sigterm_raises() -> Iterator[None]:
    """SIGTERM raises ``Interrupted`` inside the block (where the default would end the process at
    once, leaving its temporary files), so that the writers' cleanup runs; the previous handler is
    back after it. In the main thread only (elsewhere the block runs as it is)."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum: int, _frame: Any) -> None:
        raise Interrupted(f"stopped by {signal.Signals(signum).name}", signum=signum)

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


# what a file is, by its first bytes: an output of one kind is never written over a file of another
_MAGIC = ((b"\x89HDF\r\n\x1a\n", "a NetCDF4/HDF5 file"), (b"CDF\x01", "a NetCDF3 file"), (b"CDF\x02", "a NetCDF3 file"),
          (b"CDF\x05", "a NetCDF3 file"))
TEXT = "text or other data"


def file_kind(path: Path) -> str:
    """What is at ``path``: "a directory", a NetCDF file (by its signature) or ``TEXT``."""
    if path.is_dir():
        return "a directory"
    try:
        with path.open("rb") as handle:
            head = handle.read(8)
    except OSError:
        return TEXT
    return next((kind for magic, kind in _MAGIC if head.startswith(magic)), TEXT)


def refuse_output(out: Path, *, inputs: list[Path], writes: str, kind: str = TEXT) -> None:
    """ConfigError when writing ``out`` (``writes``: what it would hold, e.g. "the captions (JSON
    lines)") would destroy something: one of the ``inputs`` (the same file by any name), or an
    existing file of another kind than ``kind`` (a forgotten output argument makes the last input
    the output)."""
    for source in inputs:
        if out == source or (out.exists() and source.exists() and os.path.samefile(out, source)):
            raise ConfigError(f"{out} is also an input: writing {writes} there would destroy it; "
                              "give another output file (the output comes last)")
    if (out.exists() or out.is_symlink()) and not out.is_dir():  # a directory: the writer's own line says so
        found = file_kind(out)
        if found != kind:
            raise ConfigError(f"{out} exists and is {found}, not {writes}: writing there would destroy it; "
                              "give another output file (the output comes last), or remove it first")


def free_bytes(path: Path) -> int | None:
    """Bytes free to this user on the filesystem holding ``path`` (its nearest existing parent)."""
    for candidate in (path, *path.parents):
        try:
            return shutil.disk_usage(candidate).free
        except OSError:
            continue
    return None


_FIXES = {
    errno.EACCES: "choose a directory you can write to",
    errno.EPERM: "choose a directory you can write to",
    errno.EROFS: "the filesystem is read-only: choose a directory on a writable one",
    errno.ENOSPC: "free some space or choose a directory on another filesystem",
    errno.EDQUOT: "the disk quota is used up: free some space or choose another filesystem",
    errno.EFBIG: "a file-size limit stops it (ulimit -f): raise the limit",
    errno.ENAMETOOLONG: "use a shorter path",
    errno.ENOTDIR: "a part of the path is a file, not a directory: choose another path",
    errno.EISDIR: "that is a directory: give a file name",
    errno.EEXIST: "it already exists: choose another name or remove it",
    errno.ENOENT: "check the path",
    errno.ELOOP: "it is a symbolic link, which optbench does not write through: remove it",
}


def os_error_message(exc: OSError, what: str = "") -> str:
    """One line: which file, what the system said, and the fix (``what``: e.g. "write the summary")."""
    name = exc.filename if exc.filename is not None else ""
    if len(str(name)) > 120:
        name = f"{str(name)[:60]}...{str(name)[-40:]} ({len(str(name)):,} characters)"
    reason = exc.strerror or str(exc) or type(exc).__name__
    fix = _FIXES.get(exc.errno or -1, "")
    if exc.errno == errno.EEXIST and name and os.path.isfile(name):  # mkdir met a file on the path
        reason, fix = "is a file, not a directory", "choose another path"
    head = f"cannot {what}: " if what else ""
    where = f"{name}: " if name else ""
    return f"{head}{where}{reason}" + (f"; {fix}" if fix else "")


NAME_MAX = 255  # bytes of one path component where the filesystem does not say (Linux, macOS)
DIGEST_CHARS = 10


def name_limit(directory: str | Path) -> int:
    """The longest file name, in bytes, the filesystem holding ``directory`` (its nearest existing
    parent) takes."""
    for candidate in (Path(directory), *Path(directory).parents):
        with contextlib.suppress(OSError, ValueError):
            if candidate.exists():
                return int(os.pathconf(candidate, "PC_NAME_MAX"))
    return NAME_MAX


def job_dir_name(num: Any, overrides: str, parent: str = ".") -> str:
    """A sweep job's directory name: ``NUM_OVERRIDES`` (Hydra's ``override_dirname``) as long as every
    part of it fits the filesystem's name limit under ``parent`` (the sweep's directory); else ``NUM_``,
    the overrides cut to fit (a ``/`` of a path value as ``_``), ``~`` and a digest of all of them, so
    that the name stays readable, unique and the same for the same job. The Hydra resolver
    ``optbench_job_dir`` (conf/train.yaml's ``hydra.sweep.subdir``)."""
    name = f"{num}_{overrides}" if overrides else str(num)
    limit = name_limit(parent)
    if all(len(part.encode()) <= limit for part in name.split("/")):
        return name
    digest = hashlib.sha256(overrides.encode()).hexdigest()[:DIGEST_CHARS]
    head = f"{num}_{overrides.replace('/', '_')}".encode()[:limit - DIGEST_CHARS - 1]
    return head.decode(errors="ignore") + "~" + digest


def parse_jsonl(path: Path, *, objects_only: bool = False) -> tuple[list[dict[str, Any]], str | None]:
    """The records of a JSON-lines file and a note when its last line is torn (cut off mid-write,
    skipped). A bad line before the last is corruption, not a torn write: ConfigError, one line. A
    line of JSON that is no object is skipped, or with ``objects_only`` refused (ConfigError)."""
    lines = path.read_text().splitlines()
    numbered = [(n, line) for n, line in enumerate(lines, start=1) if line.strip()]
    records, torn = [], None
    for index, (number, line) in enumerate(numbered):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            if index == len(numbered) - 1:
                torn = f"{path} line {number} is torn (cut off mid-write: {len(line)} characters); skipped"
                continue
            raise ConfigError(
                f"{path} line {number} is not valid JSON and is not the last line (two writers, or a corrupt "
                "file); move the file away to start that run's records over"
            ) from None
        if isinstance(record, dict):
            records.append(record)
        elif objects_only:
            raise ConfigError(f"{path} line {number} is {line.strip()[:40]}, not a JSON object; write one object per "
                              "line, or remove that line")
    return records, torn


# ------------------------------------------------------------------------------------- locking
class LockedError(ConfigError):
    """Another live process holds the directory: one line naming it, exit status 2."""


_HELD: dict[Path, DirLock] = {}  # resolved dir -> this process's lock on it
_PROCESS_TOKEN = uuid.uuid4().hex


def lock_token() -> str:
    """What this process writes into its locks; its local workers get it in ``LOCK_TOKEN_ENV`` and
    so may use the directories their launcher locked."""
    return os.environ.get(LOCK_TOKEN_ENV) or _PROCESS_TOKEN


class DirLock:
    """``DirLock.acquire(directory, what=...)``: this process's lock on ``directory``; raises
    LockedError when another live process holds it. Re-acquiring a lock this process (or the
    process that launched it, see ``LOCK_TOKEN_ENV``) holds returns it without locking twice."""

    def __init__(self, directory: Path, handle: Any, token: str, *, inherited: bool) -> None:
        self.directory = directory
        self._handle = handle
        self.token = token
        self.inherited = inherited
        self.count = 1

    @classmethod
    def acquire(cls, directory: str | Path, *, what: str) -> DirLock:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        key = directory.resolve()
        held = _HELD.get(key)
        if held is not None:
            held.count += 1
            return held
        _refuse_a_live_run_above(key, what=what)
        path = directory / LOCK_FILE
        handle = _open_lock_file(path)
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder(handle)
            handle.close()
            if holder.get("token") and holder.get("token") == os.environ.get(LOCK_TOKEN_ENV):
                lock = cls(key, None, holder["token"], inherited=True)  # our launcher holds it
                _HELD[key] = lock
                return lock
            raise LockedError(
                f"{directory} is in use by another optbench run ({_describe(holder)}); {what} there "
                f"would mix both runs' outputs: wait for it to finish, or use another directory"
            ) from None
        except BaseException:
            handle.close()
            raise
        previous = _read_holder(handle)
        if previous.get("pid"):
            log.warning("took over the lock on %s left by %s (no longer running)", directory, _describe(previous))
        token = lock_token()
        holder = {"pid": os.getpid(), "host": socket.gethostname(),
                  "started_at": timestamp(), "token": token}
        handle.seek(0)
        handle.truncate()
        handle.write(json.dumps(holder) + "\n")
        handle.flush()
        lock = cls(key, handle, token, inherited=False)
        _HELD[key] = lock
        return lock

    def release(self) -> None:
        self.count -= 1
        if self.count > 0:
            return
        _HELD.pop(self.directory, None)
        if self._handle is not None:
            with contextlib.suppress(OSError):
                self._handle.seek(0)
                self._handle.truncate()  # a clean release leaves no holder to report
            fcntl.flock(self._handle, fcntl.LOCK_UN)
            self._handle.close()
            self._handle = None


def _refuse_a_live_run_above(directory: Path, *, what: str) -> None:
    """LockedError when a directory above ``directory`` is locked by another live run (a run, or
    its checkpoints, inside another run's directory would mix both); the search stops at a
    directory this process (or its launcher) holds."""
    for parent in directory.parents:
        if parent in _HELD:
            return
        path = parent / LOCK_FILE
        if path.is_symlink() or not path.is_file():
            continue
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError:
            continue
        with os.fdopen(fd) as handle:
            try:
                fcntl.flock(handle, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _read_holder(handle)
                if holder.get("token") and holder.get("token") == os.environ.get(LOCK_TOKEN_ENV):
                    return  # our launcher's
                raise LockedError(
                    f"{directory} is inside {parent}, which is in use by another optbench run ({_describe(holder)}); "
                    f"{what} there would mix both runs' outputs: wait for it to finish, or use another directory"
                ) from None
            fcntl.flock(handle, fcntl.LOCK_UN)


def _open_lock_file(path: Path) -> Any:
    """The lock file, never through a link: a planted link would have the lock truncate its target."""
    refuse_link(path, what="a run's lock file")
    flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    fd = os.open(path, flags, 0o644)
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode) or info.st_nlink > 1:
        os.close(fd)
        kind = "has other hard links" if stat.S_ISREG(info.st_mode) else "is not a plain file"
        raise UnsafePathError(f"{path} (a run's lock file) {kind}; optbench does not write through it (another user "
                              "could aim it at your files): remove it, or use another directory")
    os.set_blocking(fd, True)
    return os.fdopen(fd, "r+")


def release_all() -> None:
    """Release every lock this process holds (the end of a run)."""
    for lock in list(_HELD.values()):
        lock.count = 1
        lock.release()


def held_lock(directory: Path) -> DirLock | None:
    """This process's lock on ``directory`` or on a directory above it."""
    resolved = directory.resolve()
    for candidate in (resolved, *resolved.parents):
        if candidate in _HELD:
            return _HELD[candidate]
    return None


def _read_holder(handle: Any) -> dict[str, Any]:
    try:
        handle.seek(0)
        data = json.loads(handle.read() or "{}")
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _describe(holder: dict[str, Any]) -> str:
    if not holder.get("pid"):
        return "holder unknown"
    return f"pid {holder['pid']} on {holder.get('host', '?')}, started {holder.get('started_at', '?')}"
