"""Reused block and batch buffers: fresh memory costs a page fault and a zeroed page per 4 KiB.

Allocating a 100 MB batch per step (and, in a worker, a new shared-memory segment for it) costs
the kernel zeroing every page on first touch — on this project's CPUs several times the copy that
fills the batch (see docs/climate-loader.md). The loader therefore reuses memory, never while
anything still uses it:

- ``BufferPool`` (in a process): numpy buffers handed out as views; a buffer is handed out again
  only when nothing references it any more (no view of it, no tensor made from it: all of those
  hold a reference to the buffer, so its reference count tells).
- ``SharedBatches`` (in a DataLoader worker): batch tensors in shared memory, one slot per batch
  in flight. The worker marks a slot busy in a small shared flag array when it sends the batch;
  the training process, when it receives the batch (``_rebuild_leased`` runs as the batch is
  unpickled there), watches the received tensor's storage and clears the flag once that storage
  has been freed. A slot whose flag is still set is never written: the worker uses another, or
  a fresh segment when all are busy (a consumer that keeps every batch still gets correct ones).
"""

from __future__ import annotations

import os
import sys
import uuid
import weakref
from multiprocessing.reduction import ForkingPickler
from typing import Any

import numpy as np
import torch

SLOTS_PER_WORKER = 8
MAX_WORKERS = 64


class BufferPool:
    """Reusable byte buffers of this process, each handed out again once nothing references it."""

    def __init__(self, *, limit: int) -> None:
        self.limit = limit
        self._buffers: list[np.ndarray] = []
        self._pid = os.getpid()

    def take(self, shape: tuple[int, ...], dtype: Any = np.float32, *, reserve: int = 0) -> np.ndarray:
        """A C-contiguous array of ``shape`` in a free buffer (new memory when none is free and
        large enough). ``reserve``: bytes a new buffer gets at least, so that the largest request
        to come fits it. A new buffer takes the place of a free smaller one: a pool filled by
        small requests (a block cut by a share boundary) would otherwise hand every later large
        one fresh memory, which the kernel zeroes page by page (see the module docstring)."""
        if self._pid != os.getpid():  # a forked worker starts with its own buffers
            self._buffers, self._pid = [], os.getpid()
        nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
        smaller = None
        for i in range(len(self._buffers)):
            # free: referenced only by this list (and getrefcount's argument)
            if sys.getrefcount(self._buffers[i]) == 2:
                if self._buffers[i].nbytes >= nbytes:
                    return self._buffers[i][:nbytes].view(dtype).reshape(shape)
                smaller = i
        buffer = np.empty(max(nbytes, reserve), dtype=np.uint8)
        if smaller is not None:
            self._buffers[smaller] = buffer
        elif len(self._buffers) < self.limit:
            self._buffers.append(buffer)
        return buffer[:nbytes].view(dtype).reshape(shape)

    def __getstate__(self) -> dict:
        return {"limit": self.limit, "_buffers": [], "_pid": -1}


class LeasedBatch(dict):
    """A batch whose ``frames`` sit in a reused shared-memory slot (``lease``: stream token, slot)."""

    lease: tuple[str, int]


class _Watcher:
    """In the training process: clears a slot's flag once the batch received from it is freed."""

    def __init__(self, flags: torch.Tensor) -> None:
        self.flags = flags
        self.pending: dict[int, Any] = {}

    def received(self, slot: int, frames: torch.Tensor) -> None:
        from torch.multiprocessing.reductions import StorageWeakRef

        for held, ref in list(self.pending.items()):
            if ref.expired():
                self.flags[held] = 0
                del self.pending[held]
        self.pending[slot] = StorageWeakRef(frames.untyped_storage())


_WATCHERS: weakref.WeakValueDictionary[str, _Watcher] = weakref.WeakValueDictionary()


def _rebuild_leased(batch: dict, lease: tuple[str, int]) -> dict:
    """Runs in the training process as a leased batch is unpickled: a plain dict for the consumer."""
    watcher = _WATCHERS.get(lease[0])
    if watcher is not None:  # else the slot stays busy and its worker never reuses it
        watcher.received(lease[1], batch["frames"])
    return batch


def _reduce_leased(batch: LeasedBatch) -> tuple:
    return _rebuild_leased, (dict(batch), batch.lease)


ForkingPickler.register(LeasedBatch, _reduce_leased)


class SharedBatches:
    """Shared-memory batch slots of the workers of one stream (created in the training process,
    before the workers start; see the module docstring)."""

    def __init__(self) -> None:
        self.token = uuid.uuid4().hex
        self.flags = torch.zeros(MAX_WORKERS * SLOTS_PER_WORKER, dtype=torch.int32).share_memory_()
        self._watcher = _Watcher(self.flags)
        _WATCHERS[self.token] = self._watcher
        self._slots: dict[int, torch.Tensor] = {}
        self._pid = os.getpid()

    def __getstate__(self) -> dict:
        return {"token": self.token, "flags": self.flags, "_watcher": None, "_slots": {}, "_pid": -1}

    def take(self, worker: int, shape: tuple[int, ...]) -> tuple[torch.Tensor, int | None]:
        """(a shared float32 tensor of ``shape``, its slot or None for an unpooled one) for
        ``worker``; the slot is marked busy until the training process has freed the batch."""
        if self._pid != os.getpid():
            self._slots, self._pid = {}, os.getpid()
        if worker >= MAX_WORKERS:  # no flags of its own: unpooled
            return torch.empty(shape, dtype=torch.float32).share_memory_(), None
        first = worker * SLOTS_PER_WORKER
        for slot in range(first, first + SLOTS_PER_WORKER):
            tensor = self._slots.get(slot)
            if int(self.flags[slot]) == 0 and (tensor is None or tensor.shape == shape):
                if tensor is None:
                    tensor = self._slots[slot] = torch.empty(shape, dtype=torch.float32).share_memory_()
                self.flags[slot] = 1
                return tensor, slot
        return torch.empty(shape, dtype=torch.float32).share_memory_(), None

    def batch(self, frames: torch.Tensor, slot: int | None, **rest: torch.Tensor) -> dict[str, torch.Tensor]:
        if slot is None:
            return {"frames": frames, **rest}
        batch = LeasedBatch(frames=frames, **rest)
        batch.lease = (self.token, slot)
        return batch
