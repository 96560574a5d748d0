"""Measure the peak device memory of one call, by the rule every fxmem claim uses.

The quantity, in bytes, is the peak of tensor memory in use on the device while
``fn`` runs, counting everything alive there: parameters, buffers, inputs,
gradients, optimizer state, saved activations and temporaries.

* CUDA: ``torch.cuda.max_memory_allocated()`` after ``reset_peak_memory_stats()``.
* CPU: the bytes of tensor storages alive at entry (:func:`live_tensor_bytes`)
  plus the highest running total (floored at 0) of the allocator events the
  torch profiler records with ``profile_memory=True``, compiled code included.
  Each free is matched to its block by address: frees of blocks alive at entry
  lower the total by the bytes the entry scan counted, frees of blocks it never
  saw are ignored. torch reports a CPU free only if its allocator made the block
  while memory profiling was on, or an earlier block at the same address whose
  free it missed (never for memory it did not allocate: ``torch.frombuffer``,
  ``torch.from_numpy``); when an entry tensor freed during the call has no such
  event, the peak is an upper bound and a warning says by how much. Tensors
  allocated inside an earlier ``measure`` call (e.g. a warm-up step) are always
  exact.
"""

from __future__ import annotations

import gc
import time
import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.multiprocessing.reductions import StorageWeakRef
from torch.profiler import ProfilerActivity, profile

__all__ = ["Measurement", "live_storage_bytes", "live_tensor_bytes", "measure"]

_MIB = 1024 * 1024
_CPU = torch.device("cpu")


@dataclass(frozen=True)
class Measurement:
    """Result of :func:`measure`; sizes in bytes, time in seconds.

    On CPU ``seconds`` includes the profiler's small per-op overhead; on CUDA the
    device is synchronised before and after. ``result`` is what fn returned.
    """

    peak_bytes: int
    entry_bytes: int
    seconds: float
    device: torch.device
    result: Any = field(repr=False, compare=False)

    def __str__(self) -> str:
        return (
            f"peak {self.peak_bytes / _MIB:.1f} MiB "
            f"(entry {self.entry_bytes / _MIB:.1f} MiB) "
            f"in {self.seconds:.3f} s on {self.device}"
        )


def _tensors_in(obj: Any, seen: set[int]) -> Iterator[torch.Tensor]:
    """Yield tensors reachable from obj through containers, modules and optimizers."""
    if id(obj) in seen:
        return
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, torch.nn.Module):
        yield from obj.parameters()
        yield from obj.buffers()
    elif isinstance(obj, torch.optim.Optimizer):
        for group in obj.param_groups:
            yield from group["params"]
    elif isinstance(obj, (list, tuple, set)):
        for item in obj:
            yield from _tensors_in(item, seen)
    elif isinstance(obj, dict):
        for item in obj.values():
            yield from _tensors_in(item, seen)


def _pick_device(fn: Callable[..., Any], args: tuple, kwargs: dict) -> torch.device:
    """The first CUDA device among fn's tensors (fn itself, bound self, args), else CPU."""
    roots: list[Any] = [fn, getattr(fn, "__self__", None), args, kwargs]
    for t in _tensors_in(roots, set()):
        if t.device.type == "cuda":
            return t.device
    return _CPU


def _storage(t: torch.Tensor, device: torch.device) -> torch.UntypedStorage | None:
    """t's storage if it is a real, non-empty storage on device, else None."""
    try:
        if isinstance(t, FakeTensor) or t.is_meta or t.device != device:
            return None
        storage = t.untyped_storage()
        return storage if storage.data_ptr() != 0 else None
    except Exception:  # noqa: BLE001 - sparse, wrapper subclasses, functional tensors
        return None


def _live_storages(device: torch.device) -> dict[int, torch.UntypedStorage]:
    """Storages of live tensors (and leaf gradients) on device, keyed by data pointer."""
    gc.collect()
    found: dict[int, torch.UntypedStorage] = {}
    with warnings.catch_warnings():  # isinstance can poke deprecated lazy objects
        warnings.simplefilter("ignore")
        objects = [o for o in gc.get_objects() if isinstance(o, torch.Tensor)]
    for obj in objects:
        try:
            tensors = [obj]
            if obj.is_leaf and obj.requires_grad and obj.grad is not None:
                tensors.append(obj.grad)  # made by autograd in C++: gc may not see it
        except Exception:  # noqa: BLE001, S112 - tensor subclasses that refuse
            continue
        for t in tensors:
            storage = _storage(t, device)
            if storage is not None:
                found[storage.data_ptr()] = storage
    return found


def live_tensor_bytes(device: torch.device | str | int) -> int:
    """Bytes of the unique storages of live Python-visible tensors on ``device``.

    Runs ``gc.collect()`` first, then scans ``gc.get_objects()``. Storages shared
    by views are counted once (deduplicated by data pointer). The ``.grad`` of
    every leaf tensor requiring grad is included, since autograd creates it in
    C++ and it may have no Python object yet. Tensors that exist only inside
    C++ (e.g. activations saved by a live autograd graph) are not seen.
    """
    return sum(live_storage_bytes(device).values())


def live_storage_bytes(device: torch.device | str | int) -> dict[int, int]:
    """Data pointer -> bytes of each storage :func:`live_tensor_bytes` counts (one scan)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return {p: s.nbytes() for p, s in _live_storages(device).items()}


def _entry_storages() -> dict[int, tuple[int, StorageWeakRef]]:
    """data_ptr -> (nbytes, weak reference) for the CPU storages alive now."""
    return {p: (s.nbytes(), StorageWeakRef(s)) for p, s in _live_storages(_CPU).items()}


def _allocation_events(result: Any, device: torch.device = _CPU) -> list[tuple[int, int, int]]:
    """(time ns, ptr, signed bytes) of `device`'s allocator events, in time order."""
    events, stack = [], list(result.experimental_event_tree())
    while stack:
        e = stack.pop()
        stack.extend(e.children)
        fields = e.extra_fields  # allocation events carry ptr, alloc_size, device
        if hasattr(fields, "alloc_size") and fields.device.type == device.type:
            events.append((e.start_time_ns, fields.ptr, fields.alloc_size))
    events.sort(key=lambda ev: ev[0])
    return events


def _running_totals(
    events: list[tuple[int, int, int]], entry: Mapping[int, int], freed: set[int]
) -> Iterator[tuple[int, dict[int, int]]]:
    """After each allocator event: the bytes allocated since the start less those freed, and
    the blocks allocated since the start that are alive (pointer -> bytes; updated in place).

    `entry`: pointer -> bytes of the blocks alive at the start. A free counts only for a block
    allocated earlier in the call or alive at entry (once: `freed` collects the entry pointers
    seen freed), by the bytes that block was counted with: the size a free event carries is
    the allocator's record for that address, which may be left from an earlier block there.
    Frees of blocks that entry never counted are ignored.
    """
    live: dict[int, int] = {}
    running = 0
    for _, ptr, nbytes in events:
        if nbytes > 0:
            live[ptr] = nbytes
            running += nbytes
        elif ptr in live:
            running -= live.pop(ptr)
        elif ptr in entry and ptr not in freed:
            freed.add(ptr)
            running -= entry[ptr]
        yield running, live


def _peak_rise(events: list[tuple[int, int, int]], entry: Mapping[int, int]) -> tuple[int, set[int]]:
    """Highest running total (floored at 0) and the entry pointers seen freed."""
    freed: set[int] = set()
    peak = max((running for running, _ in _running_totals(events, entry, freed)), default=0)
    return max(peak, 0), freed


@dataclass(frozen=True)
class _CpuCall:
    """One call of fn under the memory profiler, counted by the rule of the module docstring."""

    entry_bytes: int
    totals: list[int]  # the running total after each allocator event
    seconds: float
    result: Any

    @property
    def peak_bytes(self) -> int:
        return self.entry_bytes + max([0, *self.totals])


def _profiled_cpu_call(fn: Callable[..., Any], args: tuple, kwargs: dict, stacklevel: int) -> _CpuCall:
    """Run fn under the memory profiler; warn (at `stacklevel`, counted from here) when entry
    tensors were freed unseen."""
    from fxmem.probe import probes_skipped  # the probe measures with this module's events

    if torch.autograd._profiler_enabled():
        raise RuntimeError(
            "fxmem.measure on CPU needs the torch profiler, but one is already "
            "active (a torch.profiler.profile block, or measure itself: calls of measure "
            "do not nest); call measure outside it"
        )
    entry = _entry_storages()
    skipped = probes_skipped()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        start = time.perf_counter()
        result = fn(*args, **kwargs)
        seconds = time.perf_counter() - start
    if probes_skipped() != skipped:
        warnings.warn(
            "fxmem.measure: the call planned a step under the profiler, where fxmem cannot "
            "measure library kernels' workspaces (convolutions, attention): that plan counts "
            "them as 0 and can exceed its budget. fxmem.optimize plans the step again at its "
            "next call outside measure: take one step (or plan_for) before measuring",
            stacklevel=stacklevel,
        )
    sizes = {p: n for p, (n, _) in entry.items()}
    freed: set[int] = set()
    events = _allocation_events(prof.profiler.kineto_results)
    totals = [running for running, _ in _running_totals(events, sizes, freed)]
    unseen = sum(n for p, (n, ref) in entry.items() if p not in freed and ref.expired())
    if unseen:
        warnings.warn(
            f"fxmem.measure: {unseen / _MIB:.1f} MiB of tensors alive at entry were "
            "freed during the call without a profiler free event (torch reports CPU "
            "frees only for blocks its allocator made while memory profiling was on), "
            "so the peak may be overstated by up to that much; allocate them inside an "
            "earlier measure() call (e.g. a warm-up step) to make it exact",
            stacklevel=stacklevel,
        )
    return _CpuCall(sum(sizes.values()), totals, seconds, result)


def _measure_cpu(fn: Callable[..., Any], args: tuple, kwargs: dict) -> Measurement:
    call = _profiled_cpu_call(fn, args, kwargs, stacklevel=4)
    return Measurement(call.peak_bytes, call.entry_bytes, call.seconds, _CPU, call.result)


def _measure_cuda(fn: Callable[..., Any], args: tuple, kwargs: dict, device: torch.device) -> Measurement:
    torch.cuda.synchronize(device)
    gc.collect()
    torch.cuda.reset_peak_memory_stats(device)
    entry = torch.cuda.memory_allocated(device)
    start = time.perf_counter()
    result = fn(*args, **kwargs)
    torch.cuda.synchronize(device)
    seconds = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated(device)
    return Measurement(peak, entry, seconds, device, result)


def measure(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Measurement:
    """Run ``fn(*args, **kwargs)`` once; return its peak device memory and time.

    The device is the first CUDA device holding a tensor among the arguments
    (searched through lists, tuples, dicts, modules and optimizers) or the
    parameters of ``fn`` when it is a module or a module's bound method; CPU
    otherwise. All keyword arguments are passed to ``fn``. Sizes are in bytes;
    see the module docstring for exactly what is counted. On CPU the call runs
    under the torch profiler, so ``seconds`` includes its small per-op overhead,
    and a RuntimeError is raised if a profiler is already active.
    """
    device = _pick_device(fn, args, kwargs)
    if device.type == "cuda":
        return _measure_cuda(fn, args, kwargs, device)
    return _measure_cpu(fn, args, kwargs)
