"""The order one training step runs in, given which forward values are saved.

The forward runs the forward nodes in graph order. The backward runs the backward nodes from
the first one that reads a gradient (a library call whose output outweighs what it frees waits
for its first reader, see `JointGraph.deferred`), and brings in what each needs just before it
needs it: forward values that were not saved are recomputed there, in graph order (this is the
order the emitted backward graph has, see `emit.emit_graphs`). A fusing compiler (inductor) then
runs that graph its own way: an element-wise value a library call alone reads is computed right
before that call (`as_realized`); a run of fusible ops is one kernel (`kernel_ends`); a
multi-output library call writes all its outputs at once (`outputs_made_at`). `simulate` counts
memory over this order.
"""

from __future__ import annotations

import heapq

from fxmem.graph import BWD, FWD, JointGraph
from fxmem.kernels import op_name
from fxmem.nodes import one_element

__all__ = ["InfeasibleSave", "as_realized", "backward_order", "kernel_ends", "outputs_made_at"]


class InfeasibleSave(Exception):
    """The saved set makes the backward recompute a node that must run only once."""

    def __init__(self, node_index: int):
        super().__init__(node_index)
        self.node_index = node_index


def backward_order(jg: JointGraph, saved: list[bool]) -> tuple[list[int], list[int]]:
    """Backward schedule and the forward nodes it recomputes."""
    kind, users, inputs, banned = jg.kind, jg.users, jg.inputs, jg.banned
    done = jg.there_before_backward.copy()
    for i in jg.forward_nodes:
        if saved[i]:
            done[i] = True
    there = done.__getitem__  # `all(map(there, inputs[i]))`: whether i's inputs are all there
    # Forward nodes the backward will need (so will recompute, if they are not saved). Nodes
    # already there are never asked for: what they need is not either.
    needed = [k == BWD for k in kind]
    for i in reversed(jg.forward_nodes):
        if not done[i]:
            for u in users[i]:
                if needed[u] and not done[u]:
                    needed[i] = True
                    break
    order: list[int] = []
    recomputed: list[int] = []

    def emit(i: int) -> None:
        if kind[i] == FWD:
            if banned[i]:
                raise InfeasibleSave(i)
            recomputed.append(i)
        done[i] = True
        order.append(i)

    early, parts, first_bwd, shrinking = jg.early_gradients, jg.tuple_parts, jg.first_bwd, jg.shrinking
    joiners = jg.early_joiners

    def extra(u: int) -> bool:
        """May run early, though nothing asked for it yet (`u` may join early): see `bring`."""
        if u in early or (u in parts and needed[u] and not banned[u]):
            return not done[u]  # an early gradient, or an output of an op just run
        if not (u < first_bwd and needed[u] and not done[u] and not banned[u]):
            return False
        return kind[u] == BWD or u in shrinking

    def bring(root: int) -> None:
        """Run `root` and whatever it needs that is not there, in graph order.

        Readers of what is brought that stand before the gradients in the graph (values only
        the backward reads; recomputed forward values smaller than what they read: views,
        reductions) join in as soon as their inputs are there rather than when the backward
        first asks for them: a loop run in the backward (the chunked loss's chunks) then frees
        each chunk's values before the next starts. So do gradients that sum a larger value (a
        bias's), which then need not hold it. A recomputed value as large as what it reads
        waits until asked for: groups of attention heads, or chunks of an MLP's rows, are
        recomputed one at a time, each beside its own gradient, not all at once.
        """
        if all(map(there, inputs[root])):  # the common case: run it, then its joiners
            emit(root)
            if not joiners[root]:
                return
            ready = [u for u in joiners[root] if extra(u) and all(map(there, inputs[u]))]
            if not ready:
                return
            seen, queued = {root}, {root, *ready}
        else:
            seen, todo = {root}, [root]
            while todo:
                i = todo.pop()
                for j in inputs[i]:
                    if not done[j] and j not in seen:
                        seen.add(j)
                        todo.append(j)
            ready = [i for i in seen if all(map(there, inputs[i]))]
            queued = set(ready)
        heapq.heapify(ready)
        while ready:
            i = heapq.heappop(ready)
            emit(i)
            for u in users[i]:
                if u not in queued and (u in seen or (may_join[u] and extra(u))) and all(map(there, inputs[u])):
                    queued.add(u)
                    heapq.heappush(ready, u)

    may_join = jg.may_join_early
    for roots in (jg.backward_roots, jg.bwd_outputs):
        for i in roots:
            if not done[i]:
                bring(i)
    return order, recomputed


def as_realized(jg: JointGraph, order: list[int], start: int) -> list[int]:
    """The order a fusing compiler runs the steps from `start` on, given the graph in `order`.

    Inductor computes an element-wise value that only library calls read (a convolution's or a
    matmul's input, read directly or through views) when it gets to the first of them, right
    before it, and the later ones read that buffer. In between, what the value is computed from
    stays alive, and a recomputation placed there (a convolution the backward runs again) runs
    beside it. Such a value's step, and its views', move to just before that call. Read by
    several, a value is written where it stands when an element-wise op reads it too, when a
    matmul (`mm`) or convolution reading it fixes its layout, or when its code loads more than
    one buffer or applies a heavy op (inductor's `realize_hint` and `should_realize_on_reuse`):
    a chunk of T5's queries, scaled, read by the scores' batched matmul and again by the keys'
    gradient, moves; rotary-embedded queries stay.
    """
    pos = {order[t]: t for t in range(start, len(order))}  # a recomputed node: its backward step
    later: dict[int, list[int]] = {}  # step of a library call -> steps that move just before it
    for i in jg.written_by_readers:
        t = pos.get(i)
        if t is None:
            continue
        s = jg.storage[i]
        holders = [j for j in jg.storage_nodes[s] if j in pos]
        readers = [[u for u in jg.users[j] if u in pos] for j in holders]
        outside = [u for us in readers for u in us if jg.storage[u] != s]
        if not outside or any(jg.fusible[u] for u in outside):
            continue
        if (len(outside) > 1 or any(len(us) > 1 for us in readers)) and _realized_where_it_stands(jg, i, readers, pos):
            continue
        call = min(pos[u] for u in outside)
        if call > t + 1:
            later.setdefault(call, []).extend(pos[j] for j in holders if t <= pos[j] < call)
    if not later:
        return order
    moved = {k for steps in later.values() for k in steps}
    out = order[:start]
    for t in range(start, len(order)):
        steps = later.get(t)
        if steps:
            out.extend(order[k] for k in sorted(steps))
        if t not in moved:
            out.append(order[t])
    return out


# Library calls that fix the layout of an input several ops read, which writes it where it
# stands (inductor's `need_fixed_layout`); the convolution's only where it does not pick
# layouts itself, so counted always.
_FIXING_LAYOUT = {"mm", "_int_mm", "convolution", "convolution_backward"}


def _realized_where_it_stands(jg: JointGraph, i: int, readers: list[list[int]], pos: dict[int, int]) -> bool:
    """Whether inductor writes node `i`, read by several, where it stands: a value or view of it
    several ops read, one a matmul (`mm`) or convolution, whose layout that fixes; or element-wise
    code (with the unstored values it computes inline) that applies a heavy op or makes more
    than one load. A load is a buffer read one way: two views of one buffer are two loads; a
    value the forward saved (not in `pos`, the backward's steps) is one; a one-element value
    is read as a scalar."""
    if any(len(us) > 1 and any(op_name(jg.nodes[u]) in _FIXING_LAYOUT for u in us) for us in readers):
        return True
    loaded: set[int] = set()
    seen: set[int] = set()
    stack = [i]
    while stack:
        k = stack.pop()
        if k in seen:
            continue
        seen.add(k)
        if jg.heavy[k]:
            return True
        for j in jg.inputs[k]:
            s = jg.storage[j]
            if s < 0 or one_element(jg.nodes[j]):
                continue
            if jg.materialized[s] or not jg.inlinable[j] or j not in pos:
                loaded.add(j)
            else:
                stack.append(j)
        if len(loaded) > 1:
            return True
    return False


def outputs_made_at(jg: JointGraph, order: list[int]) -> dict[int, list[int]]:
    """Step -> storages of the outputs a multi-output library call (attention, its backward)
    writes at that step: all of them, before it frees what it read, though the graph takes
    them out one `getitem` at a time afterwards."""
    calls = jg.call_outputs
    if not calls:
        return {}
    parts = {u for made in calls.values() for u, _ in made}
    last = {i: t for t, i in enumerate(order) if i in parts}  # a part's last step
    out: dict[int, list[int]] = {}
    for t, i in [(t, i) for t, i in enumerate(order) if i in calls]:
        for u, s in calls[i]:
            if last.get(u, -1) > t:
                out.setdefault(t, []).append(s)
    return out


def kernel_ends(fusible: list[bool]) -> list[int]:
    """Per step, the last step of the run of fusible ops it belongs to (itself if none): a
    fusing compiler runs such a run as one kernel, which holds every buffer it reads until it
    has written every buffer it makes."""
    end = list(range(len(fusible)))
    for t in range(len(fusible) - 2, -1, -1):
        if fusible[t] and fusible[t + 1]:
            end[t] = end[t + 1]
    return end
