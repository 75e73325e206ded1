"""A background thread that runs an iterator ahead of its consumer.

The climate stream uses two: ``data.read_ahead`` blocks read (and decoded) ahead of the gathering
of batches, in every process; and, without DataLoader workers, ``data.prefetch`` batches gathered
ahead of the training step. Reading (``os.preadv``), decompression (zlib, Blosc) and the numpy/torch copies release
the GIL, so a thread overlaps them with the step at no IPC cost. The items and their order are
those of the iterator (resume and sharding are unchanged); an exception in the thread is raised in
the consumer, where the next item would have been.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from typing import Any


class _Failure:
    def __init__(self, error: BaseException) -> None:
        self.error = error


def prefetched(items: Iterator[Any], *, depth: int, name: str = "optbench-prefetch") -> Iterator[Any]:
    """``items``, produced by a daemon thread (``name``) up to ``depth`` ahead; closing (or
    dropping) the returned generator stops the thread."""
    ready: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def produce() -> None:
        try:
            for item in items:
                while not stop.is_set():
                    try:
                        ready.put(item, timeout=0.05)
                        break
                    except queue.Full:
                        continue
                if stop.is_set():
                    return
        except BaseException as error:  # noqa: BLE001 - handed to the consumer, raised there
            ready.put(_Failure(error))

    thread = threading.Thread(target=produce, name=name, daemon=True)
    thread.start()
    try:
        while True:
            item = ready.get()
            if isinstance(item, _Failure):
                raise item.error
            yield item
    finally:
        stop.set()
        while thread.is_alive():
            try:
                ready.get(timeout=0.05)
            except queue.Empty:
                pass
