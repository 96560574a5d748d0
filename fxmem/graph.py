"""What the planner needs to know about AOTAutograd's joint forward+backward graph.

`JointGraph.build` reads the joint graph once into flat arrays indexed by node position:
which side each node is on (`sides`), which storage its value lives in (views alias their base: two
nodes whose fake values share a storage share one entry), how many bytes each storage holds,
whether a node may be run a second time (`sides.run_once`), and what running it again costs; with a fusing
compiler, also how it runs each node (`kernels`). The simulator and the solvers work on these
arrays only, so planning never touches fx objects in its loops.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch.fx as fx

from fxmem import _torch_private as tp
from fxmem import buffers, kernels
from fxmem.cost import CostModel
from fxmem.nodes import transient_bytes
from fxmem.probe import workspace_bytes
from fxmem.sides import BWD, FWD, PRIMAL, TANGENT, run_once, sides
from fxmem.storages import concatenated_in_place, node_storages

__all__ = ["BWD", "FWD", "PRIMAL", "TANGENT", "JointGraph"]


@dataclass
class JointGraph:
    gm: fx.GraphModule
    num_fwd_outputs: int
    nodes: list[fx.Node]
    index: dict[fx.Node, int]
    kind: list[int]
    inputs: list[list[int]]  # indices of value inputs (tensor or symbolic) per node
    users: list[list[int]]
    storage: list[int]  # storage id per node; -1 for non-tensors
    storage_bytes: list[int]
    banned: list[bool]  # may not be recomputed (random, impure, must be in forward)
    cost_s: list[float]  # estimated seconds to run the node once
    fwd_outputs: list[int]
    bwd_outputs: list[int]
    first_bwd: int  # position of the first node that reads a tangent
    is_sym: list[bool] = field(default_factory=list)
    # Storages a fusing compiler writes to memory. A value that only feeds fusible ops is
    # computed inside its consumers' kernels unless it is saved or returned.
    materialized: list[bool] = field(default_factory=list)
    # Bytes an op allocates and frees inside itself, on top of its output (see _TRANSIENT).
    transient: list[int] = field(default_factory=list)
    # Ops a fusing compiler generates into loops (pointwise, reductions, views; see kernels.is_fusible).
    fusible: list[bool] = field(default_factory=list)
    # Of those, the ones a reader's kernel can compute again element by element (not reductions).
    inlinable: list[bool] = field(default_factory=list)
    # Matmuls a fusing compiler runs inside their reader's addmm (see kernels.kernel_ops): where
    # that add is, reading their inputs there.
    folded: frozenset[int] = frozenset()
    # Values a fusing compiler copies for each attention kernel that reads them, storing none
    # (see buffers.copied_per_reader).
    copied_per_reader: frozenset[int] = frozenset()
    # Storages the forward's graph writes out because several of its ops read them (see
    # buffers.stored_in_forward), unless they run in the kernel computing them (see simulate).
    stored_in_forward: frozenset[int] = frozenset()
    # Forward outputs the caller lets go before the backward (`keep_outputs=False`), node ->
    # position among the step's outputs: the tensors it returns as they are (AOTAutograd's
    # plain outputs; not the bases of returned views), which then live to the forward's end.
    released_outputs: dict[int, int] = field(default_factory=dict)

    @classmethod
    def build(
        cls,
        gm: fx.GraphModule,
        num_fwd_outputs: int,
        cost: CostModel,
        storage_remap: dict[int, int] | None = None,
        fusing: bool = False,
        keep_outputs: bool = True,
        channels_last: bool = False,
    ) -> JointGraph:
        nodes = [n for n in gm.graph.nodes if n.op != "output"]
        index = {n: i for i, n in enumerate(nodes)}
        out_node = next(iter(gm.graph.find_nodes(op="output")))
        flat_outs = list(out_node.args[0])
        fwd_outputs = [index[o] for o in flat_outs[:num_fwd_outputs] if isinstance(o, fx.Node)]
        bwd_outputs = [index[o] for o in flat_outs[num_fwd_outputs:] if isinstance(o, fx.Node)]

        inputs = [[index[a] for a in n.all_input_nodes] for n in nodes]
        users: list[list[int]] = [[] for _ in nodes]
        for i, ins in enumerate(inputs):
            for j in dict.fromkeys(ins):
                users[j].append(i)

        kind = sides(nodes, index, inputs, users, fwd_outputs)

        is_sym = [tp.is_sym_node(n) for n in nodes]
        storage, storage_bytes = node_storages(nodes, storage_remap)
        backward = [k == BWD for k in kind]
        if fusing:
            storage, storage_bytes = concatenated_in_place(nodes, users, storage, storage_bytes, backward)

        descs = list(out_node.meta.get("desc") or [])
        banned = run_once(nodes, index, inputs, kind, storage, flat_outs[:num_fwd_outputs], descs)
        released = {}
        if not keep_outputs:  # what the step returns as it is (AOTAutograd's plain outputs)
            for out, desc in zip(flat_outs[:num_fwd_outputs], descs[:num_fwd_outputs], strict=True):
                if type(desc).__name__ == "PlainAOTOutput" and isinstance(out, fx.Node):
                    released[index[out]] = desc.idx

        cost_s = [cost.node_seconds(n) for n in nodes]
        tangent_users = [u for i in range(len(nodes)) if kind[i] == TANGENT for u in users[i]]
        first_bwd = min(tangent_users) if tangent_users else len(nodes)
        materialized = [True] * len(storage_bytes)
        fusible, folded = kernels.kernel_ops(nodes, users) if fusing else ([], set())
        if fusing:
            materialized = buffers.materialized_storages(nodes, users, storage, len(storage_bytes), fusible, folded)
        # A fusing compiler decomposes the ops _TRANSIENT lists; library kernels it calls as they are.
        transient = [workspace_bytes(n, fusing, channels_last) + (0 if fusing else transient_bytes(n)) for n in nodes]
        inlinable = [kernels.is_inlinable(n) for n in nodes] if fusing else []
        copied = buffers.copied_per_reader((nodes, inputs, users, storage), materialized, fusible, inlinable, backward)
        for i in copied:
            materialized[storage[i]] = False
        forward_stored: set[int] = set()
        if fusing:
            stored = buffers.stored_on_reuse(nodes, inputs, users, storage, materialized, inlinable, backward)
            buffers.store_reused((nodes, inputs, users, storage), backward, materialized, fusible, inlinable, stored)
            forward_stored = buffers.stored_in_forward(users, storage, backward, materialized, inlinable, stored)
            forward_stored -= {storage[i] for i in copied}  # copied for each attention call instead
        return cls(
            fusible=fusible,
            folded=frozenset(folded),
            inlinable=inlinable,
            copied_per_reader=frozenset(copied),
            stored_in_forward=frozenset(forward_stored),
            transient=transient,
            materialized=materialized,
            gm=gm,
            num_fwd_outputs=num_fwd_outputs,
            nodes=nodes,
            index=index,
            kind=kind,
            inputs=inputs,
            users=users,
            storage=storage,
            storage_bytes=storage_bytes,
            banned=banned,
            cost_s=cost_s,
            fwd_outputs=fwd_outputs,
            bwd_outputs=bwd_outputs,
            first_bwd=first_bwd,
            is_sym=is_sym,
            released_outputs=released,
        )

    def nbytes(self, i: int) -> int:
        sid = self.storage[i]
        return self.storage_bytes[sid] if sid >= 0 else 0

    def boundary(self) -> list[int]:
        """Forward nodes the backward reads directly: what eager autograd would save."""
        out = {j for i in range(len(self.nodes)) if self.kind[i] == BWD for j in self.inputs[i]}
        return sorted(j for j in out if self.kind[j] == FWD)

    def primal_bytes(self) -> int:
        seen = {self.storage[i] for i, k in enumerate(self.kind) if k == PRIMAL and self.storage[i] >= 0}
        return sum(self.storage_bytes[s] for s in seen)

    def is_view(self, i: int) -> bool:
        """Whether node `i` holds a storage one of its inputs holds (a view of it)."""
        s = self.storage[i]
        return s >= 0 and any(self.storage[j] == s for j in self.inputs[i])

    @functools.cached_property
    def forward_nodes(self) -> list[int]:
        """The forward's nodes, in the order the forward runs them (graph order)."""
        return [i for i, k in enumerate(self.kind) if k == FWD]

    @functools.cached_property
    def tangent_nodes(self) -> list[int]:
        return [i for i, k in enumerate(self.kind) if k == TANGENT]

    @functools.cached_property
    def _backward_inputs(self) -> frozenset[int]:
        return frozenset(j for i, k in enumerate(self.kind) if k not in (FWD, PRIMAL) for j in self.inputs[i])

    def read_back(self, recomputed: Iterable[int]) -> set[int]:
        """The nodes whose values the backward reads: the inputs of its own nodes and of the
        forward nodes it computes again (`recomputed`). Of the forward's values, the forward
        returns only those (`emit.emit_graphs`), and only those are held to the backward."""
        return self._backward_inputs | {j for i in recomputed for j in self.inputs[i]}

    @functools.cached_property
    def there_before_backward(self) -> list[bool]:
        """Per node, whether the backward has it whatever is saved: inputs, gradients of the
        outputs, symbolic sizes the forward computes, and forward values whose storage the step
        keeps to its end anyway (what it returns: read, never computed a second time)."""
        kept = self.kept_to_end
        return [
            k in (PRIMAL, TANGENT) or (k == FWD and (self.is_sym[i] or self.storage[i] in kept))
            for i, k in enumerate(self.kind)
        ]

    @functools.cached_property
    def primal_storages(self) -> frozenset[int]:
        """Storages of parameters, buffers and inputs."""
        return frozenset(self.storage[i] for i, k in enumerate(self.kind) if k == PRIMAL and self.storage[i] >= 0)

    @functools.cached_property
    def forward_last_reads(self) -> dict[int, int]:
        """Storage -> the last forward step that makes or reads it."""
        return self.last_reads(self.forward_nodes)

    def last_reads(self, order: list[int], start: int = 0) -> dict[int, int]:
        """Storage -> the last step of `order`, from `start` on, that makes or reads it."""
        touched = self.touched
        return {s: t for t in range(start, len(order)) for s in touched[order[t]]}

    @functools.cached_property
    def call_outputs(self) -> dict[int, list[tuple[int, int]]]:
        """Multi-output library calls -> (part, its storage) for each output part that holds a
        storage the call does not read (see `schedule.outputs_made_at`)."""
        out: dict[int, list[tuple[int, int]]] = {}
        for i, s in enumerate(self.storage):
            if s >= 0 or (self.fusible and self.fusible[i]):
                continue
            read = {self.storage[j] for j in self.inputs[i]}
            parts = [(u, self.storage[u]) for u in self.users[i] if u in self.tuple_parts]
            parts = [(u, su) for u, su in parts if su >= 0 and su not in read]
            if parts:
                out[i] = parts
        return out

    @functools.cached_property
    def computed_in_readers(self) -> list[bool]:
        """Per node: a value a fusing compiler computes again in each reader's kernel when it
        is not stored (element-wise, a reduction only a concatenation reads, a matmul folded
        into its reader's add), so its inputs live until its last reader (see
        `simulate._extend_through_unstored`). Whether it is stored depends on the plan."""
        if not self.fusible:
            return [False] * len(self.nodes)
        return [
            s >= 0 and (self.inlinable[i] or (self.fusible[i] and self._only_concatenated(i)) or i in self.folded)
            for i, s in enumerate(self.storage)
        ]

    def _only_concatenated(self, i: int) -> bool:
        """Whether concatenations are all that read node `i`."""
        return bool(self.users[i]) and all(kernels.op_name(self.nodes[u]) == "cat" for u in self.users[i])

    @functools.cached_property
    def layouts(self) -> list[tuple[tuple[int, ...], tuple[int, ...]] | None]:
        """Per node, `kernels.layout`: its value's shape and strides."""
        return [kernels.layout(n) for n in self.nodes]

    @functools.cached_property
    def dense_numel(self) -> list[int]:
        """Per node, `kernels.dense_numel`: its value's elements when dense, else -1."""
        return [kernels.dense_numel(n) for n in self.nodes]

    @functools.cached_property
    def tuple_parts(self) -> frozenset[int]:
        """The nodes that take one output of a multi-output op (`getitem`)."""
        return frozenset(i for i, n in enumerate(self.nodes) if n.target is operator.getitem)

    @functools.cached_property
    def kept_to_end(self) -> frozenset[int]:
        """Storages alive to the step's end whatever is saved: what it returns (unless the
        caller lets it go before the backward) and the gradients; on torch < 2.13 also the
        gradients of what it returns (`_torch_private.TANGENTS_HELD_THROUGH_BACKWARD`)."""
        outputs = [i for i in self.fwd_outputs if i not in self.released_outputs] + self.bwd_outputs
        if tp.TANGENTS_HELD_THROUGH_BACKWARD:
            outputs += self.tangent_nodes
        return frozenset(self.storage[i] for i in outputs if self.storage[i] >= 0)

    @functools.cached_property
    def read_not_recomputed(self) -> frozenset[int]:
        """Storages a plan reads rather than computes again: those kept to the end, and the
        other outputs of a library call that makes one of them (computing the call again would
        write a second copy of the kept one: a LayerNorm's mean and inverse deviation, beside
        the normalised features the step returns)."""
        kept = self.kept_to_end
        out = set(kept)
        for parts in self.call_outputs.values():
            if any(s in kept for _, s in parts):
                out.update(s for _, s in parts)
        return frozenset(out)

    @functools.cached_property
    def storage_maker(self) -> list[int]:
        """Per storage, the first node that holds it: the op that made it (its views and the
        parts of a split come later)."""
        return [held[0] if held else -1 for held in self.storage_nodes]

    @functools.cached_property
    def heavy(self) -> list[bool]:
        """Per node, whether a value several kernels read is stored for it (`buffers.is_heavy`)."""
        return [buffers.is_heavy(n) for n in self.nodes]

    @functools.cached_property
    def storage_nodes(self) -> list[list[int]]:
        """Per storage, the nodes that hold it (its maker, then its views), in graph order."""
        nodes: list[list[int]] = [[] for _ in self.storage_bytes]
        for i, s in enumerate(self.storage):
            if s >= 0:
                nodes[s].append(i)
        return nodes

    @functools.cached_property
    def storage_readers(self) -> list[list[int]]:
        """Per storage, the nodes that read it, directly or through its views, and do not hold
        it themselves."""
        return [
            [u for j in held for u in self.users[j] if self.storage[u] != s]
            for s, held in enumerate(self.storage_nodes)
        ]

    @functools.cached_property
    def readers_by_side(self) -> list[tuple[int, bool, tuple[int, ...]]]:
        """Per storage, of its `storage_readers`: how many are backward nodes, whether those
        are all fusible, and the rest (forward nodes, which the backward may run again)."""
        out = []
        for readers in self.storage_readers:
            backward = [u for u in readers if self.kind[u] == BWD]
            fusible = not self.fusible or all(self.fusible[u] for u in backward)
            out.append((len(backward), fusible, tuple(u for u in readers if self.kind[u] != BWD)))
        return out

    @functools.cached_property
    def written_by_readers(self) -> list[int]:
        """Fusible nodes a fusing compiler may compute late, when a library call that reads them
        does (see `schedule.as_realized`): element-wise values (and copies into another
        layout) written to storages of their own. Not a gradient: one that other ops read too
        is written where it stands, as the graph returns it."""
        if not self.fusible:
            return []
        returned = {self.storage[o] for o in self.bwd_outputs}
        return [
            i
            for i, s in enumerate(self.storage)
            if s >= 0
            and s not in returned
            and self.fusible[i]
            and self.materialized[s]
            and self.storage_maker[s] == i
            and (self.inlinable[i] or self.nodes[i].meta.get(kernels.LAYOUT_COPY, False))
        ]

    @functools.cached_property
    def early_gradients(self) -> frozenset[int]:
        """Gradients a fusing compiler reduces from a larger backward value (a bias's, summed
        over the rows of its output's gradient): the backward makes them as soon as it can, so
        the larger value is not held for them past the matmuls that read it too."""
        if not self.fusible:
            return frozenset()
        out = set()
        for o in self.bwd_outputs:
            s = self.storage[o]
            if s < 0 or self.kind[o] != BWD:
                continue
            after, made_by = self._views_read(o)  # the gradient may be a view of the sum
            i = made_by[0] if len(made_by) == 1 else -1
            if i < 0 or self.kind[i] != BWD or not self.fusible[i] or self.inlinable[i]:
                continue
            before, reads = self._views_read(i)
            if any(self.kind[j] == BWD and self.storage_bytes[s] < self.nbytes(j) for j in reads):
                out.update((o, i, *after, *before))
        return frozenset(out)

    @functools.cached_property
    def shrinking(self) -> frozenset[int]:
        """Forward nodes that make less than the largest forward value they read (views,
        reductions): recomputed, they may join the backward as soon as their inputs are back
        (see `schedule.backward_order`); larger ones wait until a reader asks for them."""
        out = set()
        for u in range(self.first_bwd):
            if self.kind[u] != FWD:
                continue
            made_by = self.users[u] if self.storage[u] < 0 else [u]  # a multi-output op: its parts
            own = {self.storage[j] for j in made_by if self.storage[j] >= 0}
            read = {self.storage[j] for j in self.inputs[u] if self.kind[j] == FWD and self.storage[j] >= 0}
            made = sum(self.storage_bytes[s] for s in own - read)
            if made < max((self.storage_bytes[s] for s in read), default=0):
                out.add(u)
        return frozenset(out)

    def _views_read(self, i: int) -> tuple[list[int], list[int]]:
        """The views node `i` reads through (a bias gradient sums a reshaped gradient), and
        what they are views of."""
        views, reads, todo = [], [], [i]
        while todo:
            j = todo.pop()
            if j == i or (self.kind[j] == BWD and self.is_view(j)):
                views.append(j)
                todo.extend(self.inputs[j])
            else:
                reads.append(j)
        return views[1:], reads

    @functools.cached_property
    def backward_roots(self) -> list[int]:
        """The backward nodes from the first that reads a gradient on, less those run only when
        a reader needs them (`deferred`): the order the backward asks for its nodes in (see
        `schedule.backward_order`)."""
        deferred = self.deferred
        return [i for i in range(self.first_bwd, len(self.nodes)) if self.kind[i] == BWD and i not in deferred]

    @functools.cached_property
    def may_join_early(self) -> list[bool]:
        """Per node, whether the backward may run it before anything asks for it (see
        `schedule.backward_order`): an early gradient, a part of a multi-output op, or a node
        that stands before the gradients in the graph."""
        early, parts = self.early_gradients, self.tuple_parts
        return [u in early or u in parts or u < self.first_bwd for u in range(len(self.nodes))]

    @functools.cached_property
    def materialized_bytes(self) -> list[int]:
        """Per storage, its bytes if a fusing compiler writes it out, else 0."""
        return [b if m else 0 for b, m in zip(self.storage_bytes, self.materialized, strict=True)]

    @functools.cached_property
    def touched(self) -> list[tuple[int, ...]]:
        """Per node, the storages it makes or reads, each once: its own first, then its
        inputs' in order."""
        out = []
        for i, own in enumerate(self.storage):
            sids = [own] if own >= 0 else []
            for j in self.inputs[i]:
                s = self.storage[j]
                if s >= 0 and s not in sids:
                    sids.append(s)
            out.append(tuple(sids))
        return out

    @functools.cached_property
    def input_storages(self) -> list[tuple[int, ...]]:
        """Per node, the storages its inputs hold, each once, in order, less its own."""
        return [tuple(s for s in sids if s != own) for sids, own in zip(self.touched, self.storage, strict=True)]

    @functools.cached_property
    def forward_candidates(self) -> list[int]:
        """The forward's steps that run a value `computed_in_readers`."""
        candidate = self.computed_in_readers
        return [t for t, i in enumerate(self.forward_nodes) if candidate[i]]

    @functools.cached_property
    def in_place_answers(self) -> dict[tuple[int, int], list[tuple[tuple[int, ...], tuple[bool, ...], bool]]]:
        """Answers of `in_place.reads_in_place` so far, per (node, the buffer's maker): the
        storages each asked whether they are stored, their answers, and its own."""
        return {}

    @functools.cached_property
    def early_joiners(self) -> list[list[int]]:
        """Per node, its readers that may join the backward early (`may_join_early`)."""
        may_join = self.may_join_early
        return [[u for u in users if may_join[u]] for users in self.users]

    @functools.cached_property
    def deferred(self) -> frozenset[int]:
        """Backward library calls the schedule runs only when a reader first needs them.

        An input's gradient `dY @ W.T` is as large as the activation it belongs to, while the
        weight's gradient beside it reads a recomputed activation: in graph order the first is
        alive while the second's input is recomputed, three activations at once. A library
        call whose output outweighs the inputs it might free, read only by later backward
        nodes and no gradient itself, is brought in just before its first reader instead
        (see `schedule.backward_order`)."""
        outputs = set(self.bwd_outputs)
        out = set()
        for i in range(self.first_bwd, len(self.nodes)):
            s = self.storage[i]
            if self.kind[i] != BWD or s < 0 or i in outputs or not self.users[i]:
                continue
            if (self.fusible and self.fusible[i]) or any(self.kind[u] != BWD or u < i for u in self.users[i]):
                continue
            freed = sum(self.nbytes(j) for j in self.inputs[i] if self.kind[j] != PRIMAL)
            if self.storage_bytes[s] > freed:
                out.add(i)
        return frozenset(out)
