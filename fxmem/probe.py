"""Workspace memory of library kernels, measured by running them once.

Attention kernels allocate scratch space inside themselves, on top of their outputs: the CPU
flash kernels keep per-thread blocks of scores, the CUDA ones accumulate the query gradient in
fp32; run op by op, CPU convolutions reorder their inputs and batch norm's backward keeps a
second buffer. Its size depends on the kernel the dispatcher picks, the layout, the thread
count and the device, so it is measured rather than modelled: the op runs once on tensors of the node's shapes, and its
workspace is the highest allocation rise during the call (the allocator's events, as the
profiler records them; CUDA's peak counters are left alone) less the bytes of what it returns.
Results are kept per op, argument shapes, device and thread count for the process. Under a
running profiler (a first call inside `fxmem.measure`) nothing can be measured: that plan
counts no workspace, and a later one measures it.
"""

from __future__ import annotations

import logging

import torch
import torch.fx as fx
from torch.profiler import ProfilerActivity, profile

from fxmem import _torch_private as tp
from fxmem.measure import _allocation_events, _peak_rise
from fxmem.own_stack import on_callers_thread

__all__ = ["probes_skipped", "workspace_bytes"]

log = logging.getLogger(__name__)

# Ops with a workspace worth knowing (substrings of the op's name): attention, under any
# compiler. Under one that runs aten's kernels one by one, also convolutions, forward and
# backward, whose CPU kernels reorder contiguous inputs (as much as an input or output, more
# than the output itself in a 3x3 convolution's backward), and the normalisations (CPU batch
# norm's backward: a second buffer of its input's size). A fusing compiler decomposes the
# normalisations; where it runs convolutions channels-last (inductor on CPU) most reorder
# nothing, but a depthwise convolution's backward still takes scratch space (ConvNeXt's 7x7:
# 3.1 MiB, as much as its input), so they are probed too, channels-last.
_PROBED = ("scaled_dot_product",)
_CONVOLUTIONS = ("convolution",)
_PROBED_UNFUSED = (*_CONVOLUTIONS, "native_batch_norm", "native_layer_norm", "native_group_norm")
# A probe allocates its own inputs; beyond this it is not worth the time or the memory.
_MAX_PROBE_BYTES = 512 * 2**20

_cache: dict[tuple, int] = {}
_skipped = [0]  # kernels left unprobed because a profiler was running


def probes_skipped() -> int:
    """How many times a kernel's workspace went unmeasured (counted as 0) because a profiler
    was running (`fxmem.measure` around the call that planned): a plan made then can fall
    short by that workspace, and is best made again outside the profiler."""
    return _skipped[0]


def workspace_bytes(node: fx.Node, fusing: bool = False, channels_last: bool = False) -> int:
    """Bytes `node`'s kernel allocates and frees inside itself (0 when not probed); `fusing`:
    the graph is compiled by a fusing compiler (inductor) rather than run op by op;
    `channels_last`: that compiler runs the graph's convolutions channels-last, on 4-d
    arguments of that layout, whatever their traced strides."""
    if node.op != "call_function":
        return 0
    target = str(node.target)
    convolution = any(p in target for p in _CONVOLUTIONS)
    if fusing:
        probed = any(p in target for p in _PROBED) or (convolution and channels_last)
    else:
        probed = any(p in target for p in _PROBED + _PROBED_UNFUSED)
    if not probed:
        return 0
    layout = torch.channels_last if fusing and convolution else None
    try:
        key = (target, _signature(node.args), _signature(node.kwargs), torch.get_num_threads(), layout)
    except _Unprobeable:
        return 0
    if key not in _cache:
        found = on_callers_thread(_run, node, layout)  # a kernel run on the caller's modes and device
        if found is None:  # not measurable now (a profiler is running): 0, and ask again later
            _skipped[0] += 1
            return 0
        _cache[key] = found
    return _cache[key]


class _Unprobeable(Exception):
    pass


def _signature(obj: object) -> object:
    if isinstance(obj, fx.Node):
        val = obj.meta.get("val")
        if not isinstance(val, torch.Tensor):
            raise _Unprobeable
        try:
            return (tuple(int(s) for s in val.shape), tuple(int(s) for s in val.stride()), val.dtype, str(val.device))
        except TypeError as err:  # symbolic sizes
            raise _Unprobeable from err
    if isinstance(obj, (list, tuple)):
        return tuple(_signature(o) for o in obj)
    if isinstance(obj, dict):
        return tuple((k, _signature(v)) for k, v in obj.items())
    if isinstance(obj, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        raise _Unprobeable
    return obj


def _real(obj: object, made: list[torch.Tensor], layout: torch.memory_format | None = None) -> object:
    """A tensor of the node's shape, strides, dtype and device (a 4-d one in `layout`, when
    given), filled with small values."""
    if isinstance(obj, fx.Node):
        val = obj.meta["val"]
        if layout is not None and val.ndim == 4:
            t = torch.empty(tuple(val.shape), dtype=val.dtype, device=val.device, memory_format=layout)
        else:
            t = torch.empty_strided(tuple(val.shape), tuple(val.stride()), dtype=val.dtype, device=val.device)
        if t.is_floating_point():
            t.uniform_(-0.5, 0.5)
        else:
            t.fill_(1 if t.dtype == torch.bool else 0)
        made.append(t)
        return t
    if isinstance(obj, (list, tuple)):
        return type(obj)(_real(o, made, layout) for o in obj)
    if isinstance(obj, dict):
        return {k: _real(v, made, layout) for k, v in obj.items()}
    return obj


def _probe_arguments(
    node: fx.Node, made: list[torch.Tensor], layout: torch.memory_format | None = None
) -> tuple[tuple, dict]:
    """Real arguments for a probe of `node`. Where the op reads dropout's random state from
    tensors (the attention backwards' `philox_seed` and `philox_offset`), the probe runs with
    dropout off: the kernels' scratch space does not depend on it, and those tensors, which the
    CUDA kernels read on the host outside graph capture, are host tensors that the fake values
    place on the device (read there as host memory, they crash the process)."""
    args, kwargs = list(_real(node.args, made, layout)), dict(_real(node.kwargs, made, layout))
    schema = getattr(node.target, "_schema", None)
    names = [a.name for a in schema.arguments] if schema is not None else []
    if any(n.startswith("philox_") for n in names):
        for i, name in enumerate(names):
            if name == "dropout_p" or name.startswith("philox_"):
                value = 0.0 if name == "dropout_p" else torch.zeros((), dtype=torch.int64)
                if i < len(args):
                    args[i] = value
                elif name in kwargs:
                    kwargs[name] = value
    return tuple(args), kwargs


def _outputs_bytes(out: object) -> int:
    if isinstance(out, torch.Tensor):
        return out.untyped_storage().nbytes()
    if isinstance(out, (list, tuple)):
        return sum(_outputs_bytes(o) for o in out)
    return 0


def _run(node: fx.Node, layout: torch.memory_format | None = None) -> int | None:
    if torch.autograd._profiler_enabled():
        return None  # the caller is profiling (fxmem.measure around a first call): no nesting
    with tp.real_tensors():  # planning runs under AOTAutograd's fake mode
        return _run_real(node, layout)


def _run_real(node: fx.Node, layout: torch.memory_format | None = None) -> int:
    made: list[torch.Tensor] = []
    try:
        args, kwargs = _probe_arguments(node, made, layout)
        if sum(t.untyped_storage().nbytes() for t in made) > _MAX_PROBE_BYTES:
            return 0
        device = made[0].device if made else torch.device("cpu")
        # The allocator's events rather than CUDA's peak counters, which the caller may be
        # reading: a probe leaves them as they were.
        with torch.no_grad(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            out = node.target(*args, **kwargs)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
        rise, _ = _peak_rise(_allocation_events(prof.profiler.kineto_results, device), {})
        return max(0, rise - _outputs_bytes(out))
    except Exception as err:  # a kernel this device cannot run with these inputs: no estimate
        log.debug("fxmem: could not probe %s: %s", node.target, err)
        return 0
