"""The plan a partition records: the state the planner chose, turned into a `Plan` (breakdown
at the predicted peak, one decision per candidate value with its reason and cost, the
outputs let go early, the values computed a second time)."""

from __future__ import annotations

import operator
from dataclasses import asdict
from typing import TYPE_CHECKING

import torch
import torch.fx as fx

from fxmem.again import COPY_OF, SECOND, SecondRecomputation
from fxmem.cost import DeviceRates, tensor_bytes
from fxmem.graph import FWD, JointGraph
from fxmem.nodes import module_path, source_line
from fxmem.plan import Decision, Plan
from fxmem.plan_record import fingerprint, graph_record, timeline_record
from fxmem.planner import Choice, Trajectory
from fxmem.simulate import Timeline, simulate

if TYPE_CHECKING:
    from fxmem.partition import PlanRequest

__all__ = ["make_plan"]


def _breakdown(req: PlanRequest, jg: JointGraph, trajectory: Trajectory, choice: Choice) -> dict[str, int]:
    """Bytes per category at the predicted peak; they sum to the plan's prediction."""
    grads = {jg.storage[i] for i in jg.bwd_outputs}
    out = dict(req.static_bytes)
    if req.optimizer_bytes:
        out["optimizer"] = req.optimizer_bytes
    if trajectory.floor_bytes > choice.timeline.peak_bytes:  # the peak is the optimizer step
        out["gradients"] = trajectory.floor_bytes - req.optimizer_step_bytes
        out["optimizer step temporaries"] = req.optimizer_step_bytes
        return out
    tl = simulate(jg, choice.saved, snapshot_at=choice.timeline.peak_pos)
    recomputed = {jg.storage[i] for i in tl.recomputed}
    cats = {"saved activations": 0, "recomputed": 0, "gradients": 0, "temporaries": 0}
    for s, nbytes in tl.alive_at_snapshot.items():
        if s in tl.saved_interval:
            cats["saved activations"] += nbytes
        elif s in grads:
            cats["gradients"] += nbytes
        elif s in recomputed:
            cats["recomputed"] += nbytes
        else:
            cats["temporaries"] += nbytes
    # what the op at the peak allocates inside itself (a library call's workspace)
    cats["temporaries"] += tl.curve[tl.peak_pos] - sum(tl.alive_at_snapshot.values())
    out.update(cats)
    return out


def make_plan(
    req: PlanRequest,
    jg: JointGraph,
    trajectory: Trajectory,
    choice: Choice,
    floor_bytes: int,
    planning_s: float,
    second: SecondRecomputation | None,
    rates: DeviceRates,
    backward_copies: bool = True,
) -> Plan:
    tl = choice.timeline
    copies = [i for i, node in enumerate(jg.nodes) if COPY_OF in node.meta]
    second_s = sum(jg.cost_s[i] for i in copies if SECOND in jg.nodes[i].meta)
    cheap = [i for i in copies if SECOND not in jg.nodes[i].meta]
    copies_s = _fused_seconds(jg, cheap, rates.bytes_per_s) if cheap else 0.0
    recomputed = set(tl.recomputed)
    candidates = sorted(set(jg.boundary()) | recomputed | {i for i, s in enumerate(choice.saved) if s})
    decisions = []
    costed: set[fx.Node] = set()  # multi-output ops whose cost a decision already carries
    for i in candidates:
        node = jg.nodes[i]
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor) or jg.kind[i] != FWD:
            continue
        # An output of a multi-output op (attention's): the op is what runs again.
        op = node.args[0] if node.target is operator.getitem and isinstance(node.args[0], fx.Node) else node
        cost_s = 0.0
        if i in recomputed:
            action, reason = "recompute", "recomputed in backward to lower the peak"
            if op is node:
                cost_s = jg.cost_s[i]
            elif op not in costed and jg.index.get(op) in recomputed:
                costed.add(op)
                cost_s = jg.cost_s[jg.index[op]]
        elif jg.banned[i]:
            action, reason = "save", "must run once (random or side effect)"
        elif jg.storage[i] in jg.kept_to_end:
            action, reason = "save", "returned by the step: alive through the backward anyway"
        else:
            action, reason = "save", "read by backward; fits the budget"
        decisions.append(
            Decision(
                name=node.name,
                nbytes=tensor_bytes(val),
                action=action,
                cost_s=cost_s,
                op=str(op.target),
                module=module_path(node),
                source=source_line(node),
                reason=reason,
            )
        )
    if second is not None:
        decisions += _second_decisions(jg, second, copies)
    reserved = req.reserved_bytes()
    graph = graph_record(jg)
    static = dict(req.static_bytes)
    if req.optimizer_bytes:
        static["optimizer state"] = req.optimizer_bytes
    return Plan(
        budget_bytes=req.budget_bytes,
        predicted_peak_bytes=reserved + trajectory.peak(choice),
        floor_bytes=floor_bytes,
        unconstrained_peak_bytes=reserved + trajectory.peak(trajectory.unconstrained),
        breakdown=_breakdown(req, jg, trajectory, choice),
        decisions=decisions,
        rewrites=dict(req.rewrites),
        saved_bytes=sum(jg.storage_bytes[s] for s in tl.saved_interval),
        added_time_s=tl.recompute_s + second_s + copies_s,
        copies_time_s=copies_s,
        planning_s=planning_s,
        compiler=req.compiler,
        device=str(req.device),
        graph_nodes=len(jg.nodes),
        timeline=timeline_record(jg, choice, static, req.optimizer_step_bytes),
        graph=graph,
        fingerprint=fingerprint(graph),
        saved_nodes=[jg.nodes[i].name for i, s in enumerate(choice.saved) if s],
        second_recomputation=asdict(second) if second is not None else {},
        batch_slices=req.batch_slices,
        backward_copies=backward_copies,
        keep_outputs=req.keep_outputs,
        released_outputs=_released_outputs(jg, tl),
    )


def _released_outputs(jg: JointGraph, tl: Timeline) -> list[list[int]]:
    """[position among the step's outputs, storage, bytes] of each output the plan frees at the
    forward's end, the caller letting it go (`keep_outputs=False`): not saved for the backward."""
    return sorted(
        [pos, jg.storage[i], jg.storage_bytes[jg.storage[i]]]
        for i, pos in jg.released_outputs.items()
        if jg.storage[i] in tl.released
    )


def _fused_seconds(jg: JointGraph, nodes: list[int], bytes_per_s: float) -> float:
    """Time of element-wise `nodes` that a fusing compiler generates into the kernels that read
    them (the backward copies of cheap values): what they read from outside once, and what
    they must write out (a library call's input); not each op's reads and writes, which would
    count the values passed between them inside a kernel."""
    inside = set(nodes)
    moved = {jg.storage[j] for i in nodes for j in jg.inputs[i] if j not in inside and jg.storage[j] >= 0}
    moved |= {jg.storage[i] for i in nodes if jg.storage[i] >= 0 and jg.materialized[jg.storage[i]]}
    return sum(jg.storage_bytes[s] for s in moved) / bytes_per_s


def _second_decisions(jg: JointGraph, second: SecondRecomputation, copies: list[int]) -> list[Decision]:
    """One decision per value the backward computes a second time, its cost the copies'."""
    index = {node.name: i for i, node in enumerate(jg.nodes)}
    # what the copies of the dropped values and of the ops between cost (not those downstream,
    # which stand in for values the backward would have recomputed anyway)
    downstream = set(second.downstream)
    cost_s = sum(
        jg.cost_s[i] for i in copies if SECOND in jg.nodes[i].meta and jg.nodes[i].meta[COPY_OF] not in downstream
    )
    out = []
    for name in second.dropped:
        node = jg.nodes[index[name]]
        val = node.meta["val"]
        out.append(
            Decision(
                name=name,
                nbytes=tensor_bytes(val),
                action="recompute",
                cost_s=cost_s / len(second.dropped),
                op=str(node.target),
                module=module_path(node),
                source=source_line(node),
                reason="computed again in backward from earlier saved values, the ops between run a second time",
            )
        )
    return out
