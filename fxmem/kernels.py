"""How a fusing compiler (inductor) runs the joint graph's ops, as the simulation models it.

Which ops it generates into fused loops rather than calling a library for, which of those a
reader's kernel can compute again element by element, and where it folds an add into a matmul.
Each rule was checked against inductor's generated code. Which values it then writes to memory
is in `fxmem.buffers`; the opaque copies fxmem writes into the graphs it compiles are in
`fxmem.opaque`.
"""

from __future__ import annotations

import bisect
import operator
from collections.abc import Callable, Iterable, Iterator
from typing import TypeVar

import torch
import torch.fx as fx

_N = TypeVar("_N")

__all__ = [
    "LAID_OUT_READERS",
    "LAYOUT_COPY",
    "any_between",
    "NEVER_WRITTEN_OVER",
    "SCATTERS",
    "dense_numel",
    "is_fusible",
    "is_inlinable",
    "is_view_op",
    "kernel_ops",
    "layout",
    "op_name",
    "reach",
]


def any_between(positions: list[int], first: int, last: int) -> bool:
    """Whether one of `positions` (sorted) lies after `first` and before `last`: a library call
    between two kernels, which fxmem keeps inductor from fusing across; a matmul between two
    projections, which parts them."""
    k = bisect.bisect_right(positions, first)
    return k < len(positions) and positions[k] < last


# Fusible ops whose result inductor writes to a buffer of its own (which a kernel fused with
# its only reader may keep to itself): reductions, its seeded random numbers, and scatters
# into a buffer (an embedding's gradient: index_put into zeros, in the kernel around it).
SCATTERS = {"index_put", "_unsafe_index_put", "_unsafe_masked_index_put_accumulate"}
_STORED = {
    "sum", "mean", "amax", "amin", "max", "min", "var", "var_mean", "prod", "any", "all",
    "_softmax", "_log_softmax", "_softmax_backward_data", "_log_softmax_backward_data",
    "native_layer_norm", "native_layer_norm_backward", "inductor_random", "cat",
} | SCATTERS  # fmt: skip
# Besides: element-wise ops without the pointwise tag; constants are computed in their readers;
# a lookup of rows (an embedding) is an indexed load, as a gather by integer indices is
# (`_indexed_load`: Mixtral's tokens sorted by expert).
_FUSIBLE_NON_POINTWISE = _STORED | {
    "where", "clone", "expand", "full", "scalar_tensor", "iota", "embedding",
    "_low_memory_max_pool_offsets_to_indices",  # a max pooling's window offsets made indices
    "slice_scatter", "select_scatter",  # a value placed in a larger one: loaded from either
}  # fmt: skip
# Ops whose output buffer no kernel writes its own output over when it dies there: one inductor
# fills by scattering into it (a mutation: a max pooling's gradient, scattered), and a
# concatenation's, which its inputs' kernels write into and no kernel of its own makes (T5's
# per-chunk attention-bias gradients: their sum is written to a buffer of its own).
NEVER_WRITTEN_OVER = SCATTERS | {"scatter", "scatter_add", "scatter_reduce", "index_add", "cat"}
# node.meta key: a copy of a value into another layout, which its readers read from memory (see
# cleanup.copy_views_of_channels_last): the loops writing it and those reading it run in
# different orders, so no kernel both computes and reads it.
LAYOUT_COPY = "fxmem_layout_copy"

# Library calls inductor hands each input in the layout they require (its `sdpa_constraint`):
# on CPU an input it has not stored, or a view of one it cannot pass in that layout (an
# expanded key), is copied into that layout for each call.
LAID_OUT_READERS = {
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_flash_attention_for_cpu_backward",
}


def is_inlinable(node: fx.Node) -> bool:
    """Fusible ops a reader's kernel can compute again element by element (not _STORED, save a
    reduction over a few elements; an output of a multi-output op, such as layer norm's mean,
    is inlinable when that op is)."""
    if node.target is operator.getitem:
        return isinstance(node.args[0], fx.Node) and is_inlinable(node.args[0])
    if node.meta.get(LAYOUT_COPY) or not is_fusible(node):
        return False
    return op_name(node) not in _STORED or _unrolled(node)


# Reductions inductor writes out as element-wise loops, summing each output's few inputs in
# turn (`unroll_reductions_threshold`), when they reduce fewer than this many elements into
# more than one output (on CPU; on a GPU, into one output too).
_SIMPLE_REDUCTIONS = {"sum", "mean", "amax", "amin", "prod", "any", "all"}
_UNROLLED_BELOW = 8


def _unrolled(node: fx.Node) -> bool:
    """Whether inductor computes reduction `node` element by element: a sum over the few heads
    that share a key (Falcon's key gradients), computed in each reader's kernel."""
    if op_name(node) not in _SIMPLE_REDUCTIONS or not node.args or not isinstance(node.args[0], fx.Node):
        return False
    val, src = node.meta.get("val"), node.args[0].meta.get("val")
    if not isinstance(val, torch.Tensor) or not isinstance(src, torch.Tensor):
        return False
    out, total = val.numel(), src.numel()
    if not isinstance(out, int) or not isinstance(total, int) or out == 0:
        return False  # symbolic sizes: inductor unrolls only known ones
    reduced = total // out
    return reduced == 1 or (reduced < _UNROLLED_BELOW and (out > 1 or val.device.type != "cpu"))


def is_fusible(node: fx.Node) -> bool:
    """Ops inductor generates into fused loops (as opposed to library calls like mm)."""
    if node.op != "call_function":
        return False
    if node.target is operator.getitem:  # an output of a multi-output op: fusible if it is
        return isinstance(node.args[0], fx.Node) and is_fusible(node.args[0])
    if torch.Tag.pointwise in getattr(node.target, "tags", ()):
        return True
    if op_name(node) in SCATTERS:
        return _scatter_fused(node)
    if op_name(node) == "index":
        return _indexed_load(node)
    return op_name(node) in _FUSIBLE_NON_POINTWISE or is_view_op(node)


def _indexed_load(node: fx.Node) -> bool:
    """Whether inductor gathers for `aten.index` in a loop of its own: by integer indices; a
    boolean mask (its result's size depends on the data) goes to aten's kernel."""
    indices = node.args[1] if len(node.args) > 1 else ()
    for i in indices:
        val = i.meta.get("val") if isinstance(i, fx.Node) else None
        if i is not None and (not isinstance(val, torch.Tensor) or val.dtype in (torch.bool, torch.uint8)):
            return False
    return True


def _scatter_fused(node: fx.Node) -> bool:
    """Whether inductor scatters in a kernel of its own rather than calling aten's index_put: not
    under deterministic algorithms, nor for integer or boolean sums, nor for bf16 sums on GPUs
    without bf16 atomic adds (before compute capability 9.0)."""
    if torch.are_deterministic_algorithms_enabled():
        return False
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor) or val.dtype in (torch.int64, torch.bool):
        return False
    if val.dtype == torch.bfloat16 and val.device.type == "cuda":
        return torch.cuda.is_available() and torch.cuda.get_device_capability(val.device) >= (9, 0)
    return True


def layout(node: fx.Node) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """The shape and strides of a node's tensor value; None for other values."""
    val = node.meta.get("val")
    return (tuple(val.shape), tuple(val.stride())) if isinstance(val, torch.Tensor) else None


def dense_numel(node: fx.Node) -> int:
    """The elements of a node's tensor value when that is dense and row-major; -1 when it is
    not, or not a tensor."""
    val = node.meta.get("val")
    return val.numel() if isinstance(val, torch.Tensor) and val.is_contiguous() else -1


def op_name(node: fx.Node) -> str:
    """The aten op's name without its overload ("sum" for aten.sum.dim_IntList)."""
    return getattr(getattr(node.target, "overloadpacket", None), "__name__", "")


def is_view_op(node: fx.Node) -> bool:
    """Ops whose output aliases their input (views)."""
    schema = getattr(node.target, "_schema", None)
    return bool(schema and schema.returns and schema.returns[0].alias_info is not None)


def _folded_addmm(node: fx.Node, index: dict[fx.Node, int], users: list[list[int]]) -> int | None:
    """The mm that inductor folds with `node` into one addmm (its position), or None.

    Inductor rewrites `add(mm(a, b), c)` (either order) into `addmm(c, a, b)` when the mm has
    no other reader and `c` is a tensor of the mm's dtype that broadcasts to its shape; on a
    GPU it keeps them apart when every reader of the sum is pointwise. The addmm is a library
    call: its output and `c` are written to memory, the mm's product never is on its own.
    A sum accumulated over a loop of matmuls (the chunked loss's weight gradient) so holds the
    running sum and the next one at once.
    """
    if node.op != "call_function" or node.target is not torch.ops.aten.add.Tensor or len(node.args) != 2:
        return None
    if node.kwargs.get("alpha", 1) != 1:
        return None
    for inp, mm in (node.args, node.args[::-1]):  # inductor tries add(c, mm) first
        if not (isinstance(mm, fx.Node) and mm.target is torch.ops.aten.mm.default and isinstance(inp, fx.Node)):
            continue
        m, c = mm.meta.get("val"), inp.meta.get("val")
        if len(users[index[mm]]) != 1 or not isinstance(m, torch.Tensor) or not isinstance(c, torch.Tensor):
            continue
        if (
            c.dtype != m.dtype
            or c.ndim > 2
            or any(x not in (1, y) for x, y in zip(c.shape[::-1], m.shape[::-1], strict=False))
        ):
            continue
        if m.device.type != "cpu" and all(torch.Tag.pointwise in getattr(u.target, "tags", ()) for u in node.users):
            continue
        return index[mm]
    return None


def kernel_ops(nodes: list[fx.Node], users: list[list[int]]) -> tuple[list[bool], set[int]]:
    """Per node, whether inductor generates it into a fused loop (an add folded into an addmm
    is a library call); and the mm nodes folded so."""
    index = {n: i for i, n in enumerate(nodes)}
    fusible = [is_fusible(n) for n in nodes]
    folded: set[int] = set()
    for i, n in enumerate(nodes):
        mm = _folded_addmm(n, index, users)
        if mm is not None:
            fusible[i] = False
            folded.add(mm)
    return fusible, folded


def reach(starts: Iterable[_N], onward: Callable[[_N], Iterable[_N]]) -> Iterator[_N]:
    """Each node (an index, or an fx node) reachable from `starts`, once, going on from a node
    to `onward(node)`."""
    stack, seen = list(starts), set()
    while stack:
        j = stack.pop()
        if j not in seen:
            seen.add(j)
            yield j
            stack.extend(onward(j))
