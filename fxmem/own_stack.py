"""The planner's search runs on a thread of its own, where its Python stack starts empty.

CPython keeps a thread's Python frames in 16 KiB chunks and, before the fix of its issue 142183
(3.13 and 3.14 have it from their spring 2026 releases; 3.11 and 3.12 never), frees a chunk as
soon as the frame at its start returns: a loop of calls that crosses a chunk's edge maps a new
chunk and unmaps it on every call. The planner runs inside torch.compile, hundreds of frames
down the caller's stack, and makes millions of small calls; whether its loops sit on an edge
depends on how deep the caller is. On Python 3.11, HF GPT-2's floor (12 layers, 10,786 joint
nodes) took 130 s to plan where they did, 55 s of it in the kernel mapping pages, and 66 s on a
thread of its own; a 4-layer one's, called from 16 depths, 3.5 to 13.7 s before and 3.6 to
5.5 s after.

The caller's thread waits for the search, in short slices so that an interrupt there (Ctrl-C,
a notebook's stop button) reaches it within a tenth of a second on every platform; the search
then stops at its next simulation (`stop_if_abandoned`) rather than running on beside whatever
the caller does next.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

__all__ = ["on_own_stack", "stop_if_abandoned"]

T = TypeVar("T")

_local = threading.local()  # on a search's thread: `abandoned`, the Event its caller sets


class _Abandoned(BaseException):
    """Raised on a search's thread once its caller has stopped waiting for it: not an
    `Exception`, so that no handler on the way out takes it for the search's own failure."""


def on_own_stack(fn: Callable[..., T], *args: object) -> T:
    """`fn(*args)` run on a new thread, the caller waiting: what it returns, or what it raises.
    Called on such a thread already, or where no thread can start, `fn` runs where it is."""
    if getattr(_local, "abandoned", None) is not None:
        return fn(*args)
    abandoned, done = threading.Event(), threading.Event()
    outcome: list[tuple[bool, object]] = []  # (raised, what)

    def run() -> None:
        _local.abandoned = abandoned
        try:
            outcome.append((False, fn(*args)))
        except BaseException as err:  # handed to the caller, which raises it
            outcome.append((True, err))
        finally:
            done.set()

    worker = threading.Thread(target=run, name="fxmem-planner", daemon=True)
    try:
        worker.start()  # waits for the thread to run: an interrupt may land here too
    except RuntimeError:  # no more threads, or the interpreter is shutting down
        return fn(*args)
    except BaseException:
        abandoned.set()
        raise
    try:
        # Waits in short slices: on Windows before Python 3.14 an untimed wait lets no
        # interrupt through until it ends.
        while not done.wait(0.1):
            pass
    finally:
        if not done.is_set():
            abandoned.set()
    ((raised, what),) = outcome
    outcome.clear()  # the error's traceback holds `run`'s frame, and so `outcome`
    if not raised:
        return what
    try:
        raise what
    finally:
        what = None  # nor the error this frame, once its traceback holds the frame


def stop_if_abandoned() -> None:
    """On a search's thread whose caller stopped waiting (interrupted), end the search."""
    abandoned = getattr(_local, "abandoned", None)
    if abandoned is not None and abandoned.is_set():
        raise _Abandoned
