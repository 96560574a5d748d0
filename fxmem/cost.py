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


_kept: dict[str, DeviceRates] = {}  # per process: device -> the rates every plan on it uses


def measure_rates(device: str, room_bytes: int | None = None) -> DeviceRates:
    """Matmul flop rate and copy bandwidth of `device`: timed once per machine, then cached.

    Timing allocates tensors while the first step is planned, and so inside that step: up to
    `_timing_bytes` at once (66 MiB on a CPU, 160 MiB on CUDA), enough to time the copies
    through memory rather than a cache. Where a budget leaves less room than that beside what
    is alive (`room_bytes`), the rates are timed on tensors that fit it and used for that plan
    alone, neither kept nor written down: a later plan with room times them in full. A budget
    below what is alive (negative room) is refused before anything runs: timed in full then,
    so that the floor the refusal names is planned with the rates later plans use."""
    rates = _kept.get(device)
    if rates is not None:
        return rates
    path = _cache_dir() / "device_rates.json"
    key = f"{_device_name(device)} | torch {torch.__version__}"
    table = _read_table(path)
    try:
        rates = _kept[device] = DeviceRates(float(table[key]["flops_per_s"]), float(table[key]["bytes_per_s"]))
        return rates
    except (KeyError, TypeError, ValueError):
        pass
    full = _timing_bytes(torch.device(device))
    if room_bytes is not None and 0 <= room_bytes < full:
        return _snap(_time_rates(device, room_bytes / full))
    rates = _kept[device] = _snap(_time_rates(device))
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


def _timing_sizes(dev: torch.device, scale: float = 1.0) -> tuple[int, int]:
    """The side of the square matrices timed and the elements of the buffer copied, at `scale`
    of the full sizes: those keep the device busy for well over a timer tick, and copy
    through memory rather than a cache (a CPU's L3, an H100's 50 MB L2). Smaller ones time
    what fits `scale` of the memory, the copies partly in a cache."""
    n, elements = (512, 8 * 2**20) if dev.type == "cpu" else (2048, 16 * 2**20)
    scale = min(scale, 1.0)
    return max(16, int(n * math.sqrt(scale)) // 16 * 16), max(4096, int(elements * scale) // 4096 * 4096)


def _timing_bytes(dev: torch.device, scale: float = 1.0) -> int:
    """The most bytes alive at once while the rates are timed (fp32): the two matrices and the
    buffer throughout, beside the matrices' product or one copy of the buffer."""
    n, elements = _timing_sizes(dev, scale)
    return 4 * (2 * n * n + elements + max(n * n, elements))


def _time_rates(device: str, scale: float = 1.0) -> DeviceRates:
    """Matmul flop rate and copy bandwidth of `device`, timed now (median of a few runs), on
    tensors of `scale` of the full sizes (see `_timing_sizes`)."""
    with tp.real_tensors():  # planning runs inside fake-tensor tracing, where ops take no time
        return _time_rates_real(torch.device(device), scale)


def _time_rates_real(dev: torch.device, scale: float) -> DeviceRates:
    n, elements = _timing_sizes(dev, scale)
    a = torch.randn(n, n, device=dev)
    b = torch.randn(n, n, device=dev)
    big = torch.randn(elements, device=dev)

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
