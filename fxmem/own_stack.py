"""Planning runs on a thread of its own, where its Python stack starts empty.

CPython keeps a thread's Python frames in 16 KiB chunks and, before the fix of its issue 142183
(3.13 and 3.14 have it from their spring 2026 releases; 3.11 and 3.12 never), frees a chunk as
soon as the frame at its start returns: a loop of calls that crosses a chunk's edge maps a new
chunk and unmaps it on every call. Planning runs inside torch.compile, hundreds of frames down
the caller's stack, and makes millions of small calls; whether its loops sit on an edge depends
on how deep the caller is. On Python 3.11, HF GPT-2's floor (12 layers, 10,786 joint nodes)
took 130 s to plan where they did, 55 s of it in the kernel mapping pages, and 58 s on a thread
of its own; a 4-layer one's, called from 16 depths, 3.5 to 13.7 s before and 3.4 to 3.9 s after.
With only the save/recompute search on its own thread, gpt-dropout's plans inside
`benchmarks/run.py` took 4.7 to 6.0 s; with all of planning there, 3.5 to 4.6 s.

What must run where the caller's torch state is (a kernel run to measure it: the modes, the
device and the profiler are the caller thread's own) the planning thread hands back to the
caller, which makes the call while it waits (`on_callers_thread`). The caller waits in short
slices so that an interrupt there (Ctrl-C, a notebook's stop button) reaches it within a tenth
of a second on every platform; planning then stops at its next check (`stop_if_abandoned`)
rather than running on beside whatever the caller does next, and the caller waits for that.
It runs in a copy of the caller's context variables, where torch keeps its config; the torch
state a thread keeps for itself, the caller passes on (see `_torch_private.carried_context`).
"""

from __future__ import annotations

import contextvars
import queue
import threading
from collections.abc import Callable
from typing import TypeVar

__all__ = ["on_callers_thread", "on_own_stack", "stop_if_abandoned"]

T = TypeVar("T")

_SLICE_S = 0.1  # the longest a wait goes without looking for an interrupt or an abandoned caller

# On a planning thread: `abandoned`, the Event its caller sets; `caller`, the queue of calls its
# caller makes for it.
_local = threading.local()


class _Abandoned(BaseException):
    """Raised on a planning thread once its caller has stopped waiting for it: not an
    `Exception`, so that no handler on the way out takes it for planning's own failure."""


class _Call:
    """A call a planning thread asks its waiting caller to make; `outcome`: (raised, what)."""

    def __init__(self, fn: Callable[..., object], args: tuple) -> None:
        self.fn, self.args = fn, args
        self.outcome: tuple[bool, object] | None = None
        self.done = threading.Event()

    def take(self) -> tuple[bool, object]:
        outcome, self.outcome = self.outcome, None
        return outcome

    def make(self) -> None:
        try:
            self.outcome = (False, self.fn(*self.args))
        except Exception as err:  # handed to the planning thread, which raises it
            self.outcome = (True, err)
        finally:
            if self.outcome is None:  # interrupted: the caller stops waiting, planning stops
                self.outcome = (True, _Abandoned())
            self.done.set()


def on_own_stack(fn: Callable[..., T], *args: object) -> T:
    """`fn(*args)` run on a new thread, the caller waiting: what it returns, or what it raises.
    Called on such a thread already, or where no thread can start, `fn` runs where it is."""
    if getattr(_local, "abandoned", None) is not None:
        return fn(*args)
    abandoned = threading.Event()
    calls: queue.SimpleQueue[_Call | None] = queue.SimpleQueue()  # None: `fn` has ended
    outcome: list[tuple[bool, object]] = []  # (raised, what)
    # `job`: what to run, taken when it starts, or dropped by a caller interrupted before then
    # (a thread `Thread.start()` never launched keeps its target); `began`: whether it started.
    # Both under `gate`, so that such a caller knows whether to wait. `ended`: the thread is done
    # with the caller's objects.
    gate, job, began, ended = threading.Lock(), [(fn, args)], [], threading.Event()

    def run() -> None:
        _local.abandoned, _local.caller = abandoned, calls
        try:
            with gate:
                if abandoned.is_set():
                    return
                began.append(True)
                work, arguments = job.pop()
            outcome.append((False, work(*arguments)))
        except BaseException as err:  # handed to the caller, which raises it
            outcome.append((True, err))
        finally:
            ended.set()
            calls.put(None)

    def abandon() -> None:
        """Stop the thread at its next check (`stop_if_abandoned`) and wait for that, so that it
        is not still changing the caller's graph, or entering and leaving its fake mode, while
        the caller goes on; a second interrupt stops the wait."""
        abandoned.set()  # first: an interrupt in the wait for `gate` must not leave it unset
        with gate:
            started = bool(began)
            job.clear()
        while started and not ended.wait(_SLICE_S):
            pass
        outcome.clear()  # what the stopped thread raised, and its traceback's frames

    # In a copy of the caller's context: torch keeps its config (what the caller patched or
    # set) in context variables, which a new thread does not see.
    worker = threading.Thread(target=contextvars.copy_context().run, args=(run,), name="fxmem-planner", daemon=True)
    try:
        worker.start()  # waits for the thread to run: an interrupt may land here too
    except RuntimeError:  # no more threads, or the interpreter is shutting down
        return fn(*args)
    except BaseException:
        abandon()
        raise
    try:
        # Waits in short slices: on Windows before Python 3.14 an untimed wait lets no
        # interrupt through until it ends.
        while True:
            try:
                call = calls.get(timeout=_SLICE_S)
            except queue.Empty:
                continue
            if call is None:
                break
            call.make()
    finally:
        if not outcome:
            abandon()
    # Taken out of the list: the error's traceback holds `run`'s frame, and so `outcome`.
    return _handed_back(*outcome.pop())


def on_callers_thread(fn: Callable[..., T], *args: object) -> T:
    """`fn(*args)`, made on the thread that waits for this planning thread (a kernel run on
    the caller's modes, device and profiler), this thread waiting; anywhere else, here."""
    calls = getattr(_local, "caller", None)
    if calls is None:
        return fn(*args)
    call = _Call(fn, args)
    calls.put(call)
    while not call.done.wait(_SLICE_S):
        stop_if_abandoned()  # the caller left before it made the call
    return _handed_back(*call.take())


def _handed_back(raised: bool, what: object):
    """What a call on another thread returned, or what it raised raised here (no local of the
    caller's frames keeps it, nor so the frames its traceback holds)."""
    if not raised:
        return what
    try:
        raise what
    finally:
        what = None  # nor the error this frame, once its traceback holds the frame


def stop_if_abandoned() -> None:
    """On a planning thread whose caller stopped waiting (interrupted), end planning."""
    abandoned = getattr(_local, "abandoned", None)
    if abandoned is not None and abandoned.is_set():
        raise _Abandoned
