"""A content hash of every file of a checkpoint: recorded when it is saved (``optbench.json``
``files``: name -> bytes and SHA-256), verified before a run loads it. Bytes overwritten in place
(the size unchanged) load without an error and train on garbage; a hash finds them, and the
resume falls back to the checkpoint before, as for any other damage.

Every rank hashes what it wrote (its ``__<rank>_*.distcp``; rank 0 also ``.metadata``) right after
the save, while the data is still in the page cache; verifying splits the files over the ranks.
Either costs one read of the data at SHA-256's speed (``docs/parallel.md`` has the figures).
A checkpoint saved before hashes were recorded is loaded unverified.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from optbench import distributed

CHUNK = 8 * 2**20


def file_digest(path: Path) -> dict[str, Any]:
    """{"bytes", "sha256"} of the file at ``path``."""
    digest = hashlib.sha256()
    size = 0
    with open(path, "rb", buffering=0) as handle:
        buffer = bytearray(CHUNK)
        view = memoryview(buffer)
        while True:
            n = handle.readinto(buffer)
            if not n:
                break
            digest.update(view[:n])
            size += n
    return {"bytes": size, "sha256": digest.hexdigest()}


def _own_files(directory: Path, rank: int) -> list[Path]:
    files = sorted(directory.glob(f"__{rank}_*.distcp"))
    return [directory / ".metadata", *files] if rank == 0 else files


def record(directory: Path) -> dict[str, dict[str, Any]]:
    """The digests of the checkpoint written into ``directory`` (every rank calls this after the
    save; every rank gets them all, or the same OSError when a rank could not read its files)."""
    try:
        mine: dict[str, Any] = {path.name: file_digest(path) for path in _own_files(directory, distributed.rank())}
    except OSError as exc:
        mine = {"": (exc.errno, exc.strerror, exc.filename)}
    merged: dict[str, dict[str, Any]] = {}
    for part in distributed.gather_objects(mine):
        if "" in part:
            raise OSError(*part[""])
        merged.update(part)
    return dict(sorted(merged.items()))


def _problem(directory: Path, name: str, expected: Any) -> str | None:
    if not isinstance(expected, dict) or not isinstance(expected.get("sha256"), str):
        return f"its recorded hash of {name} is malformed"
    path = directory / name
    if not path.is_file():
        return f"{name} is missing"
    actual = file_digest(path)
    if actual["bytes"] != expected.get("bytes"):
        return f"{name} holds {actual['bytes']:,} bytes, not the {expected.get('bytes')} recorded at save"
    if actual["sha256"] != expected["sha256"]:
        return f"{name} does not match the SHA-256 recorded at save (its bytes were changed)"
    return None


def verify(directory: Path, files: Any) -> str | None:
    """Why the files of the checkpoint in ``directory`` differ from ``files`` (the digests recorded
    at save), or None; every rank calls this and gets the same answer. ``files`` None: saved before
    hashes were recorded, nothing to verify."""
    if files is None:
        return None
    if not isinstance(files, dict):
        return "its recorded hashes (files) are malformed"
    rank, world = distributed.rank(), distributed.world_size()
    mine = [name for index, name in enumerate(sorted(files)) if index % world == rank]
    found = next((p for p in (_problem(directory, name, files[name]) for name in mine) if p), None)
    problems = [p for p in distributed.gather_objects(found) if p]
    return problems[0] if problems else None
