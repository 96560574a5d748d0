"""Joint-graph cleanups that run before planning.

Functionalization leaves `clone` nodes where an op returned its input (dropout with p=0, say):
the values are equal and the graph is functional, so the copy only costs memory, and a plan
would save both. A clone is dropped when it keeps the layout, is not a graph output and does
not copy a graph input (AOTAutograd's output-aliasing bookkeeping depends on those).

A value the forward computes twice from the same inputs (a pass's per-layer copy of what
depends only on a shared input: `swap_sdpa`'s padded-rows mask, one (B, 1, T, T) copy a
layer) is computed once, where both copies are also read by the backward: each would be
alive until then, so one serves both for no longer than they were. Copies the backward does
not read are left apart (merged, one would live from the first reader to the last), and so
are the backward's own recomputations (merged with the forward's, the backward would read a
forward value).

The other way round, a copy inductor would make unseen is made a node of the graph: with a
convolution on CPU, inductor runs convolutions channels-last, so a graph input read by one (a
batch of images) is copied to channels-last, and that copy is what the backward keeps. As a
node the copy is counted, kept from the forward (inductor keeps one for the backward whatever
the plan says). So is the copy inductor makes for a view a channels-last value cannot take.
A gradient summed over many readers of one value (T5's attention bias, which every layer
adds to its scores) is a chain of adds in the backward, one as each layer's term arrives.
Inductor computes such a chain in the kernel that reads the sum, so every term stays alive
until the last: sixteen 4 MiB terms at once in the zoo's T5. Where library calls run between
the chain's first add and its last, each add is made `fxmem.opaque.add`, which writes the sum
as each term arrives (`realize_running_sums`; fusing compilers only).

Likewise the copy inductor makes of a view an attention call reads on CPU in a layout it does
not take (the one key and value of multi-query attention, repeated over the query heads by a
view): each call gets a dense copy, in the forward and again in the backward.

And where inductor would choose a layout for a value the forward saves that the plan cannot
count (channels-last for a value in (N, H, W, C)), the value is saved through a view that
inductor keeps as traced.
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Callable

import torch
import torch.fx as fx

from fxmem import _torch_private as tp
from fxmem import kernels, opaque
from fxmem.nodes import aliased_input, must_run_once, retrace_views
from fxmem.ops import storage_of

__all__ = [
    "LAID_STRIDE",
    "copy_conv_inputs_channels_last",
    "copy_expanded_attention_inputs",
    "copy_views_of_channels_last",
    "merge_repeated_values",
    "realize_running_sums",
    "remove_redundant_clones",
    "save_as_traced",
]

_CLONE = torch.ops.aten.clone.default
_CONVS = (torch.ops.aten.convolution.default, torch.ops.aten.convolution_backward.default)
_VIEWS = (torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default)
_BMM = torch.ops.aten.bmm.default
# node.meta key: the strides inductor gives the node's value where they are not the traced ones
# (written by copy_views_of_channels_last).
LAID_STRIDE = "fxmem_laid_stride"


def remove_redundant_clones(gm: fx.GraphModule) -> dict[int, int]:
    """Replace layout-preserving clones by their input.

    Returns, for each removed clone, its fake storage key -> its input's: views of the clone
    still carry the clone's storage in their metadata and now alias the input's.
    """
    output = next(iter(gm.graph.find_nodes(op="output")))
    outputs = set(output.all_input_nodes)
    remap: dict[int, int] = {}
    for node in list(gm.graph.find_nodes(op="call_function", target=_CLONE)):
        src = node.args[0]
        val, src_val = node.meta.get("val"), getattr(src, "meta", {}).get("val")
        if node in outputs or not isinstance(src, fx.Node) or src.op == "placeholder":
            continue
        if not isinstance(val, torch.Tensor) or not isinstance(src_val, torch.Tensor):
            continue
        if val.stride() != src_val.stride() or val.storage_offset() != src_val.storage_offset():
            continue
        if src_val.untyped_storage().nbytes() != val.untyped_storage().nbytes():
            continue  # the clone compacts a view of a larger storage: keep it
        _replace(node, src, remap)
    if remap:
        gm.recompile()
    return remap


_ADD = torch.ops.aten.add.Tensor
# A running sum is written out as its terms arrive only when they are at least this large:
# smaller ones cost little alive, and each written sum is a kernel of its own.
MIN_RUNNING_SUM_BYTES = 1 << 20
# ... and have at least four terms. Fewer are one layer's own: the gradients of its q, k and v
# projections' input, made one after another, are read as one sum by its norm's backward
# (written as they go, the zoo's Llama floor rose 0.6 MiB: each partial sum is a new buffer).
_MIN_RUNNING_SUM_ADDS = 3


def realize_running_sums(gm: fx.GraphModule, num_fwd_outputs: int) -> int:
    """Make the backward's chains of three or more adds that span library calls
    `fxmem.opaque.add`s; returns how many adds were. A chain: adds of two values of the
    result's size, dtype and strides, each but the last read only by the next."""
    graph = gm.graph
    output = next(iter(graph.find_nodes(op="output")))
    forward_outputs = [o for o in tp.tree_leaves(output.args)[:num_fwd_outputs] if isinstance(o, fx.Node)]
    forward = set(kernels.reach(forward_outputs, lambda node: node.all_input_nodes))
    order = {n: i for i, n in enumerate(graph.nodes)}
    calls = [order[n] for n in graph.nodes if n.op == "call_function" and not kernels.is_fusible(n)]

    def link(node: fx.Node) -> bool:
        if node.target is not _ADD or node in forward or node.kwargs or len(node.args) != 2:
            return False
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor) or val.numel() * val.element_size() < MIN_RUNNING_SUM_BYTES:
            return False
        return all(
            isinstance(a, fx.Node)
            and isinstance(v := a.meta.get("val"), torch.Tensor)
            and (v.shape, v.dtype, v.stride()) == (val.shape, val.dtype, val.stride())
            for a in node.args
        )

    def before(node: fx.Node) -> fx.Node | None:
        """The add of the chain before `node`: an argument that is a link read only by it."""
        return next((a for a in node.args if isinstance(a, fx.Node) and link(a) and len(a.users) == 1), None)

    made = 0
    seen: set[fx.Node] = set()
    for end in reversed(graph.nodes):  # a chain's last add comes first
        if end in seen or not link(end):
            continue
        chain = [end]
        while (prev := before(chain[-1])) is not None:
            chain.append(prev)
        seen.update(chain)
        if len(chain) < _MIN_RUNNING_SUM_ADDS or not kernels.any_between(calls, order[chain[-1]], order[end]):
            continue
        for node in chain:
            node.target = opaque.add._opoverload
        made += len(chain)
    if made:
        gm.recompile()
    return made


def _replace(node: fx.Node, kept: fx.Node, remap: dict[int, int]) -> None:
    """Read `kept` wherever `node` was read, and drop `node`; its storage's key -> `kept`'s goes
    into `remap` (views of `node` still carry its storage in their metadata)."""
    gone, stays = storage_of(node), storage_of(kept)
    if gone is not None and stays is not None and gone != stays:
        remap[gone] = stays
    node.replace_all_uses_with(kept)
    node.graph.erase_node(node)


def merge_repeated_values(gm: fx.GraphModule, num_fwd_outputs: int) -> dict[int, int]:
    """Compute once each value the forward computes twice and the backward reads both copies of.

    Two nodes compute the same value when both are a pure op overload (no mutation, no random
    draw) with the same target and arguments that compute the same values, and are computed
    for a forward output without being an output themselves. A later one is merged into the
    first when the backward reads both, or when every reader of it is merged (it is then only
    a step on the way to such a value: the padded-rows mask's comparison and row test).
    Returns, for each merged node, its fake storage key -> the kept one's (views of it carry
    its storage in their metadata).
    """
    graph = gm.graph
    output = next(iter(graph.find_nodes(op="output")))
    returned = set(output.all_input_nodes)
    forward_outputs = [o for o in tp.tree_leaves(output.args)[:num_fwd_outputs] if isinstance(o, fx.Node)]
    forward = set(kernels.reach(forward_outputs, lambda node: node.all_input_nodes))

    def pure(node: fx.Node) -> bool:
        if node.op != "call_function" or not tp.is_aten_op(node.target) or node not in forward or node in returned:
            return False
        return not must_run_once(node)

    # The first node computing each value, per node (value numbering in graph order).
    same: dict[fx.Node, fx.Node] = {}
    first: dict[tuple, fx.Node] = {}
    for node in graph.nodes:
        if not pure(node):
            continue
        args = fx.node.map_arg((node.args, node.kwargs), lambda a: same.get(a, a))
        try:
            same[node] = first.setdefault((node.target, _frozen(args)), node)
        except TypeError:  # an unhashable argument
            continue

    def read_by_backward(node: fx.Node) -> bool:
        return any(u not in forward for u in node.users)

    merged: set[fx.Node] = set()
    for node in reversed(graph.nodes):  # readers first
        kept = same.get(node, node)
        if kept is node:
            continue
        if (read_by_backward(node) and read_by_backward(kept)) or all(u in merged for u in node.users):
            merged.add(node)
    remap: dict[int, int] = {}
    for node in [n for n in graph.nodes if n in merged]:
        _replace(node, same[node], remap)
    if merged:
        gm.recompile()
    return remap


def _frozen(x: object) -> object:
    """`x` (node arguments) as a hashable key: lists as tuples, dicts as sorted items."""
    if isinstance(x, (list, tuple)):
        return (type(x).__name__, *(_frozen(a) for a in x))
    if isinstance(x, dict):
        return ("dict", *sorted((k, _frozen(v)) for k, v in x.items()))
    hash(x)
    return (type(x).__name__, x, repr(x) if isinstance(x, float) else None)  # 0.0 is not -0.0


def copy_conv_inputs_channels_last(gm: fx.GraphModule) -> int:
    """Where inductor will run convolutions channels-last (its layout optimisation: the caller
    asks `_torch_private.inductor_layout_optimization`), give each graph input that a
    convolution reads as its input, and that is not channels-last already, an explicit
    channels-last copy read by the convolutions and their backward. Returns how many inputs
    were copied."""
    copies = 0
    for src in list(gm.graph.find_nodes(op="placeholder")):
        val = src.meta.get("val")
        readers = [u for u in src.users if u.target in _CONVS and _conv_input(u) is src]
        if not readers or not isinstance(val, torch.Tensor) or val.ndim != 4:
            continue
        if val.is_contiguous(memory_format=torch.channels_last):
            continue
        first = min(readers, key=lambda u: list(gm.graph.nodes).index(u))
        with gm.graph.inserting_before(first):
            copy = _copy_laid_out(gm.graph, src, torch.channels_last, layout_copy=False)
        # Kept, never made again: inductor keeps a channels-last copy for the backward either way
        # (made again in the backward, the forward still returns a copy of its own).
        copy.meta["partitioner_tag"] = "must_be_in_forward"
        for u in readers:
            u.replace_input_with(src, copy)
        copies += 1
    if copies:
        gm.graph.lint()
        gm.recompile()
    return copies


def copy_expanded_attention_inputs(gm: fx.GraphModule) -> int:
    """Give each value that CPU attention calls read in a layout inductor cannot hand them (its
    `sdpa_constraint`: the inputs' own stride order where the last dimension is the innermost,
    the contiguous order otherwise) an explicit contiguous copy, which those calls read in
    place of the value: one copy per argument it is passed as, as inductor makes them (unless
    its `cache_sdpa_constraint` is set, off by default).

    The case this is for: multi-query attention's one key and value head, repeated over the
    query heads by `expand` and a view (HF's `repeat_kv` with one key/value head: a view,
    stride 0 along the heads); also masks expanded over the batch, and the forward's
    log-sum-exp (heads innermost) read by the backward. Inductor copies such a value
    densely for each call that reads it, the forward's and the backward's, where the plan
    counted the value's storage: HF Falcon (transformers 5.25) at its floor measured 13% over
    the prediction. As a node the copy is counted, and the plan decides whether the forward's
    copy is saved for the backward or made again there. Values are unchanged. Returns how many
    copies were made.
    """
    made = 0
    nodes = list(gm.graph.nodes)
    order = {n: i for i, n in enumerate(nodes)}
    for view in nodes:
        readers = [u for u in view.users if kernels.op_name(u) in kernels.LAID_OUT_READERS]
        val = view.meta.get("val")
        if readers and isinstance(val, torch.Tensor) and not _laid_out_as_asked(val):
            made += _copy_per_argument(gm.graph, view, sorted(readers, key=order.__getitem__))
    if made:
        gm.graph.lint()
        gm.recompile()
    return made


def _copy_per_argument(graph: fx.Graph, view: fx.Node, readers: list[fx.Node]) -> int:
    """Make `readers` (in graph order) read contiguous copies of `view` (a view, or any
    value): the k-th copy where a reader passes it the k-th time, made right before the first
    such reader. Returns how many copies were made."""
    copies: list[fx.Node] = []

    def nth_copy(k: int, reader: fx.Node) -> fx.Node:
        if k == len(copies):
            with graph.inserting_before(reader):
                copies.append(_copy_laid_out(graph, view, torch.contiguous_format))
        return copies[k]

    for u in readers:
        passed = itertools.count()  # times `u` passed the view so far
        u.args, u.kwargs = fx.map_arg(
            (u.args, u.kwargs), lambda a, u=u, passed=passed: nth_copy(next(passed), u) if a is view else a
        )
    return len(copies)


def _copy_laid_out(
    graph: fx.Graph, src: fx.Node, memory_format: torch.memory_format, layout_copy: bool = True
) -> fx.Node:
    """A clone of `src` in `memory_format`, at the graph's insertion point, with its value;
    `layout_copy`: marked as a copy its readers read from memory (see kernels.LAYOUT_COPY)."""
    copy = graph.call_function(_CLONE, (src,), {"memory_format": memory_format})
    copy.meta["val"] = src.meta["val"].clone(memory_format=memory_format)
    if layout_copy:
        copy.meta[kernels.LAYOUT_COPY] = True
    return copy


def _laid_out_as_asked(val: torch.Tensor) -> bool:
    """Whether `val`'s strides are in the order inductor asks of an attention call's input on
    CPU: its own stride order where the last dimension has the smallest stride (ties go to the
    inner dimension), else the contiguous order; dimensions of size 1 do not count."""
    strides = val.stride()
    if not all(isinstance(x, int) for x in (*val.shape, *strides)):
        return True  # symbolic: not judged (left as traced)
    inner_first = sorted(range(val.dim()), key=lambda d: (strides[d], -d))  # ties: inner first
    if inner_first and inner_first[0] != val.dim() - 1:
        inner_first = list(reversed(range(val.dim())))
    dims = [d for d in inner_first if val.shape[d] != 1]
    return all(strides[a] <= strides[b] for a, b in itertools.pairwise(dims))


def _conv_input(node: fx.Node) -> fx.Node | None:
    """The input (not the weight) a convolution or its backward reads."""
    return node.args[0] if node.target is _CONVS[0] else node.args[1]


def copy_views_of_channels_last(gm: fx.GraphModule) -> int:
    """Where inductor runs convolutions channels-last, make explicit the copies it makes for
    views that channels-last values cannot take.

    The joint graph's values are traced contiguous. Inductor writes convolution outputs (and
    the input gradients of their backward) channels-last, and what reads them keeps that
    layout (element-wise ops, pooling, its indices); a view that merges the channel dimension
    with another (a pooling backward's (N*C, H*W) index and gradient) then cannot alias its
    input: inductor writes its input to memory and copies it contiguous. Each such view here
    reads a contiguous clone of its input instead, a node the plan counts (see
    kernels.LAYOUT_COPY); values are unchanged, and inductor no longer writes the input out.
    The layouts are found by running the graph's fake values again with convolution outputs
    made channels-last (element-wise ops and views derive theirs from their inputs; other ops
    that read a channels-last value write one). Returns how many views were given a copy. For
    graphs inductor optimises the layout of (the caller asks
    `_torch_private.inductor_layout_optimization`).
    """
    laid: dict[fx.Node, object] = {}  # node -> its value in inductor's layouts
    copies = 0
    retraced: set[fx.Node] = set()  # views now of a copy: their fake values alias it
    for node in list(gm.graph.nodes):
        val = node.meta.get("val")
        if node.op == "call_function" and node.target is operator.getitem:
            whole = laid.get(node.args[0])
            laid[node] = whole[node.args[1]] if isinstance(whole, (tuple, list)) else val
            continue
        relaid = [a for a in node.all_input_nodes if laid.get(a) is not a.meta.get("val")]
        if node.op != "call_function" or not tp.is_aten_op(node.target) or not (relaid or node.target in _CONVS):
            laid[node] = val  # as traced: nothing it reads is laid out otherwise
            continue
        try:
            got = tp.fake_rerun(node, lambda a: laid.get(a, a.meta.get("val")))
        except (RuntimeError, ValueError):
            laid[node] = val
            if node.target not in _VIEWS:
                continue
            src = node.args[0]
            with gm.graph.inserting_before(node):
                copy = _copy_laid_out(gm.graph, src, torch.contiguous_format)
            node.replace_input_with(src, copy)
            copies += 1
            retraced.add(node)
            continue
        if node.target in _CONVS or (not _keeps_layout(node) and _reads_channels_last(node.all_input_nodes, laid)):
            got = _channels_last(got)
        laid[node] = got
    for node, v in laid.items():
        val = node.meta.get("val")
        if isinstance(v, torch.Tensor) and isinstance(val, torch.Tensor) and v.stride() != val.stride():
            node.meta[LAID_STRIDE] = tuple(v.stride())
    retrace_views(retraced)
    if copies:
        gm.graph.lint()
        gm.recompile()
    return copies


def save_as_traced(
    gm: fx.GraphModule, saved: list[fx.Node], forward: list[fx.Node], in_backward: Callable[[fx.Node], bool]
) -> list[fx.Node]:
    """Where inductor runs convolutions channels-last, keep it from choosing the layout of 4-d
    values the forward saves for the backward.

    Inductor writes each 4-d value the forward returns channels-last when the value is in its
    `nodes_prefer_channels_last` (see `_prefer_channels_last`), by the value's logical shape: a
    (N, H, W, C) value, as ConvNeXt's blocks hold between their convolutions, gets H as its
    innermost dimension. Its (N*H*W, C) view for a matmul then cannot alias it, so inductor
    copies it in the forward and again in the backward, and a saved view it copies to begin
    with; none of which the plan counts. An input the backward reads is such a value too
    (MobileNetV2's images, padded before its first convolution): inductor would return a
    channels-last copy of it, held from the forward to the backward. Each such value that is
    contiguous as traced and as inductor lays it out (see LAID_STRIDE), and that no convolution
    reads, is saved as its (N, H*W, C) view instead, which inductor returns as it is; the
    backward's readers read a 4-d view of that. Values and storages are unchanged. `forward` is the forward's nodes in order,
    `in_backward` tells a node the backward graph computes. Returns the saved nodes, each view
    in place of the value it stands for.
    """
    prefer = _prefer_channels_last(forward)
    out = []
    for value in saved:
        val = value.meta.get("val")
        readers = [u for u in value.users if in_backward(u)]
        if (
            value not in prefer
            or not isinstance(val, torch.Tensor)
            or val.ndim != 4
            or not val.is_contiguous()
            or LAID_STRIDE in value.meta
            or not readers
            or any(u.target in _CONVS for u in value.users)
        ):
            out.append(value)
            continue
        n, h, w, c = val.shape
        with gm.graph.inserting_after(value):
            flat = gm.graph.call_function(torch.ops.aten.view.default, (value, [n, h * w, c]))
        flat.meta["val"] = tp.fake_rerun(flat)
        with gm.graph.inserting_after(flat):
            back = gm.graph.call_function(torch.ops.aten.view.default, (flat, list(val.shape)))
        back.meta["val"] = tp.fake_rerun(back)
        for u in readers:
            u.replace_input_with(value, back)
        out.append(flat)
    return out


def _prefer_channels_last(nodes: list[fx.Node]) -> set[fx.Node]:
    """The nodes of a graph of `nodes` (in order; readers outside it ignored) that inductor's
    layout optimisation prefers channels-last: each convolution, whatever a node in the set
    reads, and, up to the last convolution, whatever reads a node in the set; a batched matmul
    passes the preference neither way."""
    inside = set(nodes)
    prefer: set[fx.Node] = set()
    last_conv = None
    for node in reversed(nodes):
        if node.target is _CONVS[0]:
            prefer.add(node)
            last_conv = last_conv or node
        elif node.target is not _BMM and any(u in prefer for u in node.users):
            prefer.add(node)
    for node in nodes:
        if node is last_conv:
            break
        if node in prefer:
            prefer.update(u for u in node.users if u in inside and u.target is not _BMM)
    return prefer


def _keeps_layout(node: fx.Node) -> bool:
    """Ops whose fake values already follow their inputs' layout: element-wise ops keep it, views
    and permutes derive theirs from it."""
    return torch.Tag.pointwise in getattr(node.target, "tags", ()) or aliased_input(node) is not None


def _reads_channels_last(inputs: list[fx.Node], laid: dict) -> bool:
    """Whether an op reads a 4-d value laid out channels-last: inductor orders a kernel's loops,
    and so its outputs, by the layout of what it reads (eager's kernels keep it too)."""
    return any(
        isinstance(v := laid.get(a), torch.Tensor)
        and v.ndim == 4
        and v.is_contiguous(memory_format=torch.channels_last)
        and not v.is_contiguous()
        for a in inputs
    )


def _channels_last(got):
    """`got`'s 4-d tensors (of a tuple of results too) laid out channels-last."""
    if isinstance(got, (tuple, list)):
        return type(got)(_channels_last(g) for g in got)
    if isinstance(got, torch.Tensor) and got.ndim == 4:
        return got.contiguous(memory_format=torch.channels_last)
    return got
