"""The plan: what was decided for one compiled graph, and why, in a form a person can read."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field

__all__ = ["Decision", "Plan", "format_bytes"]

SCHEMA_VERSION = 1


def format_bytes(n: float) -> str:
    """Bytes in binary units: '241.3 MiB', '1.20 GiB'."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}" if unit == "GiB" else f"{n / scale:.1f} {unit}"
    return f"{int(n)} B"


@dataclass
class Decision:
    name: str  # node name in the joint graph
    nbytes: int
    action: str  # "save" | "recompute"
    cost_s: float  # estimated added time of this decision
    op: str = ""
    module: str = ""
    source: str = ""
    reason: str = ""


@dataclass
class Plan:
    budget_bytes: int | None
    predicted_peak_bytes: int
    floor_bytes: int
    unconstrained_peak_bytes: int
    breakdown: dict[str, int]  # bytes per category at the predicted peak
    decisions: list[Decision]
    rewrites: dict[str, int] = field(default_factory=dict)
    saved_bytes: int = 0  # activations kept from the forward for the backward (unique storages)
    added_time_s: float = 0.0
    planning_s: float = 0.0
    compiler: str = "inductor"
    device: str = "cpu"
    graph_nodes: int = 0

    @property
    def saved(self) -> list[Decision]:
        return [d for d in self.decisions if d.action == "save"]

    @property
    def recomputed(self) -> list[Decision]:
        return [d for d in self.decisions if d.action == "recompute"]

    def to_dict(self) -> dict:
        out = asdict(self)
        out["schema_version"] = SCHEMA_VERSION
        return out

    def summary(self, top: int = 10) -> str:
        budget = format_bytes(self.budget_bytes) if self.budget_bytes is not None else "none"
        lines = [
            f"fxmem plan ({self.compiler}, {self.device}, {self.graph_nodes} joint nodes, "
            f"planned in {self.planning_s:.2f} s)",
            f"  budget           {budget}",
            f"  predicted peak   {format_bytes(self.predicted_peak_bytes)}",
            f"  floor            {format_bytes(self.floor_bytes)}",
            f"  unconstrained    {format_bytes(self.unconstrained_peak_bytes)}",
            f"  decisions        {len(self.saved)} tensors saved, {len(self.recomputed)} recomputed "
            f"(+{self.added_time_s * 1e3:.1f} ms estimated)",
            "  at the peak:",
        ]
        lines += [f"    {k:<16} {format_bytes(v)}" for k, v in self.breakdown.items()]
        if self.rewrites:
            lines.append("  rewrites: " + ", ".join(f"{k} x{v}" for k, v in self.rewrites.items()))
        biggest = sorted(self.decisions, key=lambda d: -d.nbytes)[:top]
        if biggest:
            lines.append(f"  largest candidates (of {len(self.decisions)}):")
            for d in biggest:
                where = d.module or d.source
                lines.append(f"    {d.action:<9} {format_bytes(d.nbytes):>10}  {d.op:<28} {where}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.summary()

    def save(self, directory: str | os.PathLike) -> str:
        """Write `plan.json` into `directory` (created if needed); returns its path."""
        os.makedirs(directory, exist_ok=True)
        path = os.path.join(os.fspath(directory), "plan.json")
        with open(path, "w") as f:
            json.dump(self.to_dict(), f, indent=1)
        return path

    @classmethod
    def load(cls, path: str | os.PathLike) -> Plan:
        with open(path) as f:
            data = json.load(f)
        version = data.pop("schema_version", None)
        if version != SCHEMA_VERSION:
            raise ValueError(f"{path}: plan schema version {version}, this fxmem reads {SCHEMA_VERSION}")
        data["decisions"] = [Decision(**d) for d in data["decisions"]]
        return cls(**data)
