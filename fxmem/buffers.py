"""Which values a fusing compiler (inductor) writes to memory, as the simulation models it.

A value is stored when a library call, a reduction or an as_strided view reads it, when the
element-wise code behind it grows too costly to compute again in every reader (heavy ops, too
many buffers read), and when several kernels read it; otherwise each reader's kernel computes
it again, element by element, and it never has a buffer. Which ops are fused or computed
inline is in `fxmem.kernels`. Each rule was checked against inductor's generated code.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence

import torch
import torch.fx as fx

from fxmem import _torch_private as tp
from fxmem.kernels import LAID_OUT_READERS, LAYOUT_COPY, SCATTERS, any_between, op_name, reach
from fxmem.nodes import one_element

__all__ = [
    "copied_per_reader",
    "inline_code",
    "is_costly",
    "is_heavy",
    "materialized_storages",
    "store_reused",
    "stored_in_forward",
    "stored_on_reuse",
]


# Fusible ops whose result is written out whoever reads it: a concatenation is a buffer its
# inputs are copied into, by loops fused with the kernel around them.
_WRITTEN_OUT = {"cat"} | SCATTERS  # and a scatter's buffer, filled by mutating it

# Views inductor takes of a buffer laid out exactly as traced: it writes their input out (a
# group norm's per-channel scale and shift, made (N, C) by as_strided).
_STRIDED_READS = {"as_strided"}


def materialized_storages(
    nodes: list[fx.Node], users: list[list[int]], storage: list[int], count: int, fusible: list[bool], folded: set[int]
) -> list[bool]:
    """A storage is written to memory when some value in it is read by a non-fusible op (an
    add folded into an addmm counts as one; the mm's own product is never written) or by an
    as_strided view. `fusible` and `folded` come from `kernel_ops`."""
    mat = [False] * count
    for i, n in enumerate(nodes):
        s = storage[i]
        if s < 0 or i in folded:
            continue
        if n.op == "placeholder" or not fusible[i] or op_name(n) in _WRITTEN_OUT or n.meta.get(LAYOUT_COPY):
            mat[s] = True
        elif any(not fusible[u] or op_name(nodes[u]) in _STRIDED_READS for u in users[i]) or not users[i]:
            mat[s] = True
    return mat


def copied_per_reader(
    graph: tuple, mat: list[bool], fusible: list[bool], inlinable: list[bool], backward: list[bool]
) -> set[int]:
    """Element-wise values on CPU, loaded from one buffer, that no library call reads but
    attention kernels, directly or through views (OPT's scaled queries, viewed per head and
    transposed): inductor stores none of them. Each attention call that reads one gets
    a copy in its own layout, made right before the call and freed after it, and what the
    value is computed from lives until the last such call. A value recomputed in the backward
    for the forward attention and read again by the attention's backward (HF Llama's values, a
    contiguous copy of a slice of the fused projection) is two copies of a quarter of that
    projection, and the whole projection lives from one call to the other. A value loaded from
    more than one place (the rotary embedding of the queries: two halves, cos and sin) is
    stored once when several ops read it (inductor's `realize_hint`), and so is one whose code
    applies a heavy op (`is_heavy`: a mask two layers' attention read, the sigmoid of a table;
    copied per call, the plan was 5 MiB under the measured peak and broke its budget). `mat`
    marks these values stored (read by a library call); the caller unmarks them. A
    one-element input (a loss's gradient; a view of one, expanded, is judged by it) is no
    load, and a forward value the backward reads is one: the backward is compiled apart and
    reads it from memory (a residual stream whose square's gradient an attention's backward
    reads). `graph`: (nodes, inputs, users, storage)."""
    nodes, inputs, users, storage = graph
    holders: dict[int, list[int]] = {}  # storage -> the value and its views, in graph order
    for j, s in enumerate(storage):
        if s >= 0:
            holders.setdefault(s, []).append(j)
    loads = [0] * len(nodes)  # loads in the element-wise code computing each value
    heavy = [False] * len(nodes)  # whether that code applies a heavy op
    copied: set[int] = set()
    for i, n in enumerate(nodes):
        s = storage[i]
        if s < 0 or not inlinable or not inlinable[i]:
            continue
        inline = [
            j
            for j in inputs[i]
            if storage[j] >= 0 and not mat[storage[j]] and inlinable[j] and backward[j] == backward[i]
        ]
        loaded = sum(
            1
            for j in inputs[i]
            if storage[j] >= 0 and j not in inline and not one_element(nodes[holders[storage[j]][0]])
        )
        loads[i] = loaded + sum(loads[j] for j in inline)
        heavy[i] = is_heavy(n) or any(heavy[j] for j in inline)
        if holders[s][0] != i:
            continue  # a view of a value: judged with it
        readers = [u for j in holders[s] for u in users[j] if storage[u] != s]
        val = n.meta.get("val")
        library = [u for u in readers if not fusible[u]]
        if (
            loads[i] <= 1
            and not (heavy[i] and len(readers) > 1)
            and library
            and all(op_name(nodes[u]) in LAID_OUT_READERS for u in library)
            and not any(op_name(nodes[u]) in _STRIDED_READS for j in holders[s] for u in users[j])
            and op_name(n) not in _WRITTEN_OUT
            and not n.meta.get(LAYOUT_COPY)
            and isinstance(val, torch.Tensor)
            and val.device.type == "cpu"
        ):
            copied.add(i)
    return copied


def _store_for_reads(graph: tuple, mat: list[bool], inlinable: list[bool], backward: list[bool]) -> None:
    """Mark written out the element-wise values a fusing compiler stores because the values it
    computes inline behind them read more stored buffers than it allows
    (`tp.inductor_max_accumulated_reads`: 12 on CPU, 8 on GPUs); their readers read that one
    buffer. Its kernel is fused with its readers': read by element-wise loops alone, the buffer
    is local to that kernel and never allocated (BEiT's layer-norm gradients); read by a
    scatter, it is (T5's attention-bias gradient, a sum of sixteen per-chunk gradients,
    before its scatter into the bias table's gradient). The forward's and the backward's
    graphs are compiled apart: a forward value the backward reads is a buffer there."""
    nodes, inputs, users, storage = graph
    limit = functools.cache(tp.inductor_max_accumulated_reads)
    reads: list[frozenset[int]] = [frozenset()] * len(nodes)
    for i, n in enumerate(nodes):
        s = storage[i]
        if s < 0:
            continue
        r, _ = _inline_reads(
            inputs[i], storage, reads, lambda j, b=backward[i]: mat[storage[j]] or not inlinable[j] or backward[j] != b
        )
        val = n.meta.get("val")
        pointwise = torch.Tag.pointwise in getattr(n.target, "tags", ()) and isinstance(val, torch.Tensor)
        if pointwise and not mat[s] and inlinable[i] and len(r) > limit(val.device.type):
            r = {s}  # its readers read it
            mat[s] = _scattered(i, nodes, users, storage, mat, inlinable)
        reads[i] = frozenset({s}) if mat[s] else frozenset(r)


def _inline_reads(
    inputs: list[int],
    storage: list[int],
    reads: Mapping[int, frozenset[int]] | Sequence[frozenset[int]],
    is_buffer: Callable[[int], bool],
) -> tuple[set[int], list[int]]:
    """The stored buffers a node with these inputs reads, directly or through the values its
    kernel computes inline (their own `reads`), and those inline inputs; `is_buffer(j)`: input
    `j` is read from memory."""
    r: set[int] = set()
    inline: list[int] = []
    for j in inputs:
        if storage[j] < 0:
            continue
        if is_buffer(j):
            r.add(storage[j])
        else:
            inline.append(j)
            r |= reads[j]
    return r, inline


def _scattered(
    i: int, nodes: list[fx.Node], users: list[list[int]], storage: list[int], mat: list[bool], inlinable: list[bool]
) -> bool:
    """Whether a scatter reads node `i`'s value, through its views and values computed inline."""

    def onward(j: int) -> list[int]:
        s = storage[j]
        inline = s >= 0 and (s == storage[i] or (inlinable[j] and not mat[s]))
        return users[j] if inline else []

    return any(op_name(nodes[u]) in SCATTERS for u in reach(users[i], onward))


MAX_INLINED_READS = 4  # inductor's realize_reads_threshold


def is_heavy(node: fx.Node) -> bool:
    """Whether inductor stores the value of `node`, or of element-wise code computing it, that
    several kernels read, rather than computing it again in each (see `stored_on_reuse`)."""
    val = node.meta.get("val")
    return isinstance(val, torch.Tensor) and val.device.type == "cpu" and op_name(node) in tp.HEAVY_ON_CPU


def inline_code(
    own_heavy: bool,
    inputs: list[int],
    storage: list[int],
    reads: Mapping[int, frozenset[int]] | Sequence[frozenset[int]],
    heavy: Mapping[int, bool] | Sequence[bool],
    is_buffer: Callable[[int], bool],
) -> tuple[bool, frozenset[int]]:
    """The element-wise code computing a value from `inputs`: whether it applies a heavy op
    (`own_heavy`, or an input computed inline does), and the stored buffers it reads, directly
    or through inputs computed inline (`reads` and `heavy` of those), at most one past
    `MAX_INLINED_READS`; `is_buffer(j)`: input `j` is read from memory."""
    r, inline = _inline_reads(inputs, storage, reads, is_buffer)
    return own_heavy or any(heavy[j] for j in inline), frozenset(sorted(r)[: MAX_INLINED_READS + 1])


def is_costly(heavy: bool, reads: frozenset[int]) -> bool:
    """Whether inductor stores code so (`inline_code`) that several kernels read. Code that
    reads no buffer it computes inside each reader, heavy op included: a computed buffer that
    loads nothing is inlined into whatever loads it."""
    return bool(reads) and (heavy or len(reads) > MAX_INLINED_READS)


def stored_on_reuse(
    nodes: list[fx.Node],
    inputs: list[list[int]],
    users: list[list[int]],
    storage: list[int],
    mat: list[bool],
    inlinable: list[bool],
    backward: list[bool],
) -> list[bool]:
    """Per node: a fusing compiler stores its value when more than one kernel reads it.

    A pointwise value that is not written out is computed inside the kernel of each of its
    readers. Inductor does that while the computation is cheap: it stores the value instead
    when the chain of unstored ops behind it applies a heavy op (exp, log, ...; on CPU) or
    reads more than four stored buffers, unless it reads none (`is_costly`: T5's relative
    position buckets, index arithmetic with a log; the bias lookup reading them, the log
    computed inside it, is the value stored). A value so stored because several ops of its
    graph read it (the value or a view of it) is a buffer its readers in that graph read, not a
    chain they compute: a batch norm's recomputed output, read by the ReLU6 mask's two
    comparisons, leaves the masked gradient two reads and so unstored. `backward` tells the
    nodes of the backward graph; a forward value read there counts its backward readers.
    First, values stored for the buffers they read are marked in `mat` (`_store_for_reads`).
    The values a plan computes again in the backward are judged again by `simulate`, where
    what that plan saves is a buffer.
    """
    _store_for_reads((nodes, inputs, users, storage), mat, inlinable, backward)
    heavy = [False] * len(nodes)
    reads: list[frozenset[int]] = [frozenset()] * len(nodes)
    costly = [False] * len(nodes)
    reused: tuple[set[int], set[int]] = (set(), set())  # storages stored so, in the forward's graph, the backward's
    for i, n in enumerate(nodes):
        heavy[i], reads[i] = inline_code(
            is_heavy(n),
            inputs[i],
            storage,
            reads,
            heavy,
            lambda j, b=backward[i]: mat[storage[j]] or not inlinable[j] or storage[j] in reused[b],
        )
        costly[i] = is_costly(heavy[i], reads[i])
        if costly[i] and storage[i] >= 0:
            for graph in (False, True):
                if sum(1 for u in users[i] if backward[u] == graph) > 1:
                    reused[graph].add(storage[i])
    return costly


def store_reused(
    graph: tuple,
    backward: list[bool],
    mat: list[bool],
    fusible: list[bool],
    inlinable: list[bool],
    stored: list[bool],
) -> None:
    """Mark written out the backward values several ops read that a fusing compiler stores
    rather than computing them in each (see `stored_on_reuse`; LayerNorm's input gradient
    read by an embedding's two gradient scatters). A view among the readers counts as one, as
    inductor counts it (ConvNeXt's LayerNorm gradient, read by a permute and an add). Forward
    values are judged in the forward by `stored_in_forward`, and where the plan computes them
    again by `simulate`'s `inlined`. A value whose readers all feed one element-wise value
    written out (through values computed inline: a SiLU's sigmoid, read twice by its
    gradient) is computed in that value's loop, its buffer dropped (UNet's SiLU gradients
    before their group norm's backward), when both loops run over the same nest and no library
    call runs between them (fxmem keeps inductor from fusing across one: the sigmoid of a gate
    projection fused with q/k/v, whose gradient is written into the concatenation of all five
    after the attention's backward); one a reduction reads, or two written values, is read by
    loops of its own (a batch norm's backward sums). `graph`: (nodes, inputs, users, storage)."""
    nodes, inputs, users, storage = graph
    calls = [k for k, n in enumerate(nodes) if not fusible[k] and n.op == "call_function"]
    for i in range(len(storage) - 1, -1, -1):  # readers first: whether they are written
        s = storage[i]
        if not backward[i] or s < 0 or mat[s] or not inlinable[i] or not stored[i]:
            continue
        readers = [u for u in users[i] if fusible[u]]
        if len(readers) > 1 and not _one_loop(i, graph, mat, inlinable, calls):
            mat[s] = True


def stored_in_forward(
    users: list[list[int]],
    storage: list[int],
    backward: list[bool],
    mat: list[bool],
    inlinable: list[bool],
    stored: list[bool],
) -> set[int]:
    """Storages of the forward's element-wise values a fusing compiler stores in the forward's
    graph, where several of its ops read them and their code is costly (`stored_on_reuse`):
    T5's decoder position bias, a lookup whose buckets apply a log, read by each chunk of both
    layers' self-attention. Read only inside the kernel computing it, such a value is a local
    of that kernel and never allocated (`simulate` tells). `mat` marks what is written out
    anyway; in the backward, a value the plan computes again is judged there (`simulate`'s
    `judge`)."""
    return {
        storage[i]
        for i in range(len(storage))
        if stored[i]
        and not backward[i]
        and inlinable[i]
        and storage[i] >= 0
        and not mat[storage[i]]
        and sum(1 for u in users[i] if not backward[u]) > 1
    }


def _one_loop(i: int, graph: tuple, mat: list[bool], inlinable: list[bool], calls: list[int]) -> bool:
    """Whether what node `i`'s readers compute inline from it ends in one element-wise value
    written out, in a loop nest of the same sizes as `i`'s own and with no library call
    (`calls`: their positions) between `i` and it: the loop writing that value computes `i`
    too, and no other loop reads `i`. A concatenation's input is written out, into the
    concatenation's buffer, where the concatenation is (the SiLU gradient of fused gate and up
    projections, beside the up projection's gradient). On CPU, where the nests differ, `i`'s loop writes it to a buffer
    the other reads (a batch norm's output, whose loop runs over N*H*W and C, read by a SiLU's
    gradient that adds a mean pooling's gradient: N, H*W and C). Inductor's GPU kernels fuse loops over as many elements whatever their sizes."""
    nodes, inputs, users, storage = graph

    def written(u: int) -> bool:  # to a buffer of its own, or to its part of a concatenation's
        return mat[storage[u]] or any(op_name(nodes[r]) == "cat" for r in users[u])

    def inline(u: int) -> list[int]:  # readers of a value computed inline, not written out
        return users[u] if inlinable[u] and storage[u] >= 0 and not written(u) else []

    ends: set[int] = set()
    for u in reach(users[i], inline):
        if not inlinable[u] or storage[u] < 0:
            return False  # a reduction or a library call reads it
        if written(u):
            ends.add(u)
            if len(ends) > 1:
                return False
    if len(ends) != 1:
        return False
    (end,) = ends
    written_at = next((r for r in users[end] if op_name(nodes[r]) == "cat"), end)
    if any_between(calls, i, written_at):
        return False
    val = nodes[i].meta.get("val")
    if not isinstance(val, torch.Tensor) or val.device.type != "cpu":
        return True

    def is_buffer(j: int) -> bool:
        return j != i and (storage[j] < 0 or mat[storage[j]] or not inlinable[j])

    mine, theirs = _loop_sizes(i, nodes, inputs, is_buffer), _loop_sizes(end, nodes, inputs, is_buffer)
    return mine is None or theirs is None or mine == theirs


# Views whose dimensions map onto their input's one to one, size-1 dimensions aside (expand is
# read as a broadcast).
_SAME_DIMS = {"view", "_unsafe_view", "reshape", "unsqueeze", "squeeze", "alias", "clone"}


def _loop_sizes(
    i: int, nodes: list[fx.Node], inputs: list[list[int]], is_buffer: Callable[[int], bool]
) -> tuple[int, ...] | None:
    """The sizes of the loop nest that computes element-wise node `i`, as inductor simplifies
    it: its dimensions in its layout's order (outermost first), size-1 ones dropped, and two
    adjacent ones merged when every buffer its loop reads (through values computed inline;
    `is_buffer(j)`: node `j` is read from memory) varies along both or along neither. None
    where a view between them is not followed (a reshape that merges dimensions)."""
    val = nodes[i].meta.get("val")
    if not isinstance(val, torch.Tensor):
        return None
    dims = [d for d in sorted(range(val.dim()), key=lambda d: -val.stride(d)) if val.shape[d] != 1]
    masks: set[frozenset[int]] = set()
    # (node, for each of its dimensions the dimension of `i` it runs along, or None)
    todo: list[tuple[int, list[int | None]]] = [(i, list(range(val.dim())))]
    seen: set[tuple[int, tuple]] = set()
    while todo:
        u, along = todo.pop()
        if (u, tuple(along)) in seen:
            continue
        seen.add((u, tuple(along)))
        out = nodes[u].meta.get("val")
        for j in inputs[u]:
            x = nodes[j].meta.get("val")
            if not isinstance(x, torch.Tensor) or x.dim() == 0:
                continue
            mapped = _input_dims(nodes[u], out, x, along)
            if mapped is None:
                return None
            if is_buffer(j):
                masks.add(frozenset(d for d in mapped if d is not None and val.shape[d] != 1))
            else:
                todo.append((j, mapped))
    sizes: list[int] = []
    prev = None
    for d in dims:
        if prev is not None and all((prev in m) == (d in m) for m in masks):
            sizes[-1] *= val.shape[d]
        else:
            sizes.append(int(val.shape[d]))
        prev = d
    return tuple(sizes)


def _input_dims(node: fx.Node, out: torch.Tensor, x: torch.Tensor, along: list[int | None]) -> list[int | None] | None:
    """For each dimension of input `x` of `node` (whose output `out` runs along `along`), the
    dimension it runs along (None: broadcast, or size 1); None when not followed."""
    name = op_name(node)
    if name == "permute":
        perm = node.args[1]
        res: list[int | None] = [None] * x.dim()
        for k, p in enumerate(perm):
            res[p % x.dim()] = along[k]
        return res
    if torch.Tag.pointwise in getattr(node.target, "tags", ()) or name in ("where", "expand"):
        if x.dim() > out.dim():
            return None
        off = out.dim() - x.dim()
        return [None if x.shape[d] == 1 else along[d + off] for d in range(x.dim())]
    if name in _SAME_DIMS:
        big_out = [d for d in range(out.dim()) if out.shape[d] != 1]
        big_x = [d for d in range(x.dim()) if x.shape[d] != 1]
        if [out.shape[d] for d in big_out] != [x.shape[d] for d in big_x]:
            return None
        res = [None] * x.dim()
        for dx, do in zip(big_x, big_out, strict=True):
            res[dx] = along[do]
        return res
    return None
