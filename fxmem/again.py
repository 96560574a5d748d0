"""Give the backward its own copies of forward values it reads late.

A Linear's input X is read twice after the forward: to recompute the Linear's output (when
that is not saved) and, much later, by the weight's gradient `dY.T @ X`. One recomputation
keeps X alive across everything between the two, an attention's whole backward for a
LayerNorm output:

    before                                  after
    x1 = ln(x)            # forward         x1 = ln(x)            # forward
    qkv = x1 @ W                            qkv = x1 @ W
    ...                                     ...
    dq, dk, dv = attn_bwd(...)  # x1 alive  dq, dk, dv = attn_bwd(...)
    dW = dqkv.T @ x1                        x1_again = ln(x)       # backward only
                                            dW = dqkv.T @ x1_again

`add_backward_copies` rewrites the joint graph so, before planning. The copy is a backward
node: the backward computes it where it needs it, from values it reads anyway (LayerNorm's
input, mean and rstd, read by LayerNorm's backward) or from parameters and inputs, and the
planner decides about X as before for the forward readers. A copy is made only for a value
computed by element-wise ops (or a lookup of parameters by inputs, such as a token
embedding) that a forward reader needed by the backward reads too, so the copy adds no saved
input and costs one element-wise kernel.

Below the smallest peak that recomputing each forward op at most once reaches, the same
idea goes further: `plan_second_recomputation` drops saved values (a block's residual
after attention) that the backward then rebuilds from earlier saved ones, running the ops
between (the attention) a second time, and `apply_second_recomputation` rewrites a copy of
the joint graph so; the planner plans that graph too and the budget picks (see
`partition`). Both run the same ops on the same values; like any recomputation, what the
backward reads then agrees with the forward's values to float rounding.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from fxmem import _torch_private as tp
from fxmem.errors import PlanMismatchError
from fxmem.graph import BWD, FWD, PRIMAL, JointGraph
from fxmem.kernels import op_name
from fxmem.nodes import aliased_input, retrace_views

__all__ = [
    "COPY_OF",
    "SECOND",
    "SecondRecomputation",
    "add_backward_copies",
    "apply_second_recomputation",
    "plan_second_recomputation",
]

COPY_OF = "fxmem_copy_of"  # node.meta key: the forward node a backward copy computes again
SECOND = "fxmem_second"  # node.meta key: set on the copies of a second recomputation

# Gathers of rows (a token embedding): as cheap to run again as an element-wise op.
_LOOKUPS = {"embedding", "index_select", "gather"}
_MAX_CHAIN = 12  # ops copied for one value; longer chains are not cheap to run twice
_MAX_SECOND_CHAIN = 40  # a transformer block's attention with its projections and norm


def add_backward_copies(jg: JointGraph) -> int:
    """Copy, for the backward, cheap forward values that a forward reader the backward needs
    reads too (see the module docstring). Mutates `jg.gm`; returns how many values were copied
    (rebuild the JointGraph when it is not 0)."""
    if not jg.inlinable:
        return 0  # without a fusing compiler a copy is an op of its own: no cheaper than saving
    read_by_bwd = set(jg.boundary())
    needed = _needed(jg)

    def worth_a_copy(x: int) -> bool:
        s = jg.storage[x]
        if jg.kind[x] != FWD or jg.banned[x] or not jg.inlinable[x] or not _is_base(jg, x):
            return False
        reads = [u for j in _group(jg, x) for u in jg.users[j]]
        return any(jg.kind[u] == BWD for u in reads) and any(
            jg.kind[u] == FWD and jg.storage[u] != s and needed[u] and not jg.is_view(u) for u in reads
        )

    def cheap(j: int) -> bool:
        return jg.inlinable[j] or op_name(jg.nodes[j]) in _LOOKUPS

    copied: list[int] = []
    chains: set[int] = set()

    def there(j: int) -> bool:  # the backward reads it anyway, or has its copy
        return j in read_by_bwd or j in chains

    for x in range(len(jg.nodes)):
        if not worth_a_copy(x):
            continue
        chain = _chain(jg, x, there, cheap, _MAX_CHAIN)
        if chain is not None:
            copied.append(x)
            chains |= chain
    if copied:
        copies = _make_copies(jg, sorted(chains))
        _read_copies(jg, copies, {j for x in copied for j in _group(jg, x)}, set(copies.values()))
    return len(copied)


@dataclass
class SecondRecomputation:
    """Saved values the backward computes again from earlier saved ones, by node name.

    `dropped`: the values no longer saved; `chain`: the forward ops between the earlier saved
    values and them, run again for them only; `downstream`: the forward values after them the
    backward reads, made from the copies.
    """

    dropped: list[str] = field(default_factory=list)
    chain: list[str] = field(default_factory=list)
    downstream: list[str] = field(default_factory=list)


def plan_second_recomputation(jg: JointGraph, saved: list[bool], min_bytes: int) -> SecondRecomputation | None:
    """Which saved values the backward may compute again from the values saved before them.

    Given the smallest plan's `saved`: each saved value of at least `min_bytes` the backward
    reads that can be computed from earlier saved values through other forward ops (a
    transformer block's residual after attention, from the block's input) is dropped, and
    every forward value the backward reads downstream of it (the block's MLP) is made from
    its copy; a value that could only be computed through another dropped one stays saved,
    so every other residual is kept. The values in between (the attention's q, k, v) stay as
    they were for their own backward readers: the backward runs them once to rebuild the
    dropped value and once more where their gradients need them. None when nothing is
    dropped."""
    n = len(jg.nodes)
    kept = {i for i in range(n) if saved[i] and jg.kind[i] == FWD}
    dropped: set[int] = set()
    gone: set[int] = set()  # the storages of the dropped values (their views are rebuilt too)
    chain: set[int] = set()
    for x in sorted(kept):
        if not _is_base(jg, x) or jg.banned[x] or jg.storage_bytes[jg.storage[x]] < min_bytes:
            continue
        if not any(jg.kind[u] == BWD for j in _group(jg, x) for u in jg.users[j]):
            continue
        found = _chain(
            jg,
            x,
            lambda j: j in kept and jg.storage[j] not in gone,
            lambda j: jg.storage[j] not in gone,
            _MAX_SECOND_CHAIN,
        )
        if found is not None:
            dropped.add(x)
            gone.add(jg.storage[x])
            chain |= found
    if not dropped:
        return None
    needed = _needed(jg)
    downstream: set[int] = set()
    rebuilt = {j for x in dropped for j in _group(jg, x)}  # the dropped values and their views
    for v in range(min(dropped), n):
        if jg.kind[v] != FWD or v in chain or (v in kept and v not in dropped) or not needed[v] or jg.banned[v]:
            continue
        if not _plain_op(jg.nodes[v]):
            continue  # its backward readers keep reading it, made from the forward's values
        if any(j in rebuilt or j in downstream for j in jg.inputs[v]):
            downstream.add(v)
    names = [node.name for node in jg.nodes]
    return SecondRecomputation(
        dropped=[names[i] for i in sorted(dropped)],
        chain=[names[i] for i in sorted(chain - dropped)],
        downstream=[names[i] for i in sorted(downstream)],
    )


def apply_second_recomputation(jg: JointGraph, second: SecondRecomputation) -> None:
    """Rewrite `jg.gm` as `second` says (rebuild the JointGraph after)."""
    index = {node.name: i for i, node in enumerate(jg.nodes)}
    missing = [name for name in (*second.dropped, *second.chain, *second.downstream) if name not in index]
    if missing:
        raise PlanMismatchError(f"the saved plan computes {missing[0]} again, which this graph lacks; plan again")
    dropped = [index[name] for name in second.dropped]
    downstream = {index[name] for name in second.downstream}
    rebuilt = {j for x in dropped for j in _group(jg, x)}  # the dropped values and their views
    copies = _make_copies(jg, sorted({index[name] for name in second.chain} | rebuilt | downstream))
    made = set(copies.values())
    if jg.fusible:
        for x in dropped:
            copies[x] = _store(jg.gm.graph, copies[x])
            made.add(copies[x])
    for node in made:
        node.meta[SECOND] = True
    _read_copies(jg, copies, rebuilt | downstream, made)


@torch.library.custom_op("fxmem::stored", mutates_args=())
def _stored(x: torch.Tensor) -> torch.Tensor:
    """`x`, written to memory: a library call a fusing compiler does not fuse into."""
    return x.clone()


@_stored.register_fake
def _(x):
    return torch.empty_like(x)


def _store(graph: fx.Graph, node: fx.Node) -> fx.Node:
    """Make the readers of `node` read it through `_stored`: a value a fusing compiler would
    compute again inside each reader's kernel keeps its inputs alive until the last of them;
    a value computed again in the backward to stand in for a saved one should be written
    out, as the saved one was."""
    with graph.inserting_after(node):
        stored = graph.call_function(torch.ops.fxmem.stored.default, (node,))
    stored.meta = tp.meta_for(stored, node)
    node.replace_all_uses_with(stored, delete_user_cb=lambda u: u is not stored)
    return stored


def _needed(jg: JointGraph) -> list[bool]:
    """Per node: a forward value the backward reads, directly or through forward ops."""
    read_by_bwd = set(jg.boundary())
    needed = [False] * len(jg.nodes)
    for i in range(len(jg.nodes) - 1, -1, -1):
        if jg.kind[i] == FWD:
            needed[i] = i in read_by_bwd or any(jg.kind[u] == FWD and needed[u] for u in jg.users[i])
    return needed


def _chain(
    jg: JointGraph, x: int, stop: Callable[[int], bool], allowed: Callable[[int], bool], limit: int
) -> set[int] | None:
    """`x`, its views, and the forward ops between it and the values `stop` names (or
    parameters and inputs), or None when one of them is not `allowed`, must run once, or
    there are more than `limit`."""
    chain = set(_group(jg, x))
    if not all(_plain_op(jg.nodes[j]) for j in chain):
        return None
    todo = [x]
    while todo:
        i = todo.pop()
        for j in jg.inputs[i]:
            if j in chain or jg.kind[j] == PRIMAL or jg.is_sym[j] or jg.nodes[j].op != "call_function" or stop(j):
                continue  # read as it is: an input, a constant, or a value there anyway
            if jg.kind[j] != FWD or jg.banned[j] or len(chain) >= limit or not allowed(j) or not _plain_op(jg.nodes[j]):
                return None
            chain.add(j)
            todo.append(j)
    return chain


def _make_copies(jg: JointGraph, nodes: list[int]) -> dict[int, fx.Node]:
    """A backward copy of each of `nodes` (in graph order), reading the copies of its inputs."""
    graph = jg.gm.graph
    copies: dict[int, fx.Node] = {}
    with graph.inserting_before(jg.nodes[jg.first_bwd]):
        for i in nodes:
            node = jg.nodes[i]
            args, kwargs = fx.node.map_arg(
                (node.args, node.kwargs), lambda a: copies[jg.index[a]] if jg.index[a] in copies else a
            )
            copy = graph.create_node(node.op, node.target, args, kwargs, name=f"{node.name}_again")
            copy.meta = {**node.meta, "val": tp.fake_rerun(copy)}
            copy.meta[COPY_OF] = node.name
            copies[i] = copy
    return copies


def _read_copies(jg: JointGraph, copies: dict[int, fx.Node], values: set[int], made: set[fx.Node]) -> None:
    """Make the backward readers of `values` read their copies; place each node `made` where
    it is first read."""
    views = []
    for w in values:
        for u in list(jg.users[w]):
            if jg.kind[u] == BWD:
                jg.nodes[u].replace_input_with(jg.nodes[w], copies[w])
                if aliased_input(jg.nodes[u]) is copies[w]:
                    views.append(jg.nodes[u])
    # A view's value must alias the copy, not the value it copies: a weight's gradient reads
    # `permute(view(x_again))` (HF GPT-2's Conv1D), and with x's storage there the plan
    # counted x alive until the copy's last reader (1 MiB at GPT-2's floor under inductor).
    retrace_views(views)
    _place_copies(jg.gm.graph, made)
    jg.gm.graph.lint()
    jg.gm.recompile()


def _place_copies(graph: fx.Graph, copies: set[fx.Node]) -> None:
    """Each copy just before its first reader: the backward runs it where it is needed (a
    copy nothing reads is dropped). The outputs of a multi-output op stay right after it:
    the op makes them all at once."""
    for node in reversed([n for n in graph.nodes if n in copies]):
        if node.target is operator.getitem:
            continue
        readers = [u for u in node.users if u.target is not operator.getitem] + [
            r for u in node.users if u.target is operator.getitem for r in u.users
        ]
        if not readers:
            for u in list(node.users):
                graph.erase_node(u)
            graph.erase_node(node)
            continue
        order = {n: k for k, n in enumerate(graph.nodes)}
        min(readers, key=order.__getitem__).prepend(node)
        for u in node.users:
            if u.target is operator.getitem:
                node.append(u)


def _group(jg: JointGraph, x: int) -> list[int]:
    """`x` and the forward views made from it (not other outputs of an op that shares its
    storage, such as the other parts of a split)."""
    s = jg.storage[x]
    group, todo = [x], [x]
    while todo:
        for u in jg.users[todo.pop()]:
            if jg.storage[u] == s and jg.kind[u] == FWD and u not in group:
                group.append(u)
                todo.append(u)
    return group


def _is_base(jg: JointGraph, i: int) -> bool:
    """Whether node `i` made its storage (the first node that holds it): not a view, nor a part
    of a split (whose storage its input made)."""
    s = jg.storage[i]
    return s >= 0 and jg.storage_maker[s] == i


def _plain_op(node: fx.Node) -> bool:
    """An aten op (or an output of one) that reads only values: not a higher-order op with
    subgraphs (torch.cond, flex attention) or anything else a copy could not run again as is."""
    if node.op != "call_function":
        return False
    if node.target is operator.getitem:
        return True
    return tp.is_aten_op(node.target) and all(a.op != "get_attr" for a in node.all_input_nodes)
