"""The planner's search on a thread of its own: a shallow stack whatever the caller's depth,
its result or its error handed back, and an interrupted caller's search stopped."""

from __future__ import annotations

import signal
import sys
import threading
import time

import pytest
from conftest import small_gpt, spy_on_partition, step

import fxmem
from fxmem import walks
from fxmem.own_stack import on_own_stack, stop_if_abandoned
from fxmem.planner import plan_trajectory

_signals = pytest.mark.skipif(
    not hasattr(signal, "pthread_kill") or threading.current_thread() is not threading.main_thread(),
    reason="an interrupt sent to the main thread",
)


def _depth() -> int:
    frame, n = sys._getframe(1), 0
    while frame is not None:
        frame, n = frame.f_back, n + 1
    return n


def _deep(levels: int, fn):
    return fn() if levels == 0 else _deep(levels - 1, fn)


def test_the_search_runs_at_the_foot_of_a_stack_however_deep_the_caller(monkeypatch):
    """CPython 3.11/3.12 map and unmap a stack chunk on every call that crosses a chunk's edge:
    the planner's millions of calls must not run wherever the caller's depth puts them."""
    depths = []
    simulate = walks.simulate

    def recording(*args, **kwargs):
        depths.append(_depth())
        return simulate(*args, **kwargs)

    monkeypatch.setattr(walks, "simulate", recording)
    model, batch = small_gpt()
    compiled = _deep(150, lambda: fxmem.optimize(model, 1.0, compiler="eager", example_inputs=batch))
    step(compiled, *batch)
    assert depths and max(depths) < 30  # the caller's: over 150


def test_what_the_search_returns_or_raises_reaches_the_caller():
    assert on_own_stack(lambda a, b: (a, b, threading.current_thread().name), 1, 2) == (1, 2, "fxmem-planner")

    def failing():
        raise ValueError("no state fits")

    with pytest.raises(ValueError, match="no state fits") as info:
        on_own_stack(failing)
    assert "failing" in [entry.name for entry in info.traceback]


def test_a_search_on_its_own_thread_runs_nested_calls_there():
    outer = on_own_stack(lambda: (threading.get_ident(), on_own_stack(threading.get_ident)))
    assert outer[0] == outer[1] != threading.get_ident()


@pytest.fixture
def interrupts():
    """Ctrl-C raises KeyboardInterrupt in the main thread, as in a plain Python process."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield lambda: signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)
    signal.signal(signal.SIGINT, previous)


@_signals
def test_an_interrupted_caller_stops_its_search(interrupts):
    """Ctrl-C while planning reaches the caller at once; the search stops at its next check
    instead of running on beside what the caller does next."""
    ended, rounds, at_interrupt = threading.Event(), [], []

    def search():
        try:
            for _ in range(2000):
                stop_if_abandoned()
                rounds.append(1)
                time.sleep(0.005)
        finally:
            ended.set()

    timer = threading.Timer(0.2, interrupts)
    timer.start()
    started = time.perf_counter()
    try:
        with pytest.raises(KeyboardInterrupt):
            try:
                on_own_stack(search)
            finally:
                at_interrupt.append(len(rounds))
    finally:
        timer.cancel()
    assert time.perf_counter() - started < 5  # not the search's 10 s
    assert ended.wait(5)
    assert len(rounds) <= at_interrupt[0] + 1
    stop_if_abandoned()  # the caller's own thread is not a search's


@_signals
def test_an_interrupted_plan_stops_at_its_next_simulation(monkeypatch, interrupts):
    planned = spy_on_partition(monkeypatch)
    model, batch = small_gpt()
    fxmem.optimize(model, 1.0, compiler="eager", example_inputs=batch)(*batch)
    caller_left, calls, outcomes = threading.Event(), [], []
    simulate = walks.simulate

    def interrupting(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:  # the first: Ctrl-C, and go on once the caller has left
            interrupts()
            caller_left.wait(5)
        try:
            return simulate(*args, **kwargs)
        except BaseException as err:
            outcomes.append(type(err).__name__)
            raise

    monkeypatch.setattr(walks, "simulate", interrupting)
    with pytest.raises(KeyboardInterrupt):
        try:
            plan_trajectory(planned[-1][0])
        finally:
            caller_left.set()
    for _ in range(100):
        if outcomes:
            break
        time.sleep(0.05)
    assert outcomes == ["_Abandoned"] and len(calls) == 1
