"""The plan: what was decided for one compiled graph, and why, in a form a person can read."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field

__all__ = ["Decision", "Plan", "format_bytes"]

SCHEMA_VERSION = 6
_COMPACT_KEYS = ("timeline", "graph", "saved_nodes", "measured")
# version 1 lacks timeline, graph, fingerprint and saved_nodes; version 2 second_recomputation;
# version 3 copies_time_s; version 4 backward_copies; version 6 keep_outputs
_READABLE_VERSIONS = (1, 2, 3, 4, 5, 6)
# A floor is the budget for the lowest predicted peak plus this much: room for the few small
# tensors a retry at it may find alive besides (a loss the caller kept, an optimizer's step
# counters). A budget is refused only below the floor less it.
FLOOR_SLACK_BYTES = 16 * 2**10


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
    # Of added_time_s: the backward's own copies of cheap element-wise values (fxmem.again),
    # which no decision lists.
    copies_time_s: float = 0.0
    planning_s: float = 0.0
    compiler: str = "inductor"
    device: str = "cpu"
    graph_nodes: int = 0
    # Version 2. `timeline`: the predicted step, step by step ({"steps": [[node, phase]],
    # "static": {category: bytes}, "storages": [[id, node, category]], "events": [[step, id,
    # +/-bytes]]}, see `plan_record`); `graph`: the joint graph ({"nodes": [[name, op, phase,
    # type, [input indices], module, source]]}); `fingerprint`: what a saved plan must match to
    # be applied; `saved_nodes`: the forward values kept for the backward; `measured`: a
    # measured run of the planned step, when one was attached ({"peak_bytes", "curve"}).
    timeline: dict = field(default_factory=dict, repr=False)
    graph: dict = field(default_factory=dict, repr=False)
    fingerprint: dict = field(default_factory=dict)
    saved_nodes: list[str] = field(default_factory=list, repr=False)
    measured: dict = field(default_factory=dict, repr=False)
    # Parameter names that are one tensor (counted once), and groups of separate parameters
    # with equal shapes and values that `tie_weights=True` would tie.
    tied_weights: list[list[str]] = field(default_factory=list)
    tie_candidates: list[list[str]] = field(default_factory=list)
    # Saved values the backward computes a second time from earlier saved ones, by node name
    # ({"dropped", "chain", "downstream"}; see `again.SecondRecomputation`); empty when none.
    second_recomputation: dict = field(default_factory=dict, repr=False)
    # Slices of the batch each block in rewrites["microbatch_blocks"] runs over (1: not sliced).
    batch_slices: int = 1
    # False: planned on the graph without the backward's copies of cheap values (fxmem.again),
    # the budget being below the floor with them.
    backward_copies: bool = True
    # False: planned for a caller that lets what the step returns go before the backward;
    # [position among the step's outputs, storage, bytes] of each output freed at the forward's
    # end so (the premise each call checks: `fxmem.outputs.watch_outputs`).
    keep_outputs: bool = True
    released_outputs: list[list[int]] = field(default_factory=list, repr=False)

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

    def to_json(self) -> str:
        """plan.json's text: indented, with the long per-node records one line each."""
        parts = []
        for key, value in self.to_dict().items():
            if key in _COMPACT_KEYS:
                text = json.dumps(value, separators=(",", ":"))
            else:
                text = json.dumps(value, indent=1).replace("\n", "\n ")
            parts.append(f" {json.dumps(key)}: {text}")
        return "{\n" + ",\n".join(parts) + "\n}\n"

    def _copies_part(self) -> str:
        if self.copies_time_s <= 0:
            return ""
        return f", {self.copies_time_s * 1e3:.1f} ms of it for backward copies of cheap values"

    def summary(self, top: int = 10) -> str:
        budget = format_bytes(self.budget_bytes) if self.budget_bytes is not None else "none"
        if self.budget_bytes is not None and self.floor_bytes - FLOOR_SLACK_BYTES > self.budget_bytes:
            budget += (
                f", below the floor ({format_bytes(self.floor_bytes)}): refused; this plan, the smallest found, "
                "does not fit it"
            )
        lines = [
            f"fxmem plan ({self.compiler}, {self.device}, {self.graph_nodes} joint nodes, "
            f"planned in {self.planning_s:.2f} s)",
            f"  budget           {budget}",
            f"  predicted peak   {format_bytes(self.predicted_peak_bytes)}",
            f"  floor            {format_bytes(self.floor_bytes)} (the smallest budget it can be planned for)",
            f"  unconstrained    {format_bytes(self.unconstrained_peak_bytes)}",
            f"  decisions        {len(self.saved)} tensors saved, {len(self.recomputed)} recomputed "
            f"(+{self.added_time_s * 1e3:.1f} ms estimated{self._copies_part()})",
            "  at the peak:",
        ]
        lines += [f"    {k:<16} {format_bytes(v)}" for k, v in self.breakdown.items()]
        if self.second_recomputation:
            dropped = self.second_recomputation["dropped"]
            lines.append(
                f"  computed twice:  {len(dropped)} saved values made again in backward from earlier saved ones "
                f"({len(self.second_recomputation['chain'])} ops run a second time)"
            )
        if not self.keep_outputs:
            lines.append(
                "  outputs:         counted until the forward ends (keep_outputs=False: the caller keeps the loss)"
            )
        if not self.backward_copies:
            lines.append("  backward copies: none (below the floor with them, the backward reads saved values)")
        if self.rewrites:
            lines.append("  rewrites: " + ", ".join(f"{k} x{v}" for k, v in self.rewrites.items()))
        if self.batch_slices > 1:
            lines.append(
                f"  batch slices:    {self.rewrites.get('microbatch_blocks', 0)} blocks run over "
                f"{self.batch_slices} slices of the batch each"
            )
        biggest = sorted(self.decisions, key=lambda d: -d.nbytes)[:top]
        if biggest:
            lines.append(f"  largest candidates (of {len(self.decisions)}):")
            for d in biggest:
                where = d.module or d.source
                lines.append(f"    {d.action:<9} {format_bytes(d.nbytes):>10}  {d.op:<28} {where}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.summary()

    def save(self, directory: str | os.PathLike, files: bool = True) -> str:
        """Write `plan.json` into `directory` (created if needed); returns its path.

        With `files` (the default) also `timeline.png`, `graph.dot` (and `graph.svg` when
        Graphviz is installed) and `memory_snapshot.pickle`, which PyTorch's memory viewer
        (https://pytorch.org/memory_viz) opens; see `fxmem.plan_files`.
        """
        os.makedirs(directory, exist_ok=True)
        path = os.path.join(os.fspath(directory), "plan.json")
        with open(path, "w") as f:
            f.write(self.to_json())
        if files:
            from fxmem.plan_files import write_plan_files

            write_plan_files(self, directory)
        return path

    @classmethod
    def load(cls, path: str | os.PathLike) -> Plan:
        with open(path) as f:
            data = json.load(f)
        version = data.pop("schema_version", None)
        if version not in _READABLE_VERSIONS:
            raise ValueError(f"{path}: plan schema version {version}, this fxmem reads {_READABLE_VERSIONS}")
        data["decisions"] = [Decision(**d) for d in data["decisions"]]
        return cls(**data)
