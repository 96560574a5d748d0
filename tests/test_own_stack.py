"""Planning on a thread of its own: a shallow stack whatever the caller's depth, its result or
its error handed back, its kernel runs made on the caller's thread, and an interrupted
caller's planning stopped."""

from __future__ import annotations

import signal
import sys
import threading
import time

import pytest
import torch
from conftest import small_gpt, spy_on_partition, step

import fxmem
from fxmem import partition, probe, walks
from fxmem.own_stack import on_callers_thread, on_own_stack, stop_if_abandoned
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
    """Ctrl-C while planning reaches the caller at once; the search stops at its next check,
    and the caller waits for that, instead of it running on beside what the caller does next."""
    ended, at_interrupt = threading.Event(), []

    def search():
        try:
            for k in range(2000):
                stop_if_abandoned()
                if k == 10:
                    interrupts()  # from the search: the caller is waiting by then
                time.sleep(0.005)
        finally:
            ended.set()

    started = time.perf_counter()
    with pytest.raises(KeyboardInterrupt):
        try:
            on_own_stack(search)
        finally:
            at_interrupt.append(ended.is_set())
    assert time.perf_counter() - started < 5  # not the search's 10 s
    assert at_interrupt == [True]  # stopped at its next check, before the caller went on
    stop_if_abandoned()  # the caller's own thread is not a search's


@_signals
def test_an_interrupted_plan_stops_at_its_next_simulation(monkeypatch, interrupts):
    planned = spy_on_partition(monkeypatch)
    model, batch = small_gpt()
    fxmem.optimize(model, 1.0, compiler="eager", example_inputs=batch)(*batch)
    calls, outcomes = [], []
    simulate = walks.simulate

    def interrupting(*args, **kwargs):
        calls.append(1)
        try:
            if len(calls) == 1:  # the first: Ctrl-C, then wait until the caller has it
                interrupts()
                for _ in range(500):
                    stop_if_abandoned()
                    time.sleep(0.01)
            return simulate(*args, **kwargs)
        except BaseException as err:
            outcomes.append(type(err).__name__)
            raise

    monkeypatch.setattr(walks, "simulate", interrupting)
    with pytest.raises(KeyboardInterrupt):
        on_own_stack(plan_trajectory, planned[-1][0])  # as partitioning runs it
    assert outcomes == ["_Abandoned"] and len(calls) == 1


def test_planning_runs_at_the_foot_of_a_stack_and_its_kernels_on_the_callers_thread(monkeypatch):
    """CPython 3.11/3.12 map and unmap a stack chunk on every call that crosses a chunk's edge:
    planning's millions of calls (the graph's arrays, the search, the emitted graphs) must not
    run wherever the caller's depth puts them. They run on the planning thread, under the
    caller's grad mode (AOTAutograd partitions under no_grad); the kernels planning measures
    run on the caller's thread, whose modes and device they need."""
    simulated, emitted, probed = [], [], []
    simulate, emit_graphs, run_real = walks.simulate, partition.emit_graphs, probe._run_real

    def simulating(*args, **kwargs):
        simulated.append(_depth())
        return simulate(*args, **kwargs)

    def emitting(*args):
        emitted.append((_depth(), threading.current_thread(), torch.is_grad_enabled()))
        return emit_graphs(*args)

    def probing(*args):
        probed.append(threading.current_thread())
        return run_real(*args)

    monkeypatch.setattr(walks, "simulate", simulating)
    monkeypatch.setattr(partition, "emit_graphs", emitting)
    monkeypatch.setattr(probe, "_run_real", probing)
    monkeypatch.setattr(probe, "_cache", {})  # each kernel measured again
    model, batch = small_gpt()
    compiled = _deep(150, lambda: fxmem.optimize(model, 1.0, compiler="eager", example_inputs=batch))
    step(compiled, *batch)
    assert simulated and max(simulated) < 30  # the caller's: over 150
    ((depth, thread, grad),) = emitted
    assert depth < 30 and thread.name == "fxmem-planner" and not grad
    assert probed and set(probed) == {threading.current_thread()}  # layer norms, attention


def test_a_call_made_for_the_planning_thread_runs_on_its_caller():
    def planning():
        here = threading.get_ident()
        return here, on_callers_thread(lambda a: (a, threading.get_ident()), 7)

    here, (value, there) = on_own_stack(planning)
    assert value == 7 and there == threading.get_ident() != here
    assert on_callers_thread(threading.get_ident) == threading.get_ident()  # not on one: here

    def failing():
        raise ValueError("no kernel for these inputs")

    with pytest.raises(ValueError, match="no kernel") as info:
        on_own_stack(on_callers_thread, failing)
    assert "failing" in [entry.name for entry in info.traceback]


@_signals
def test_an_interrupt_during_a_call_for_the_planning_thread_stops_planning(interrupts):
    """Ctrl-C while the caller makes a call for planning (a kernel measured) reaches the
    caller; planning, waiting for that call, stops instead of going on."""
    outcomes = []

    def slow():
        interrupts()
        time.sleep(10)  # the interrupt lands here

    def planning():
        try:
            on_callers_thread(slow)
        except BaseException as err:
            outcomes.append(type(err).__name__)
            raise
        outcomes.append("went on")

    started = time.perf_counter()
    with pytest.raises(KeyboardInterrupt):
        on_own_stack(planning)
    assert time.perf_counter() - started < 5
    assert outcomes == ["_Abandoned"]


def test_planning_reads_the_config_its_caller_set():
    """torch keeps its config in context variables, which a new thread does not see: planning
    must read what the caller patched (what inductor will do with the graph)."""
    from torch._inductor import config

    from fxmem import _torch_private as tp

    with config.patch(realize_acc_reads_threshold=3):
        assert on_own_stack(tp.inductor_max_accumulated_reads, "cpu") == 3
    assert on_own_stack(tp.inductor_max_accumulated_reads, "cpu") != 3


def test_planning_runs_in_its_callers_torch_state():
    """Grad mode, Dynamo's tracing context and the active fake mode are each thread's own: the
    caller's are entered on the planning thread (under a tracing context, dead-code elimination
    leaves unused random ops out of the emitted graphs)."""
    from torch._guards import TracingContext, tracing
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    from fxmem import _torch_private as tp

    mode = FakeTensorMode()
    context = TracingContext(mode)

    def state(carried):
        with carried():
            made = torch.empty(2)
            return torch.is_grad_enabled(), TracingContext.try_get(), isinstance(made, FakeTensor)

    with torch.no_grad(), tracing(context), mode:
        assert on_own_stack(state, tp.carried_context()) == (False, context, True)
    assert on_own_stack(state, tp.carried_context()) == (True, None, False)
