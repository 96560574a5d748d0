"""The planner's search runs on a thread of its own, where its Python stack starts empty.

CPython 3.11 and 3.12 keep a thread's Python frames in 16 KiB chunks and free a chunk as soon
as the frame at its start returns: a loop of calls that crosses a chunk's edge maps a new chunk
and unmaps it on every call (CPython issue 142183; later versions keep a spare chunk). The
planner runs inside torch.compile, hundreds of frames down the caller's stack, and makes
millions of small calls; whether its loops sit on an edge depends on how deep the caller is.
Where they did, HF GPT-2's floor (12 layers, 10,786 joint nodes) took 130 s to plan, 55 s of
it in the kernel mapping pages; on a thread of its own, 69 s.

The caller's thread waits for the search. An interrupt there (Ctrl-C, a notebook's stop button)
reaches the caller at once, and the search stops at its next simulation (`stop_if_abandoned`)
rather than running on beside whatever the caller does next.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

__all__ = ["on_own_stack", "stop_if_abandoned"]

T = TypeVar("T")

_local = threading.local()  # on a search's thread: `abandoned`, the Event its caller sets


class _Abandoned(Exception):
    """Raised on a search's thread once its caller has stopped waiting for it."""


def on_own_stack(fn: Callable[..., T], *args: object) -> T:
    """`fn(*args)` run on a new thread, the caller waiting: what it returns, or what it raises.
    Called on such a thread already, `fn` runs there."""
    if getattr(_local, "abandoned", None) is not None:
        return fn(*args)
    abandoned = threading.Event()
    outcome: list[tuple[bool, object]] = []  # (raised, what)

    def run() -> None:
        _local.abandoned = abandoned
        try:
            outcome.append((False, fn(*args)))
        except BaseException as err:  # handed to the caller, which raises it
            outcome.append((True, err))

    worker = threading.Thread(target=run, name="fxmem-planner", daemon=True)
    worker.start()
    try:
        worker.join()
    except BaseException:
        abandoned.set()
        raise
    ((raised, what),) = outcome
    if raised:
        raise what
    return what


def stop_if_abandoned() -> None:
    """On a search's thread whose caller stopped waiting (interrupted), end the search."""
    abandoned = getattr(_local, "abandoned", None)
    if abandoned is not None and abandoned.is_set():
        raise _Abandoned
