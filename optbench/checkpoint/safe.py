"""Loading a checkpoint never runs code from it.

A checkpoint directory comes from disk, perhaps from someone else: DCP's ``.metadata`` is a pickle,
and DCP reads every non-tensor item with ``torch.load(weights_only=False)`` -- either would run
whatever a crafted file tells it to. optbench reads them another way:

* ``.metadata`` through ``RestrictedUnpickler``, which admits only the classes DCP's metadata is
  made of (``torch.distributed.checkpoint.metadata``'s dataclasses, ``torch.Size``, dtypes, paths);
  any other global in the file is refused (``UnsafeCheckpoint``, one line naming it). Early Python
  3.11 releases (3.11.2, Debian 12's, and 3.11.3; 3.11.7 does not) pickle an enum member as
  ``getattr(its class, its name)``; ``builtins.getattr`` is admitted in that one use
  (``_enum_member``): a member, by name, of an enum class the file could name anyway.
* every non-tensor item (scheduler, loss scaler, progress) with ``torch.load(weights_only=True)``
  (``SafePlanner``); tensors DCP already reads that way.
* optbench's own state holds no pickles: the RNG states are tensors and numbers (``rng_state``),
  the progress is numbers. A checkpoint written before this format (``FORMAT`` 1) kept numpy's and
  Python's RNG states as pickles; those are read with an unpickler admitting numpy's array alone.

``reader(path)`` and ``planner()`` are handed to ``torch.distributed.checkpoint.load``;
``read_metadata`` is what ``store.damage`` and the base-model loader read.
"""

from __future__ import annotations

import enum
import functools
import io
import pickle
import random
import re
from pathlib import Path
from typing import Any

import numpy as np
import torch


class UnsafeCheckpoint(pickle.UnpicklingError):
    """A checkpoint file names something optbench will not load (it could run code)."""


_DCP_METADATA = "torch.distributed.checkpoint.metadata"
_ALLOWED = {
    (_DCP_METADATA, name) for name in (
        "Metadata", "StorageMeta", "MetadataIndex", "TensorProperties", "TensorStorageMetadata",
        "BytesStorageMetadata", "ChunkStorageMetadata", "_MEM_FORMAT_ENCODING")
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.serialization", "_get_layout"),  # a layout by its name (torch.strided)
    ("torch", "Size"),
    ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"), ("pathlib", "WindowsPath"),
    ("pathlib", "PureWindowsPath"), ("collections", "OrderedDict"),
}
# numpy's RNG state as pickled by a FORMAT 1 checkpoint: an array and its dtype
_NUMPY_ARRAY = {(module, name) for module in ("numpy.core.multiarray", "numpy._core.multiarray")
                for name in ("_reconstruct", "scalar")} | {("numpy", "ndarray"), ("numpy", "dtype")}


class RestrictedUnpickler(pickle.Unpickler):
    """Admits only ``allowed`` globals (and torch's dtypes, ``torch.float32``...)."""

    def __init__(self, file: Any, *, allowed: set[tuple[str, str]], what: str) -> None:
        super().__init__(file)
        self.allowed = allowed
        self.what = what

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in self.allowed:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if (module, name) == ("builtins", "getattr"):
            return functools.partial(_enum_member, what=self.what)
        raise UnsafeCheckpoint(f"{self.what} names {module}.{name}, which is not part of a checkpoint: "
                               "it could run code, so it is not loaded")


def _enum_member(cls: Any, name: Any, *rest: Any, what: str) -> enum.Enum:
    """``getattr(cls, name)`` as early Python 3.11 releases pickle an enum member
    (``Enum.__reduce_ex__``; 3.11.7 pickles ``cls(value)``, as 3.10 did), and nothing else: ``cls``
    an enum class the file got from ``find_class``'s allowed globals, ``name`` one of its members'
    names. Any other attribute is refused."""
    if not rest and isinstance(cls, enum.EnumMeta) and isinstance(name, str) and name in cls.__members__:
        return cls[name]
    target = getattr(cls, "__qualname__", type(cls).__qualname__)
    raise UnsafeCheckpoint(f"{what} asks for the attribute {repr(name)[:60]} of {target}, which is not part of a "
                           "checkpoint: it could run code, so it is not loaded")


def read_metadata(path: str | Path) -> Any:
    """DCP's ``Metadata`` of the checkpoint at ``path``, unpickled with only its own classes."""
    file = Path(path) / ".metadata"
    with open(file, "rb") as handle:
        metadata = RestrictedUnpickler(handle, allowed=_ALLOWED, what=str(file)).load()
    if type(metadata).__name__ != "Metadata":
        raise UnsafeCheckpoint(f"{file} holds a {type(metadata).__name__}, not DCP's Metadata")
    return metadata


def reader(path: str | Path) -> Any:
    """DCP's file-system reader of ``path``, with ``.metadata`` read by ``read_metadata``."""
    return _classes()[0](str(path))


def planner() -> Any:
    """DCP's default load planner, reading non-tensor items with ``torch.load(weights_only=True)``."""
    return _classes()[1]()


@functools.cache
def _classes() -> tuple[type, type]:
    """The reader and planner classes, made on first use (torch.distributed.checkpoint takes a
    second or two to import, which ``optbench report`` need not pay)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.metadata import StorageMeta

    class SafeReader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            if kwargs.get("rank") is not None:  # per-rank metadata files: not written by optbench
                raise UnsafeCheckpoint(f"{self.path} has per-rank metadata, which optbench does not write")
            metadata = read_metadata(self.path)
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    class SafePlanner(DefaultLoadPlanner):
        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            try:
                obj = torch.load(value, weights_only=True)
            except pickle.UnpicklingError as exc:  # torch's message would suggest weights_only=False
                found = re.search(r"GLOBAL ([\w.]+)", str(exc))
                what = found.group(1) if found else "an object torch.load(weights_only=True) refuses"
                raise UnsafeCheckpoint(f"the item {read_item.dest_index.fqn} names {what}, which is not part of a "
                                       "checkpoint: it could run code, so it is not loaded") from None
            checked = io.BytesIO()  # what torch.load admitted, handed to DCP's own bookkeeping
            torch.save(obj, checked)
            checked.seek(0)
            super().load_bytes(read_item, checked)

    return SafeReader, SafePlanner


# ------------------------------------------------------------------------------------ RNG states
def rng_state(*, legacy: bool = False) -> dict[str, Any]:
    """This process's RNG states as tensors and numbers (torch CPU and CUDA, numpy, python);
    ``legacy``: the shape of a FORMAT 1 checkpoint's (pickled numpy/python states), to load one."""
    state: dict[str, Any] = {"torch": torch.get_rng_state()}
    if legacy:
        state.update(numpy=b"", python=b"")
    else:
        kind, keys, pos, has_gauss, gauss = np.random.get_state()
        version, words, gauss_next = random.getstate()
        state.update(numpy_keys=torch.from_numpy(np.asarray(keys, dtype=np.int64)), numpy_pos=int(pos),
                     numpy_has_gauss=int(has_gauss), numpy_gauss=float(gauss),
                     python_words=torch.tensor(words, dtype=torch.int64), python_version=int(version),
                     python_gauss=gauss_next)
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what ``rng_state`` returned (either shape)."""
    torch.set_rng_state(state["torch"])
    if "numpy" in state:  # FORMAT 1
        np.random.set_state(_legacy_unpickle(state["numpy"], what="the numpy RNG state"))
        random.setstate(_legacy_unpickle(state["python"], what="the python RNG state"))
    else:
        keys = state["numpy_keys"].numpy().astype(np.uint32)
        np.random.set_state(("MT19937", keys, state["numpy_pos"], state["numpy_has_gauss"], state["numpy_gauss"]))
        random.setstate((state["python_version"], tuple(int(w) for w in state["python_words"].tolist()),
                         state["python_gauss"]))
    if "cuda" in state:
        torch.cuda.set_rng_state_all(state["cuda"])


def _legacy_unpickle(data: bytes, *, what: str) -> Any:
    return RestrictedUnpickler(io.BytesIO(data), allowed=_NUMPY_ARRAY, what=what).load()
