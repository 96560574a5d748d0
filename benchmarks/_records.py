"""What the benchmark harness measures: its options, one configuration's numbers, one model's result."""

from __future__ import annotations

import contextlib
import datetime
import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from benchmarks._models import Batch, ModelSpec

__all__ = ["GiB", "MiB", "MIN_ROUNDS", "SEED", "UNCONSTRAINED_GB", "Config", "Options", "Result", "machine_line"]

MiB = 2**20
GiB = 2**30
UNCONSTRAINED_GB = 1024.0
SEED = 1234
MIN_ROUNDS = 2  # timed rounds run however late: gradients on the first, peaks on the last


@dataclass
class Options:
    device: str = "cpu"
    steps: int = 5
    amb_values: tuple[float, ...] = (0.5, 0.1)
    fxmem_points: int = 2  # budgeted fxmem points besides "unconstrained", floor included
    eager_fractions: tuple[float, ...] = (0.6,)  # also fxmem at these fractions of eager's measured peak
    remat_only: bool = True  # also fxmem with passes=(): rematerialisation alone
    sliced: bool = True  # also fxmem with compiler="eager" + microbatch_blocks, at its floor
    # time.perf_counter() past which no further configuration starts, and the timed rounds end
    # (after MIN_ROUNDS of them)
    deadline: float | None = None

    def out_of_time(self) -> bool:
        return self.deadline is not None and time.perf_counter() > self.deadline


@dataclass
class Config:
    """One way to run a training step, and what was measured for it."""

    name: str
    kind: str  # eager | ckpt | offload | compile | amb | fxmem | fxmem-remat | fxmem-sliced
    call: Callable[[Batch], Any] | None = None  # batch -> model output
    context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
    budget_bytes: int | None = None  # fxmem only; None: unconstrained
    fxmem_module: Any = None
    amb: float | None = None
    # measured
    first_s: float | None = None
    planning_s: float | None = None
    plan_floor_bytes: int | None = None
    predicted_peak_bytes: int | None = None
    peaks: list[int] = field(default_factory=list)
    entries: list[int] = field(default_factory=list)
    times: list[float] = field(default_factory=list)
    profiled_times: list[float] = field(default_factory=list)
    grad_err: float | None = None
    grad_ref: str | None = None
    rewrites: dict[str, int] = field(default_factory=dict)
    error: str | None = None
    na: str | None = None  # not applicable on this device, and why
    notes: list[str] = field(default_factory=list)

    @property
    def family(self) -> str:
        """Configurations of one family draw dropout masks from the same random stream.

        Eager and checkpointing (which replays the RNG state) share eager's; compiled code
        draws masks its own way (inductor's seeds; fxmem's `rand_like > p`), and fxmem's
        passes change which ops draw, so each of those is compared within its own family.
        Under activation_memory_budget inductor partitions and fuses differently and hands its
        random ops other seeds: with dropout those configurations have no reference (`amb`).
        """
        return {"ckpt": "eager", "offload": "eager"}.get(self.kind, self.kind)

    @property
    def ok(self) -> bool:
        return self.error is None and self.na is None and bool(self.peaks)

    @property
    def peak_bytes(self) -> int | None:
        return max(self.peaks) if self.peaks else None

    @property
    def step_s(self) -> float | None:
        return statistics.median(self.times) if self.times else None

    @property
    def over_budget(self) -> bool:
        return self.budget_bytes is not None and self.ok and self.peak_bytes > self.budget_bytes

    @property
    def is_anchor(self) -> bool:
        return self.kind in ("eager", "ckpt", "offload", "compile", "amb")


@dataclass
class Result:
    spec: ModelSpec
    size_label: str
    configs: list[Config]
    wall_s: float = 0.0
    fxmem_floor_bytes: int | None = None  # the planner's floor, default passes
    cut_short: list[str] = field(default_factory=list)  # configurations the time limit left out
    rounds: int = 0  # timed rounds run: Options.steps, or fewer where the time limit ended them
    rounds_wanted: int = 0

    def anchors(self) -> list[Config]:
        return [c for c in self.configs if c.is_anchor and c.ok]

    def fxmem(self, kind: str = "fxmem") -> list[Config]:
        return [c for c in self.configs if c.kind == kind and c.ok]


def machine_line(device: str) -> str:
    cpu = ""
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "")
    except OSError:
        pass
    cpu = cpu or platform.processor() or platform.machine()
    parts = [f"CPU {cpu}, {os.cpu_count()} cores (torch threads {torch.get_num_threads()})"]
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        parts.insert(0, f"GPU {props.name} ({props.total_memory / GiB:.0f} GiB), CUDA {torch.version.cuda}")
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    if hasattr(os, "getloadavg"):
        parts.append(f"load average {os.getloadavg()[0]:.1f} at start")
    return (
        f"{'; '.join(parts)}; {platform.system()} {platform.release()}; torch {torch.__version__}; "
        f"python {platform.python_version()}; {now}"
    )
