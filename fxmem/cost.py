"""How long running a node again costs.

Compute-bound ops (those torch's flop counter knows: matmuls, convolutions, attention) cost
their flops over the device's matmul rate; everything else costs the bytes it reads and
writes over memory bandwidth; views cost nothing. The two rates are measured on the device
the graph runs on, so the planner's trade-offs follow the machine.

A plan must be a function of the graph and the budget alone, yet timings wobble from run to
run (by 20% on a busy CPU), and a plan ranks its candidates by bytes per second of added
time: a wobble reorders near-ties and the same budget recomputed 96 values in one run and 100
in the next. So the rates are snapped to a grid of half-octaves and kept, per machine, device
and torch version, in a small JSON file (`$FXMEM_CACHE_DIR`, else `~/.cache/fxmem`): the first
process on a machine measures them, every later one plans with the same numbers.
"""

from __future__ import annotations

import functools
import json
import math
import operator
import os
import platform
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.fx as fx
from torch.utils.flop_counter import flop_registry

from fxmem import _torch_private as tp

__all__ = ["CostModel", "DeviceRates", "measure_rates"]

_PER_OP_OVERHEAD_S = 2e-6  # launch/dispatch floor for any op that does work


@dataclass(frozen=True)
class DeviceRates:
    flops_per_s: float
    bytes_per_s: float


@functools.cache
def measure_rates(device: str) -> DeviceRates:
    """Matmul flop rate and copy bandwidth of `device`: timed once per machine, then cached."""
    path = _cache_dir() / "device_rates.json"
    key = f"{_device_name(device)} | torch {torch.__version__}"
    table = _read_table(path)
    try:
        return DeviceRates(float(table[key]["flops_per_s"]), float(table[key]["bytes_per_s"]))
    except (KeyError, TypeError, ValueError):
        pass
    rates = _snap(_time_rates(device))
    table[key] = {"flops_per_s": rates.flops_per_s, "bytes_per_s": rates.bytes_per_s}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".tmp") as f:
            json.dump(table, f, indent=1, sort_keys=True)
        os.replace(f.name, path)  # atomic: a concurrent reader sees the old file or the new one
    except OSError:
        pass  # a read-only home: the snapped rates still keep small wobbles out of the plan
    return rates


def _read_table(path: Path) -> dict:
    try:
        table = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return table if isinstance(table, dict) else {}


def _cache_dir() -> Path:
    return Path(os.environ.get("FXMEM_CACHE_DIR") or Path.home() / ".cache" / "fxmem")


def _device_name(device: str) -> str:
    dev = torch.device(device)
    if dev.type == "cuda":
        return f"cuda {torch.cuda.get_device_name(dev)}"
    return f"{dev.type} {platform.machine()} {platform.processor() or platform.node()} x{os.cpu_count()}"


def _snap(rates: DeviceRates) -> DeviceRates:
    """Round each rate to the nearest half-octave (a factor of sqrt 2)."""

    def snap(x: float) -> float:
        return 2.0 ** (round(2 * math.log2(x)) / 2)

    return DeviceRates(flops_per_s=snap(rates.flops_per_s), bytes_per_s=snap(rates.bytes_per_s))


def _time_rates(device: str) -> DeviceRates:
    """Matmul flop rate and copy bandwidth of `device`, timed now (median of a few runs)."""
    with tp.real_tensors():  # planning runs inside fake-tensor tracing, where ops take no time
        return _time_rates_real(torch.device(device))


def _time_rates_real(dev: torch.device) -> DeviceRates:
    # Sizes that keep the device busy for well over a timer tick, and small beside the memory
    # a user plans for: on CUDA 176 MiB at once, freed before the step (it runs while planning,
    # the first time a device is seen; the rates are cached).
    n = 512 if dev.type == "cpu" else 2048
    a = torch.randn(n, n, device=dev)
    b = torch.randn(n, n, device=dev)
    big = torch.randn(8 * 2**20 if dev.type == "cpu" else 16 * 2**20, device=dev)

    def timed(fn, reps=5):
        fn()
        times = []
        for _ in range(reps):
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            t0 = time.perf_counter()
            fn()
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            times.append(time.perf_counter() - t0)
        return sorted(times)[len(times) // 2]

    copies = 4  # one at a time: a clone is freed before the next

    def copy() -> None:
        for _ in range(copies):
            big.clone()

    mm_s = timed(lambda: a @ b)
    copy_s = timed(copy)
    return DeviceRates(flops_per_s=2 * n**3 / mm_s, bytes_per_s=copies * 2 * big.nbytes / copy_s)


def tensor_bytes(x: object) -> int:
    """Bytes of a tensor's elements (of every tensor in a list or tuple; 0 for anything else)."""
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(tensor_bytes(y) for y in x)
    return 0


def _is_view(node: fx.Node) -> bool:
    if node.target is operator.getitem:
        return True
    schema = getattr(node.target, "_schema", None)
    if schema is None or not schema.returns:
        return False
    alias = schema.returns[0].alias_info
    return alias is not None and not alias.is_write


class CostModel:
    """Seconds to run one fx node, from its fake values' shapes."""

    def __init__(self, rates: DeviceRates):
        self.rates = rates

    def flops(self, node: fx.Node) -> int:
        packet = getattr(node.target, "overloadpacket", None)
        fn = flop_registry.get(packet)
        if fn is None:
            return 0
        args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda a: a.meta.get("val"))
        try:
            return int(fn(*args, **kwargs, out_val=node.meta.get("val")))
        except Exception:  # unusual signatures: fall back to the bandwidth estimate
            return 0

    def node_seconds(self, node: fx.Node) -> float:
        if node.op != "call_function" or _is_view(node):
            return 0.0
        moved = tensor_bytes(node.meta.get("val")) + sum(tensor_bytes(a.meta.get("val")) for a in node.all_input_nodes)
        flops = self.flops(node)
        return _PER_OP_OVERHEAD_S + max(flops / self.rates.flops_per_s, moved / self.rates.bytes_per_s)
