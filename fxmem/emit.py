"""Emitting the planned boundary: the forward and backward graphs a `Choice` describes.

Deciding is separate from doing: `partition` plans (which forward values are saved, in which
order the backward runs); this file only applies the plan, letting torch cut the joint graph at
exactly that boundary (anything unsaved that the backward needs is copied into it) and ordering
the backward exactly as `simulate` ran it.
"""

from __future__ import annotations

import heapq

import torch
import torch.fx as fx

from fxmem import _torch_private as tp
from fxmem.cleanup import save_as_traced
from fxmem.graph import FWD, PRIMAL, JointGraph
from fxmem.kernels import is_fusible, is_inlinable, is_view_op
from fxmem.nodes import aliased_input, one_element
from fxmem.planner import Choice

__all__ = ["emit_graphs"]


def emit_graphs(jg: JointGraph, choice: Choice, layout_opt: bool) -> tuple[fx.GraphModule, fx.GraphModule]:
    """The forward and backward graphs `choice` describes: the forward saves for the backward
    what `choice` saves, and the backward runs in the order `simulate` ran it."""
    recomputed = set(choice.timeline.recomputed)
    needed = jg.read_back(recomputed)
    saved_values, saved_syms = [], []
    for i, node in enumerate(jg.nodes):
        if i not in needed or i in recomputed:
            continue
        if jg.kind[i] == PRIMAL and jg.storage[i] >= 0:
            saved_values.append(node)
        elif jg.kind[i] == FWD and jg.is_sym[i]:
            saved_syms.append(node)
        elif jg.kind[i] == FWD and (choice.saved[i] or jg.there_before_backward[i]):
            saved_values.append(_viewed(jg, node))  # saved, or a value the step returns
    saved_values = list(dict.fromkeys(saved_values))
    if layout_opt:
        forward = [n for n, k in zip(jg.nodes, jg.kind, strict=True) if k in (PRIMAL, FWD)]
        backward = {jg.nodes[i] for i, k in enumerate(jg.kind) if k not in (FWD, PRIMAL) or i in recomputed}
        saved_values = save_as_traced(jg.gm, saved_values, forward, backward.__contains__)
    fw, bw = tp.extract_fwd_bwd(jg.gm, saved_values, saved_syms, jg.num_fwd_outputs)
    tl = choice.timeline
    bw = _ordered_as(bw, [jg.nodes[i].name for i in tl.emitted or tl.order[tl.boundary :]], fusing=bool(jg.fusible))
    if layout_opt and tp.CONV_BACKWARD_TAKES_TRACED_STRIDES:
        _conv_backward_channels_last(bw)
    for gm in (fw, bw):
        if jg.fusible:
            _view_per_reader(gm, layout_opt)
        gm.graph.eliminate_dead_code()
        gm.recompile()
    return fw, bw


def _conv_backward_channels_last(gm: fx.GraphModule) -> None:
    """Pin the gradient and the input each convolution backward reads channels-last where
    they were traced otherwise (see `_torch_private.CONV_BACKWARD_TAKES_TRACED_STRIDES`): a
    conv-BN-SiLU stack's backward wrote each batch norm's input gradient contiguous beside a
    channels-last buffer of the same size, and the call copied it again (57.9 MiB measured at a
    53.5 MiB budget, 49.7 predicted)."""
    for node in list(gm.graph.find_nodes(op="call_function", target=_aten.convolution_backward.default)):
        for k in (0, 1):
            arg = node.args[k]
            val = arg.meta.get("val") if isinstance(arg, fx.Node) else None
            if not isinstance(val, torch.Tensor) or val.ndim != 4:
                continue
            if val.is_contiguous(memory_format=torch.channels_last):
                continue
            channels_last = val.clone(memory_format=torch.channels_last)
            with gm.graph.inserting_before(node):
                pinned = gm.graph.call_function(tp.force_stride_order(), (arg, list(channels_last.stride())))
            # the value's meta, with its new strides (no stale `tensor_meta`)
            pinned.meta = {k: v for k, v in arg.meta.items() if k != "tensor_meta"}
            pinned.meta["val"] = channels_last
            node.update_arg(k, pinned)


def _viewed(jg: JointGraph, node: fx.Node) -> fx.Node:
    """The value a saved view views (through views), which the forward returns instead; the
    backward takes the view again (views cost nothing). Inductor returns a view it cannot
    express as its input's storage with strides (a batch-merging view of an expanded value, as
    a grouped attention's keys read by a batched matmul) as a copy, held from the forward to
    the backward, where the plan counts the storage it views. A view whose shape reads another
    value stays saved as it is."""
    sid = jg.storage[jg.index[node]]
    while is_view_op(node) and node.all_input_nodes == [node.args[0]]:
        base = jg.index[node.args[0]]
        if jg.storage[base] != sid or jg.kind[base] not in (FWD, PRIMAL):
            break
        node = node.args[0]
    return node


def _ordered_as(gm: fx.GraphModule, names: list[str], fusing: bool) -> fx.GraphModule:
    """`gm` with its nodes in the order `names` gives (placeholders first, output last).

    A topological sort that, among the nodes whose inputs are ready, takes the one earliest in
    `names`; a node `names` lacks (a view of a saved value, see cleanup.save_as_traced) goes
    right before its first reader that `names` has, or after every named one. For a fusing
    compiler, a view several nodes read, a library call among them, goes right after the value
    it views (views cost nothing; the plan's order is otherwise kept): inductor writes a value
    out when it meets such a view, and a kernel it met before then computes the value again
    from its inputs instead of reading it (a softmax's gradient summed for a bias, read by two
    matmuls through a view).
    """
    named = {name: k for k, name in enumerate(names)}
    nodes = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output")]
    pos = {n: k for k, n in enumerate(nodes)}
    rank: dict[fx.Node, tuple[int, int]] = {}
    for n in reversed(nodes):
        if n.name in named:
            rank[n] = (named[n.name], 1)
        else:  # right before its first reader
            rank[n] = (min((rank[u][0] for u in n.users if u in rank), default=len(named)), 0)
    for n in nodes:
        base = n.args[0] if n.args and isinstance(n.args[0], fx.Node) else None
        if fusing and base in rank and is_view_op(n) and len(n.users) > 1 and not all(is_fusible(u) for u in n.users):
            rank[n] = rank[base]
    waiting = {n: sum(1 for a in n.all_input_nodes if a in pos) for n in nodes}
    ready = [(rank[n], pos[n], n) for n in nodes if waiting[n] == 0]
    heapq.heapify(ready)
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for n in gm.graph.find_nodes(op="placeholder"):
        env[n] = graph.node_copy(n, env.__getitem__)
    while ready:
        *_, n = heapq.heappop(ready)
        env[n] = graph.node_copy(n, env.__getitem__)
        for u in n.users:
            if u in waiting:
                waiting[u] -= 1
                if waiting[u] == 0:
                    heapq.heappush(ready, (rank[u], pos[u], u))
    if len(env) != len(nodes) + len(gm.graph.find_nodes(op="placeholder")):
        raise RuntimeError("fxmem: the backward graph has a cycle")  # a bug, never the user's input
    for n in gm.graph.find_nodes(op="output"):
        graph.node_copy(n, env.__getitem__)
    return fx.GraphModule(gm, graph)


_aten = torch.ops.aten
# Matmuls, whose inputs inductor lays out where it lowers a value several ops read (its
# `need_fixed_layout`). A convolution's gradient only under its layout optimization: without
# it, the convolutions' own layout constraint copies such a view in each reader (a view of
# its own per reader would be copied twice).
_FIXED_LAYOUT_READERS = {_aten.mm.default, _aten._int_mm.default}


def _view_per_reader(gm: fx.GraphModule, layout_opt: bool) -> None:
    """Give each reader of a view that a matmul and other ops read a view of its own, where the
    value viewed is element-wise code loading one buffer.

    Inductor fixes the layout of a value several ops read, one a matmul, where it lowers it. A
    view of a value it has not stored (a ReLU, computed inside each reader's loop) it copies
    into a buffer of its own there; the value itself it still computes in its other readers,
    from its input, which so stays alive until the last of them. T5's feed-forward, computed
    again in the backward: the ReLU's output, read through a view by the next layer's matmul
    and by its weight gradient's, was copied, and the ReLU's gradient read the matmul output
    before it, 2 MiB a layer alive through the peak that the plan had freed. Read by one matmul
    through a view, the value is stored where the matmul reads it, as the plan counts it.
    A value loading more buffers inductor stores where it meets the view anyway.

        r = relu(view(mm_13)); v = view(r); mm(v, w); mm(g, v); le(r, 0)
        ->  r = relu(view(mm_13)); mm(view(r), w); mm(g, view(r)); le(r, 0)
    """
    fixed = _FIXED_LAYOUT_READERS | ({_aten.convolution_backward.default} if layout_opt else set())
    for node in list(gm.graph.nodes):
        readers = list(node.users)
        if (
            len(readers) < 2
            or aliased_input(node) is None  # not a view (an in-place op aliases what it writes)
            or not any(u.target in fixed for u in readers)
            or any(u.op == "output" for u in readers)
            or _loads(_viewed_value(node)) > 1
        ):
            continue
        for u in readers[1:]:
            with gm.graph.inserting_before(u):
                own = gm.graph.node_copy(node)
            u.replace_input_with(node, own)


def _viewed_value(node: fx.Node) -> fx.Node:
    """The value a view views, through views."""
    while (base := aliased_input(node)) is not None:
        node = base
    return node


def _loads(node: fx.Node, limit: int = 2) -> int:
    """How many buffers the element-wise code computing `node` loads, each once (up to
    `limit`): an input it does not compute itself (a placeholder, a library call's output, a
    reduction) is a buffer, a single element none."""
    if node.op != "call_function" or not is_inlinable(node):
        return limit
    buffers: set[fx.Node] = set()
    seen = {node}
    todo = [node]
    while todo:
        for j in todo.pop().all_input_nodes:
            if j in seen or not isinstance(j.meta.get("val"), torch.Tensor) or one_element(j):
                continue
            seen.add(j)
            if j.op == "call_function" and is_inlinable(j):
                todo.append(j)
            else:
                buffers.add(j)
                if len(buffers) >= limit:
                    return limit
    return len(buffers)
