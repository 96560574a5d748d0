"""What a plan records about its joint graph and its predicted step, and the check that a
saved plan belongs to the graph it is applied to.

The records are plain JSON values (lists, dicts, strings, ints), so `plan.json` holds them
as they are and every file in `plan_files` is drawn from the plan alone:

* the graph: one row per joint node, ``[name, op, phase, type, [input indices], module, source]``;
* the timeline: the steps of the simulated training step in run order (``[node, phase]``),
  the bytes alive through all of it (``static``, by category), one row per allocation
  (``[node, category]``) and the allocator events (``[step, allocation, +/-bytes]``). An
  allocation is charged before its step's snapshot and freed after it, so the running sum of
  the events up to and including a step, plus the static bytes, is the predicted memory at
  that step, and its maximum is the plan's predicted peak.
"""

from __future__ import annotations

import hashlib

import torch

from fxmem.errors import PlanMismatchError
from fxmem.graph import BWD, FWD, PRIMAL, TANGENT, JointGraph
from fxmem.nodes import module_path, source_line
from fxmem.plan import Plan
from fxmem.planner import Choice, Trajectory
from fxmem.schedule import InfeasibleSave
from fxmem.simulate import simulate

__all__ = [
    "DYNAMIC_CATEGORIES",
    "alive_at_peak",
    "check_matches",
    "fingerprint",
    "graph_record",
    "reuse_trajectory",
    "timeline_record",
]

_PHASE = {PRIMAL: "input", TANGENT: "tangent", FWD: "fwd", BWD: "bwd"}
# Stacking order in pictures: what lives longest at the bottom.
DYNAMIC_CATEGORIES = ("gradients", "saved activations", "outputs", "recomputed", "temporaries")
OPTIMIZER_STEP = "optimizer.step"

_DTYPES = {
    torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16", torch.float64: "f64",
    torch.int64: "i64", torch.int32: "i32", torch.int8: "i8", torch.uint8: "u8", torch.bool: "b8",
}  # fmt: skip


def _type_of(val: object) -> str:
    """'f32[4, 256, 64]' for a tensor, a tuple of those for tuples, the type name otherwise."""
    if isinstance(val, torch.Tensor):
        return f"{_DTYPES.get(val.dtype, str(val.dtype))}[{', '.join(str(d) for d in val.shape)}]"
    if isinstance(val, (list, tuple)):
        return "(" + ", ".join(_type_of(v) for v in val) + ")"
    return "" if val is None else type(val).__name__


def _op_of(node: torch.fx.Node) -> str:
    if node.op == "call_function":
        return str(node.target)
    return node.op


def graph_record(jg: JointGraph) -> dict:
    rows = []
    for i, node in enumerate(jg.nodes):
        rows.append(
            [
                node.name,
                _op_of(node),
                _PHASE[jg.kind[i]],
                _type_of(node.meta.get("val")),
                list(jg.inputs[i]),
                module_path(node),
                source_line(node),
            ]
        )
    return {"nodes": rows}


def _signature(row: list) -> str:
    name, op, _, typ, inputs = row[:5]
    return f"{name} = {op}({', '.join(map(str, inputs))}) : {typ}"


def fingerprint(graph: dict) -> dict:
    """What two graphs must share for one's plan to apply to the other: the ordered ops, their
    inputs, dtypes and shapes (node count and a hash of those)."""
    text = "\n".join(_signature(row) for row in graph["nodes"])
    return {"nodes": len(graph["nodes"]), "sha256": hashlib.sha256(text.encode()).hexdigest()}


def check_matches(plan: Plan, graph: dict) -> None:
    """Raise PlanMismatchError, naming the first difference, unless `plan` was made for `graph`."""
    if not plan.fingerprint:
        raise PlanMismatchError("the saved plan records no graph fingerprint (plan.json schema version 1); plan again")
    if plan.fingerprint == fingerprint(graph):
        return
    old, new = plan.graph.get("nodes", []), graph["nodes"]
    msg = (
        f"the saved plan was made for a different graph: it has {plan.fingerprint['nodes']} joint nodes, "
        f"this graph has {len(new)}"
    )
    for i, (a, b) in enumerate(zip(old, new, strict=False)):
        if _signature(a) != _signature(b):
            msg += f"; first difference at node {i}: plan has `{_signature(a)}`, this graph has `{_signature(b)}`"
            if b[6]:
                msg += f" (from {b[6]})"
            break
    else:
        if len(old) == len(new):
            msg += "; the fingerprint differs but the recorded nodes agree (the plan file was edited?)"
        else:
            msg += f"; the first {min(len(old), len(new))} nodes agree"
    raise PlanMismatchError(msg + ". Plan again for this model and these inputs.")


def reuse_trajectory(plan: Plan, jg: JointGraph, graph: dict, floor_bytes: int) -> Trajectory:
    """A one-state trajectory holding the saved plan's decisions applied to `jg`."""
    check_matches(plan, graph)
    keep = set(plan.saved_nodes)
    saved = [node.name in keep for node in jg.nodes]
    try:
        tl = simulate(jg, saved)
    except InfeasibleSave as e:
        raise PlanMismatchError(
            f"the saved plan recomputes {jg.nodes[e.node_index].name}, which must run only once"
        ) from None
    return Trajectory(jg, [Choice(saved, tl)], floor_bytes)


def timeline_record(jg: JointGraph, choice: Choice, static: dict[str, int], optimizer_step_bytes: int = 0) -> dict:
    """The predicted step of `choice`, allocation by allocation (see the module docstring)."""
    tl = simulate(jg, choice.saved, record_events=True)
    grads = {jg.storage[i] for i in jg.bwd_outputs}
    outputs = {jg.storage[i] for i in jg.fwd_outputs}
    recomputed = set(tl.recomputed)
    steps = [[jg.nodes[i].name, kind] for i, kind in zip(tl.order, tl.kinds, strict=True)]
    allocations: list[list[str]] = []
    events: list[list[int]] = []
    current: dict[int, int] = {}  # storage -> its live allocation
    for t, sid, nbytes in tl.events or ():
        if nbytes == 0:
            continue  # computed inside a fused kernel, never written to memory
        if nbytes > 0:
            i = tl.order[t]
            if sid in tl.saved_interval:
                category = "saved activations"
            elif sid in grads:
                category = "gradients"
            elif sid in outputs:
                category = "outputs"
            elif i in recomputed:
                category = "recomputed"
            else:
                category = "temporaries"
            current[sid] = len(allocations)
            allocations.append([jg.nodes[i].name, category])
            events.append([t, current[sid], nbytes])
        else:
            events.append([t, current.pop(sid), nbytes])
    if optimizer_step_bytes:
        # Gradients stay for the optimizer step; whatever else the backward left is gone by then.
        end = len(steps) - 1
        for a in sorted(current.values()):
            if allocations[a][1] != "gradients":
                events.append([end, a, -_alloc_bytes(events, a)])
        t = len(steps)
        steps.append([OPTIMIZER_STEP, "optimizer"])
        allocations.append([OPTIMIZER_STEP, "temporaries"])
        events.append([t, len(allocations) - 1, optimizer_step_bytes])
        events.append([t, len(allocations) - 1, -optimizer_step_bytes])
    return {"steps": steps, "static": dict(static), "allocations": allocations, "events": events}


def _alloc_bytes(events: list[list[int]], allocation: int) -> int:
    return next(b for _, a, b in events if a == allocation and b > 0)


def category_curves(timeline: dict) -> dict[str, list[int]]:
    """Bytes alive at each step, per dynamic category (static bytes not included)."""
    n = len(timeline["steps"])
    curves = {c: [0] * n for c in DYNAMIC_CATEGORIES}
    delta_now = {c: [0] * n for c in DYNAMIC_CATEGORIES}  # charged before the step's snapshot
    delta_next = {c: [0] * (n + 1) for c in DYNAMIC_CATEGORIES}  # freed after it
    for t, a, nbytes in timeline["events"]:
        cat = timeline["allocations"][a][1]
        if nbytes > 0:
            delta_now[cat][t] += nbytes
        else:
            delta_next[cat][t + 1] += nbytes
    for cat in DYNAMIC_CATEGORIES:
        running = 0
        for t in range(n):
            running += delta_now[cat][t] + delta_next[cat][t]
            curves[cat][t] = running
    return {c: v for c, v in curves.items() if any(v)}


def total_curve(timeline: dict) -> list[int]:
    """Predicted bytes in use at each step, static bytes included."""
    static = sum(timeline["static"].values())
    curves = category_curves(timeline)
    return [static + sum(c[t] for c in curves.values()) for t in range(len(timeline["steps"]))]


def alive_at_peak(timeline: dict) -> tuple[int, int, list[tuple[str, str, int]]]:
    """Where the predicted step peaks: the step (the first, where several tie; -1 for a
    timeline without steps), the dynamic bytes alive there, and those allocations as (node,
    category, bytes), largest first."""
    if not timeline.get("steps"):
        return -1, 0, []
    curve = total_curve(timeline)
    at = curve.index(max(curve))
    live: dict[int, int] = {}
    for t, a, nbytes in timeline["events"]:  # charged before a step's snapshot, freed after it
        if nbytes > 0 and t <= at:
            live[a] = nbytes
        elif nbytes < 0 and t < at:
            live.pop(a, None)
    rows = [(*timeline["allocations"][a], nbytes) for a, nbytes in live.items()]
    return at, sum(live.values()), sorted(rows, key=lambda r: -r[2])
