"""AOTAutograd's `partition_fn`: plan the joint graph against the budget, then emit it.

Deciding is separate from doing: `JointGraph` + `plan_trajectory` produce a `Choice` (which
forward values are saved); `emit.emit_graphs` only applies it.

In order: clones that only copy are dropped (`cleanup`); late readers get backward copies of
cheap values (`again.add_backward_copies`); the graph is planned; a second graph, where the
backward also rebuilds some saved values from earlier ones, is planned beside it, and is used
only for budgets the first cannot reach (`_second_recomputation`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx

from fxmem import _torch_private as tp
from fxmem.again import (
    SecondRecomputation,
    add_backward_copies,
    apply_second_recomputation,
    plan_second_recomputation,
)
from fxmem.cleanup import (
    copy_conv_inputs_channels_last,
    copy_expanded_attention_inputs,
    copy_views_of_channels_last,
    merge_repeated_values,
    realize_running_sums,
    remove_redundant_clones,
)
from fxmem.cost import CostModel, measure_rates
from fxmem.emit import emit_graphs
from fxmem.errors import BudgetError, PlanMismatchError
from fxmem.graph import JointGraph
from fxmem.opaque import seeds_from_buffers
from fxmem.own_stack import on_callers_thread, on_own_stack, stop_if_abandoned
from fxmem.parts import split_element_wise_by_chunk
from fxmem.plan import FLOOR_SLACK_BYTES, Plan, format_bytes
from fxmem.plan_make import make_plan
from fxmem.plan_record import graph_record, reuse_trajectory
from fxmem.planner import Trajectory, plan_trajectory

__all__ = ["PlanRequest", "budget_for", "make_partition_fn", "margin_for"]

log = logging.getLogger("fxmem")

# Saved values smaller than this share of the smallest plan's peak are not worth computing a
# second time (a LayerNorm's statistics, beside the residuals they normalise).
_SECOND_MIN_SHARE = 64
# A second recomputation is planned only when it lowers the floor by this share at least: it
# runs whole attentions again, for the memory the residuals they rebuild take.
_SECOND_MIN_GAIN = 0.04
# Head-room kept between the predicted peak and the budget, by default: a share of the budget
# and a fixed amount.
_MARGIN_FRACTION = 0.03
_MARGIN_BYTES = 2 * 2**20


def budget_for(
    predicted_bytes: int, margin_bytes: int = _MARGIN_BYTES, margin_fraction: float = _MARGIN_FRACTION
) -> int:
    """The smallest budget whose limit, less the head-room, admits a predicted peak of
    `predicted_bytes` (what is reserved and the simulated peak together)."""
    return int((predicted_bytes + margin_bytes) / (1.0 - margin_fraction)) + 1


def margin_for(
    budget_bytes: int | None, margin_bytes: int = _MARGIN_BYTES, margin_fraction: float = _MARGIN_FRACTION
) -> int:
    """Head-room kept between the predicted peak and `budget_bytes`."""
    return margin_bytes + int(margin_fraction * (budget_bytes or 0))


@dataclass
class PlanRequest:
    """What one compiled graph is planned against, gathered by the backend at capture time."""

    budget_bytes: int | None
    device: torch.device
    static_bytes: dict[str, int]  # alive at step entry, by category (parameters, inputs, other)
    optimizer_bytes: int = 0  # optimizer state not yet allocated
    optimizer_step_bytes: int = 0  # temporaries of the optimizer step, beside all gradients
    compiler: str = "inductor"
    margin_fraction: float = _MARGIN_FRACTION
    margin_bytes: int = _MARGIN_BYTES
    rewrites: dict[str, int] = field(default_factory=dict)
    batch_slices: int = 1  # slices of the batch the sliced blocks run over
    # False: the caller lets what the step returns go before the backward (it keeps the loss)
    keep_outputs: bool = True
    on_plan: Callable[[Plan], None] | None = None
    reuse: Plan | None = None  # apply this saved plan's decisions instead of planning

    def reserved_bytes(self) -> int:
        """Bytes alive through the whole step that no plan changes."""
        return sum(self.static_bytes.values()) + self.optimizer_bytes

    def budget_for(self, peak_bytes: int) -> int:
        """The smallest budget whose limit admits a simulated peak of `peak_bytes`."""
        return budget_for(self.reserved_bytes() + peak_bytes, self.margin_bytes, self.margin_fraction)

    def floor_for(self, peak_bytes: int) -> int:
        """The budget a refusal names for a simulated peak of `peak_bytes`: `budget_for`'s, with
        room for the few small tensors a retry at it may find alive besides (a loss the caller
        kept, an optimizer's step counters), which would refuse it by a few hundred bytes."""
        return self.budget_for(peak_bytes) + FLOOR_SLACK_BYTES

    def margin(self) -> int:
        """Head-room kept between the predicted peak and the budget."""
        return margin_for(self.budget_bytes, self.margin_bytes, self.margin_fraction)


class PlanMade(Exception):
    """Raised by fxmem's partitioning once a plan is made and handed on (`PlanRequest.on_plan`),
    under `plans_only()`: the forward and backward graphs are not compiled."""


_plans_only = threading.local()


@contextlib.contextmanager
def plans_only() -> Iterator[None]:
    """Within: each step fxmem plans on this thread stops once its plan is made (`PlanMade`),
    before code generation, which takes longer than planning; a budget below the floor is
    refused as before (`BudgetError`)."""
    was = getattr(_plans_only, "on", False)
    _plans_only.on = True
    try:
        yield
    finally:
        _plans_only.on = was


@contextlib.contextmanager
def _collector_paused() -> Iterator[None]:
    """Keep the cyclic garbage collector off while planning, and turn it on again after.
    Every simulation allocates lists and dicts by the thousand, and each full collection they
    set off scans every object alive: the traced graphs' nodes and fake tensors, then the
    planner's own arrays and timelines. Setting aside only the objects alive when planning
    starts (`gc.freeze`) still left HF GPT-2's floor (12 layers, 11,410 joint nodes) 47 full
    collections, 4.9 s of its 41 s; paused, it plans in 35.5 s. Garbage made while planning
    is collected after it. A process that turned the collector off itself is left so."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def make_partition_fn(req: PlanRequest) -> Callable[..., tuple[fx.GraphModule, fx.GraphModule]]:
    @_collector_paused()
    def partition_fn(joint: fx.GraphModule, joint_inputs: Any, *, num_fwd_outputs: int, **_: Any):
        t0 = time.perf_counter()
        if req.reuse is not None and req.reuse.compiler != req.compiler:
            raise PlanMismatchError(
                f"the saved plan was made with compiler={req.reuse.compiler!r}, this step compiles with "
                f"compiler={req.compiler!r} (another graph): pass the plan's compiler, or plan again"
            )
        if req.reuse is not None and req.reuse.keep_outputs != req.keep_outputs:
            raise PlanMismatchError(
                f"the saved plan was made with keep_outputs={req.reuse.keep_outputs}, this step asks for "
                f"keep_outputs={req.keep_outputs}: pass the plan's setting, or plan again"
            )
        limit = None if req.budget_bytes is None else req.budget_bytes - req.reserved_bytes() - req.margin()
        # Timing the rates, the first time, allocates beside what is alive: no more than the
        # budget leaves (`limit`).
        cost = CostModel(measure_rates(str(req.device), limit))
        # The rest is Python over the graph, millions of calls: on a stack of its own (see
        # `own_stack`), in this thread's torch state.
        plan, fw, bw = on_own_stack(_plan_and_emit, req, joint, num_fwd_outputs, cost, limit, t0, tp.carried_context())
        log.info("planned %s nodes in %.2fs\n%s", plan.graph_nodes, plan.planning_s, plan.summary())
        if req.on_plan is not None:
            req.on_plan(plan)
        if getattr(_plans_only, "on", False):
            raise PlanMade
        return fw, bw

    return partition_fn


def _plan_and_emit(
    req: PlanRequest,
    joint: fx.GraphModule,
    num_fwd_outputs: int,
    cost: CostModel,
    limit: int | None,
    t0: float,
    context: Callable[[], contextlib.AbstractContextManager],
) -> tuple[Plan, fx.GraphModule, fx.GraphModule]:
    """The plan for `joint` within `limit` (None: unconstrained; planning started at `t0`) and
    the forward and backward graphs it makes; `BudgetError` when none fits. Run in `context`,
    the caller's torch state."""
    with context():
        storage_remap = merge_repeated_values(joint, num_fwd_outputs)
        storage_remap.update(remove_redundant_clones(joint))
        if req.compiler == "inductor":
            realize_running_sums(joint, num_fwd_outputs)
            copy_expanded_attention_inputs(joint)
        else:
            split_element_wise_by_chunk(joint)
        layout_opt = req.compiler == "inductor" and on_callers_thread(tp.inductor_layout_optimization, joint)
        if layout_opt:
            copy_conv_inputs_channels_last(joint)
            copy_views_of_channels_last(joint)
        fusing = req.compiler == "inductor"

        def build(gm: fx.GraphModule) -> JointGraph:
            stop_if_abandoned()  # as between simulations: the caller was interrupted
            return JointGraph.build(
                gm,
                num_fwd_outputs,
                cost,
                storage_remap,
                fusing=fusing,
                keep_outputs=req.keep_outputs,
                channels_last=layout_opt,
            )

        jg = build(joint)
        # The graph before the backward's own copies of cheap values, planned beside the one
        # with them for the budgets that one cannot reach. The copies spare a value's forward
        # reader from keeping it alive for a late backward reader (a LayerNorm's output, read
        # again by its weight's gradient), but each is computed where the backward reads it: a
        # residual stream rebuilt for every convolution's backward from the saved convolution
        # outputs is all alive from the backward's first kernel on, where saving the stream and
        # recomputing the convolutions holds one block's values at a time (a conv-BN-SiLU
        # stack's floor: 102.9 MiB with the copies, 53.6 without). A saved plan names which
        # graph it was made on.
        copies = req.reuse is None or req.reuse.backward_copies  # the plan's graph has them
        plain = _copy_graph(jg) if req.reuse is None else None
        if copies and add_backward_copies(jg):
            jg = build(joint)
        else:
            plain = None  # no copies made: one graph
        grad_bytes = sum(jg.storage_bytes[s] for s in {jg.storage[i] for i in jg.bwd_outputs} if s >= 0)
        step_floor = grad_bytes + req.optimizer_step_bytes if req.optimizer_step_bytes else 0
        second = None
        if req.reuse is not None:
            if req.reuse.second_recomputation:
                # On a copy of the graph, as when it was planned: the copies' names must match.
                second = SecondRecomputation(**req.reuse.second_recomputation)
                jg = _with_second_recomputation(jg, second, build)
            trajectory = reuse_trajectory(req.reuse, jg, graph_record(jg), step_floor)
            floor_choice = choice = trajectory.unconstrained
            floor_bytes = req.reuse.floor_bytes
            if limit is not None and trajectory.peak(choice) > limit:
                choice = None
        else:
            trajectory = plan_trajectory(jg, floor_bytes=step_floor)
            choice = trajectory.unconstrained if limit is None else trajectory.choose(limit)
            lowest = (jg, trajectory)  # the graph whose plans reach the lowest peak
            if plain is not None:
                other = plan_trajectory(plain, floor_bytes=step_floor)
                if other.peak(other.smallest) < trajectory.peak(trajectory.smallest):
                    lowest = (plain, other)
            floor_peak = lowest[1].peak(lowest[1].smallest)
            if choice is None and lowest[0] is plain:  # below the floor with the copies
                jg, trajectory = lowest
                choice = trajectory.choose(limit)
                copies = False
            alternative = _second_recomputation(*lowest, build)
            if alternative is not None:
                floor_peak = alternative[2].peak(alternative[2].smallest)
                if choice is None:  # below the floor of running each forward op again at most once
                    second, jg, trajectory = alternative
                    choice = trajectory.choose(limit)
                    copies = lowest[0] is not plain
            if choice is None:  # `choose` searched below the walks of the graph it tried last
                floor_peak = trajectory.peak(trajectory.smallest)
            floor_choice = trajectory.smallest
            floor_bytes = req.floor_for(floor_peak)
        planning_s = time.perf_counter() - t0
        if choice is None:
            hint = ""
            if req.reuse is not None:
                # A saved plan is one state: the smallest budget it fits is its own peak's, and
                # planning again reaches down to the floor it was planned beside.
                hint = (
                    f"that is the saved plan's (plan=) own need; planning again (without plan=) reached "
                    f"down to {format_bytes(floor_bytes)} when it was made"
                )
                floor_bytes = req.floor_for(trajectory.peak(floor_choice))
            plan = make_plan(req, jg, trajectory, floor_choice, floor_bytes, planning_s, second, cost.rates, copies)
            raise BudgetError(req.budget_bytes, floor_bytes, plan.breakdown, plan, hint)
        plan = make_plan(req, jg, trajectory, choice, floor_bytes, planning_s, second, cost.rates, copies)
        stop_if_abandoned()
        fw, bw = emit_graphs(jg, choice, layout_opt)
        if fusing:
            seeds_from_buffers(fw)
            seeds_from_buffers(bw)
        return plan, fw, bw


def _second_recomputation(
    jg: JointGraph, trajectory: Trajectory, build: Callable[[fx.GraphModule], JointGraph]
) -> tuple[SecondRecomputation, JointGraph, Trajectory] | None:
    """The joint graph where the backward computes some saved values a second time (see
    `again.plan_second_recomputation`), planned, when that reaches a lower floor."""
    smallest = trajectory.smallest
    peak = trajectory.peak(smallest)
    second = plan_second_recomputation(jg, smallest.saved, peak // _SECOND_MIN_SHARE)
    if second is None:
        return None
    try:
        other = _with_second_recomputation(jg, second, build)
        planned = plan_trajectory(other, floor_bytes=trajectory.floor_bytes)
    except Exception as err:  # an option for lower budgets: the first graph's plans stand without it
        log.warning("fxmem: no second recomputation for this graph (%s: %s)", type(err).__name__, err)
        return None
    if planned.peak(planned.smallest) > (1 - _SECOND_MIN_GAIN) * peak:
        return None
    return second, other, planned


def _with_second_recomputation(
    jg: JointGraph, second: SecondRecomputation, build: Callable[[fx.GraphModule], JointGraph]
) -> JointGraph:
    """`jg`'s graph with `second` applied, on a copy: `jg` stays as it was."""
    copy = _copy_graph(jg)
    apply_second_recomputation(copy, second)
    return build(copy.gm)


def _copy_graph(jg: JointGraph) -> JointGraph:
    """`jg` over a copy of its graph: the same nodes in the same order, carrying the same values
    (fake tensors, so the same storages), so every array of `jg` describes the copy too."""
    graph = fx.Graph()
    nodes: dict[fx.Node, fx.Node] = {}
    out = graph.graph_copy(jg.gm.graph, nodes)
    output = graph.output(out)
    output.meta = dict(next(iter(jg.gm.graph.find_nodes(op="output"))).meta)
    copied = [nodes[n] for n in jg.nodes]
    return dataclasses.replace(
        jg, gm=fx.GraphModule(jg.gm, graph), nodes=copied, index={n: i for i, n in enumerate(copied)}
    )
