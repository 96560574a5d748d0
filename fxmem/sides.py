"""Which side of the joint graph each node runs on, and which nodes may not run a second time.

AOTAutograd's joint graph holds the forward and the backward in one: `sides` tells them apart
(and finds the inputs and the gradients of the outputs), `run_once` marks what a plan must not
recompute. `JointGraph.build` reads both into its arrays.
"""

from __future__ import annotations

import operator
from typing import Any

import torch.fx as fx

from fxmem import _torch_private as tp
from fxmem.nodes import must_run_once
from fxmem.storages import written_storages

__all__ = ["BWD", "FWD", "PRIMAL", "TANGENT", "run_once", "sides"]

PRIMAL, TANGENT, FWD, BWD = 0, 1, 2, 3


def sides(
    nodes: list[fx.Node],
    index: dict[fx.Node, int],
    inputs: list[list[int]],
    users: list[list[int]],
    fwd_outputs: list[int],
) -> list[int]:
    """Per node: PRIMAL or TANGENT (placeholders), FWD or BWD. The tangents' closure (and what
    must run in the backward) is BWD; ancestors of forward outputs are FWD; whatever is left
    (derived from primals, read only by the backward) runs in the backward, once, where it is
    needed."""
    kind = [BWD] * len(nodes)
    for i, n in enumerate(nodes):
        if n.op == "placeholder":
            kind[i] = TANGENT if tp.is_tangent(n) else PRIMAL
    in_bwd = [k == TANGENT for k in kind]
    for i, n in enumerate(nodes):
        if in_bwd[i] or tp.must_be_in_backward(n):
            in_bwd[i] = True
            for u in users[i]:
                in_bwd[u] = True
    stack = [o for o in fwd_outputs if not in_bwd[o]]
    fwd = [False] * len(nodes)
    while stack:
        i = stack.pop()
        if fwd[i] or kind[i] in (PRIMAL, TANGENT):
            continue
        fwd[i] = True
        stack.extend(inputs[i])
    for i, n in enumerate(nodes):
        # Every output of a forward op belongs to the forward, used there or not: a
        # tuple is never a value the backward can be handed.
        if n.target is operator.getitem and not in_bwd[i] and fwd[index[n.args[0]]]:
            fwd[i] = True
        if fwd[i]:
            kind[i] = FWD
    return kind


def run_once(
    nodes: list[fx.Node],
    index: dict[fx.Node, int],
    inputs: list[list[int]],
    kind: list[int],
    storage: list[int],
    fwd_outs: list[Any],
    descs: list[Any],
) -> list[bool]:
    """Per node, whether it may not be run a second time: random or impure ops (and their
    outputs), ops tagged to stay in the forward, ops whose outputs update the caller's tensors,
    and forward ops that read an input the step updates. `fwd_outs`: the graph's forward
    outputs; `descs`: AOTAutograd's descriptions of its outputs."""
    written = written_storages(nodes, storage, descs)
    banned = []
    for n in nodes:
        ban = must_run_once(n) or n.meta.get("partitioner_tag") == "must_be_in_forward"
        if n.target is operator.getitem and n.args and isinstance(n.args[0], fx.Node):
            ban = ban or must_run_once(n.args[0])
        banned.append(ban)

    # Ops whose outputs become in-place updates of the caller's tensors (BatchNorm running
    # stats, say) have a side effect: they run once. Their buffers also change after the
    # forward, so a recomputation reading them would see the new values.
    for out, desc in zip(fwd_outs, descs[: len(fwd_outs)], strict=True):
        if type(desc).__name__ != "InputMutationAOTOutput" or not isinstance(out, fx.Node):
            continue
        op = out.args[0] if out.target is operator.getitem else out
        if isinstance(op, fx.Node) and op.op == "call_function":
            banned[index[op]] = True
            for u in op.users:
                if u in index:
                    banned[index[u]] = True
    # An input the step updates (in the graph, or written back after the forward) holds
    # another value in the backward: any op reading it, directly or through a view, would
    # give another result there if the backward recomputed it.
    for i in range(len(nodes)):
        if kind[i] == FWD and any(storage[j] in written for j in inputs[i]):
            banned[i] = True
    return banned
